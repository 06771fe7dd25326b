"""The figures of README, docs/ and the configs' docstrings, rendered from result records.

    make docs                                    # render every region
    python -m docs.render.render_docs --check    # exit 1 if a region or a record is stale
    python -m docs.render.render_docs --record docs/results/cpu.jsonl -- \\
        python -m transformer.tools.bench --config configs/default.py --json --label default
    python -m docs.render.render_docs --record docs/results/make_train.jsonl \\
        --from_workdir workdirs/default --wall_time_s 658 --command "make train"

A record is one JSON object per line of `docs/results/NAME.jsonl`: what one of the
project's commands printed or wrote, plus its producer's `record_version` and its
`machine`, `date`, `commit` and `command` (docs/results/README.md). Records are appended,
never edited; `--record` runs the command (or reads `--from_json`, `--from_workdir`) and
appends what it printed with those fields.

A region, in a Markdown file or a Python docstring, is rendered by the view it names (a
function of doc_views.py decorated with @view); `--check` and a test fail when a region
no longer matches its records, or shows as current a record of another version than its
producer's (record_sources.py):

    <!-- results:VIEW -->
    (replaced by `make docs`)
    <!-- /results -->
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable
from typing import Any

from docs.render import record_sources
from docs.render.doc_views import REPO_ROOT, RecordError
from docs.render.doc_views import views as all_views
from transformer import storage
from transformer.versions import provenance

# The files that hold rendered regions: README, every page of docs/ (not the history
# under docs/notes/), and the configs' docstrings.
RENDERED_GLOBS = ("README.md", "docs/*.md", "configs/*.py", "configs/sweeps/*.py")

REGION = re.compile(
  r"(?P<start><!-- results:(?P<view>[\w.-]+) -->\n)(?P<body>.*?)"
  r"(?P<end>^[ \t]*<!-- /results -->)",
  re.DOTALL | re.MULTILINE,
)


def render_text(text: str, views: dict[str, Callable[[], str]], where: str = "") -> str:
  """text with every region's body replaced by its view's Markdown (indent kept)."""

  def replace(match: re.Match) -> str:
    name = match.group("view")
    if name not in views:
      raise RecordError(
        f"{where}: unknown view {name!r} in a results region; the views are "
        f"{', '.join(sorted(views))}"
      )
    end = match.group("end")
    indent = end[: len(end) - len(end.lstrip(" \t"))]
    body = views[name]().rstrip("\n")
    body = "\n".join(indent + line if line else "" for line in body.split("\n"))
    return match.group("start") + body + "\n" + match.group("end")

  return REGION.sub(replace, text)


def rendered_files(root: str = REPO_ROOT) -> list[str]:
  """Every file that may hold a region, relative to root."""
  import glob

  found = []
  for pattern in RENDERED_GLOBS:
    found += sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, pattern)))
  return found


def render(
  root: str = REPO_ROOT, check: bool = False, views: dict[str, Callable[[], str]] | None = None
) -> list[str]:
  """Renders every region under root; returns the files that changed (or would, if check)."""
  if views is None:
    views = all_views()
  changed = []
  for relative in rendered_files(root):
    path = os.path.join(root, relative)
    with open(path, encoding="utf-8") as f:
      text = f.read()
    new_text = render_text(text, views, where=relative)
    if new_text != text:
      changed.append(relative)
      if not check:
        with open(path, "w", encoding="utf-8") as f:
          f.write(new_text)
  return changed


# Making records.


def append_records(path: str, records: list[dict[str, Any]], where: dict[str, str]) -> None:
  """Appends records to a .jsonl file, each with its producer's record_version (where
  record_sources.PRODUCERS names one for the file) and the provenance in `where`. A record
  that names its own command or version keeps it: a script that runs several commands
  names each row's."""
  name = os.path.basename(path).removesuffix(".jsonl")
  version = {}
  if name in record_sources.PRODUCERS:
    version = {"record_version": record_sources.producer_version(name)}
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "a", encoding="utf-8") as f:
    for record in records:
      own = {k: record[k] for k in ("record_version", "command") if k in record}
      f.write(json.dumps({**record, **version, **where, **own}) + "\n")


