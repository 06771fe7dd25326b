"""Shared entry-point plumbing for train.py, eval.py and the package's commands."""

import sys

from absl import app, flags

UsageError = app.UsageError


def _parse_flags(argv):
  """absl's parser, with bad `--config.KEY=VALUE` overrides reported in one line."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    sys.exit(f"error: {e}\nPass --helpfull to see the flags.")
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    message = str(e.args[0] if e.args else e).replace("\\n", " ").replace("\n", " ").replace("\\", "")
    bad = [a for a in argv[1:] if a.startswith("--config.")]
    where = f" in {' '.join(bad)}" if bad else ""
    sys.exit(f"error: bad config override{where}: {message}")


def run(main) -> None:
  app.run(main, flags_parser=_parse_flags)
