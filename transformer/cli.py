"""Shared entry-point plumbing for train.py, eval.py and the package's commands."""

import sys

from absl import app, flags

UsageError = app.UsageError


def _parse_flags(argv):
  """absl's parser, with bad `--config.KEY=VALUE` overrides reported in one line."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:  # one line: the last line of stderr is what scripts show
    sys.exit(f"error: {e} (pass --helpfull to see the flags)")
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    while e.args and isinstance(e.args[0], BaseException):  # KeyError inside AttributeError
      e = e.args[0]
    message = str(e.args[0] if e.args else e).replace("\\n", " ").replace("\n", " ").replace("\\", "")
    overrides = [a for a in argv[1:] if a.startswith("--config.")]
    # Name the override the message is about: its last key part quoted in it ('num_heds'),
    # else appearing in it, else all of them.
    leaf = {a: a.split("=")[0].rsplit(".", 1)[-1] for a in overrides}
    bad = ([a for a in overrides if f"'{leaf[a]}'" in message] or
           [a for a in overrides if leaf[a] in message] or overrides)
    where = f" {' '.join(bad)}" if bad else ""
    sys.exit(f"error: bad config override{where}: {message}")


def run(main) -> None:
  app.run(main, flags_parser=_parse_flags)