def make_train_record(workdir: str, wall_time_s: float) -> dict[str, Any]:
  """What `make train` reached, from its workdir: the training run's metrics.jsonl (the
  logged windows, the last validation) and eval.py's JSON of the test split at the last
  step. wall_time_s is the command's own time, measured outside it."""
  import statistics

  from transformer.training import reporting

  records = reporting.read_metrics(workdir)
  windows = [r for r in records if r["kind"] == "train"]
  validations = [r for r in records if r["kind"] == "validation"]
  if not windows or not validations:
    raise RecordError(f"{workdir}: metrics.jsonl has no logged steps or no validation")
  step = windows[-1]["step"]
  scores = storage.read_json(storage.join(workdir, "eval", f"test-{step}.json"))

  def median(key: str) -> float | None:
    values = [r[key] for r in windows if r.get(key) is not None]
    return statistics.median(values) if values else None

  tokens_per_sec = [r["tokens_per_sec"] for r in windows]
  # eval.py's figures of the split (its ppl is the test split's).
  evaluated = "split num_sentences beam_size alpha bleu bleu_tok chrf ppl bleu_signature"
  record = {"name": "make_train", "workdir": workdir, "num_train_steps": step}
  record |= {"wall_time_s": round(wall_time_s), "train_time_s": round(windows[-1]["elapsed_s"])}
  record |= {k: median(k) for k in ("tokens_per_sec", "steps_per_sec")}
  record["tokens_per_sec_windows"] = [min(tokens_per_sec), max(tokens_per_sec)]
  record |= {k: median(k) for k in ("mfu", "hfu", "padding_efficiency")}
  record["validation_ppl"] = validations[-1]["ppl"]
  return record | {k: scores[k] for k in evaluated.split() + ["sentences_per_sec"] if k in scores}


def json_objects(lines: Iterable[str]) -> list[dict[str, Any]]:
  """The lines that are JSON objects (a command's other output is left out)."""
  found = []
  for line in (line.strip() for line in lines if line.strip().startswith("{")):
    try:
      found.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return [value for value in found if isinstance(value, dict)]


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python -m docs.render.render_docs",
    description="Render the results regions of README, docs/ and the configs from "
    "docs/results/*.jsonl, or append records to one of those files.",
  )
  parser.add_argument(
    "--check",
    action="store_true",
    help="Change nothing; exit 1 if a region differs from its records or shows a record "
    "older than its producer's RECORD_VERSION.",
  )
  parser.add_argument(
    "--record",
    metavar="FILE.jsonl",
    help="Append to this file the JSON lines that the "
    "command after -- prints, or the records of --from_json or --from_workdir.",
  )
  parser.add_argument(
    "--from_json",
    metavar="FILE",
    help="A JSON file a command wrote (eval.py's "
    "eval/<split>-<step>.json), or JSON lines (bench/results/cpu.jsonl).",
  )
  parser.add_argument(
    "--from_workdir",
    metavar="WORKDIR",
    help="The make_train record of this `make train` "
    "run (metrics.jsonl and eval/test-<step>.json); needs --wall_time_s.",
  )
  parser.add_argument(
    "--wall_time_s", type=float, help="With --from_workdir: how long `make train` took (s)."
  )
  parser.add_argument(
    "--command",
    help="With --from_json or --from_workdir: the command that wrote the "
    "file(s) (a row of --from_json that names its own command keeps it).",
  )
  parser.add_argument(
    "--machine", help="The hardware, in words (default: the CPU's model and core count)."
  )
  return parser


def _records(args: argparse.Namespace, command: list[str]) -> tuple[list[dict], dict]:
  """--record: the records of a workdir, a JSON file or a command's output, and where
  they came from."""
  if args.from_workdir:
    records = [make_train_record(args.from_workdir, args.wall_time_s)]
  elif args.from_json:
    text = storage.read_text(args.from_json)  # eval.py's file may be in a gs:// workdir
    try:
      records = [json.loads(text)]
    except json.JSONDecodeError:
      records = json_objects(text.splitlines())
  else:
    process = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(process.stdout)
    if process.returncode != 0:
      raise RecordError(f"the command exited with code {process.returncode}; nothing recorded")
    records = json_objects(process.stdout.splitlines())
    if not records:
      raise RecordError("the command printed no JSON object; nothing recorded")
  return records, provenance(args.command or " ".join(command), args.machine)


def main(argv: list[str]) -> int:
  split = argv.index("--") if "--" in argv else len(argv)
  argv, command = argv[:split], argv[split + 1 :]
  parser = _parser()
  args = parser.parse_args(argv)
  if args.record:
    if sum(map(bool, (command, args.from_json, args.from_workdir))) != 1:
      parser.error("--record takes one of: a command after --, --from_json, --from_workdir")
    if (args.from_json or args.from_workdir) and not args.command:
      parser.error("--from_json and --from_workdir need --command: the command that ran")
    if args.from_workdir and args.wall_time_s is None:
      parser.error("--from_workdir needs --wall_time_s: how long the command took")
  try:
    if args.record:
      records, where = _records(args, command)
      append_records(args.record, records, where)
      print(f"appended {len(records)} record(s) to {args.record}; run `make docs` to render them")
      return 0
    changed = render(check=args.check)
    outdated = record_sources.outdated() if args.check else []
  except (RecordError, OSError, KeyError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  for relative in changed:
    print(f"stale: {relative} (run `make docs`)" if args.check else f"rendered {relative}")
  for line in outdated:
    print(f"outdated: {line}")
  return 1 if args.check and (changed or outdated) else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
