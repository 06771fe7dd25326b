"""The figures of README, docs/ and the configs' docstrings, rendered from result records.

    make docs                                          # render every region
    python -m docs.render.render_docs --check    # exit 1 if a region or a record is stale
    python -m docs.render.render_docs --record docs/results/cpu.jsonl -- \\
        python -m transformer.tools.bench --config configs/default.py --json --label default
    python -m docs.render.render_docs --record docs/results/make_train.jsonl \\
        --from_workdir workdirs/default --wall_time_s 658 --command "make train"
    python -m docs.render.render_docs --record docs/results/cpu.jsonl \\
        --from_json bench/results/cpu.jsonl --command "bash bench/cpu.sh"

A record is one JSON object per line of `docs/results/NAME.jsonl`: what one of the
project's commands printed or wrote (`bench --json`, `memory --json`, `sweeps --dry_run
--json`, eval.py's `eval/<split>-<step>.json`), with its version and where it came from:

  record_version  its producer's RECORD_VERSION when it ran (record_sources.py)
  machine         the hardware it ran on, in words
  date            YYYY-MM-DD (UTC)
  commit          the code that ran (`git rev-parse --short HEAD`, `-dirty` if it had changes)
  command         the command line, as run (a row of --from_json that names its own keeps it)
  source          only on a figure that earlier docs quoted and that was turned into a
                  record afterwards: where it was quoted

Records are appended, never edited: a newer record of the same fact replaces the older
one in the docs, and the older one stays as history. `--record` runs the command (or
reads `--from_json`), attaches the version and the four fields and appends what it printed.

A rendered region is everything between a start marker naming a view and the end
marker, in a Markdown file or a Python docstring:

    <!-- results:VIEW -->
    (replaced by `make docs`)
    <!-- /results -->

VIEW names a function of `docs/render/doc_views.py` (one decorated with @view), which
reads the records and turns them into Markdown. Rendering is deterministic, so `--check`
(and a test) fail when a region no longer matches its records, or when a record shown as
a current figure is of another version than its producer's (record_sources.py).
"""

from __future__ import annotations

import argparse
import datetime
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


def provenance(command: str, machine: str | None = None) -> dict[str, str]:
  """machine, date, commit and command for a record made now, from this checkout."""

  def git(*args: str) -> str:
    return subprocess.run(
      ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()

  commit = git("rev-parse", "--short", "HEAD")
  if git("status", "--porcelain", "--untracked-files=no"):
    commit += "-dirty"
  return {
    "machine": machine or describe_machine(),
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
    "commit": commit,
    "command": command,
  }


def describe_machine() -> str:
  """e.g. '2-core AMD EPYC CPU' (accelerators are named with --machine)."""
  model = "CPU"
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      names = re.findall(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)
    if names:
      model = names[0].strip() + " CPU"
  except OSError:
    pass
  return f"{os.cpu_count()}-core {model}"


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

  from transformer import storage
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
  return {
    "name": "make_train",
    "workdir": workdir,
    "num_train_steps": step,
    "wall_time_s": round(wall_time_s),
    "train_time_s": round(windows[-1]["elapsed_s"]),
    "tokens_per_sec": median("tokens_per_sec"),
    "steps_per_sec": median("steps_per_sec"),
    "tokens_per_sec_windows": [min(tokens_per_sec), max(tokens_per_sec)],
    "mfu": median("mfu"),
    "hfu": median("hfu"),
    "padding_efficiency": median("padding_efficiency"),
    "validation_ppl": validations[-1]["ppl"],
    **{
      key: scores[key]
      for key in (
        "split",
        "num_sentences",
        "beam_size",
        "alpha",
        "bleu",
        "bleu_tok",
        "chrf",
        "ppl",  # the split's (test), as eval.py prints it
        "bleu_signature",
        "sentences_per_sec",
      )
      if key in scores
    },
  }


def json_objects(lines: Iterable[str]) -> list[dict[str, Any]]:
  """The lines that are JSON objects (a command's other output is left out)."""
  found = []
  for line in lines:
    line = line.strip()
    if line.startswith("{"):
      try:
        value = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(value, dict):
        found.append(value)
  return found


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
    help="Append records to this file: the JSON lines the command after "
    "-- prints, or the object in --from_json.",
  )
  parser.add_argument(
    "--from_json",
    metavar="FILE",
    help="With --record: a JSON file a command wrote (e.g. eval.py's "
    "eval/<split>-<step>.json), or JSON lines (bench/results/cpu.jsonl).",
  )
  parser.add_argument(
    "--from_workdir",
    metavar="WORKDIR",
    help="With --record: the make_train record of this `make train` run "
    "(metrics.jsonl and eval/test-<step>.json); needs --wall_time_s.",
  )
  parser.add_argument(
    "--wall_time_s", type=float, help="With --from_workdir: how long `make train` took, in seconds."
  )
  parser.add_argument(
    "--command",
    help="With --from_json or --from_workdir: the command that wrote the file(s) (a row "
    "of --from_json that names its own command keeps it).",
  )
  parser.add_argument(
    "--machine",
    help="With --record: the hardware, in words (default: the CPU's model and core count).",
  )
  return parser


def _record(args: argparse.Namespace, parser: argparse.ArgumentParser, command: list[str]) -> int:
  """--record: appends the records of a command's output, a JSON file or a workdir."""
  if sum(map(bool, (command, args.from_json, args.from_workdir))) != 1:
    parser.error("--record takes one of: a command after --, --from_json, --from_workdir")
  if (args.from_json or args.from_workdir) and not args.command:
    parser.error("--from_json and --from_workdir need --command: the command that ran")
  if args.from_workdir:
    if args.wall_time_s is None:
      parser.error("--from_workdir needs --wall_time_s: how long the command took")
    try:
      records = [make_train_record(args.from_workdir, args.wall_time_s)]
    except (RecordError, OSError, KeyError) as e:
      print(f"error: {e}", file=sys.stderr)
      return 1
    where = provenance(args.command, args.machine)
  elif args.from_json:
    text = storage.read_text(args.from_json)  # eval.py's file may be in a gs:// workdir
    try:
      records = [json.loads(text)]
    except json.JSONDecodeError:
      records = json_objects(text.splitlines())
    where = provenance(args.command, args.machine)
  else:
    where = provenance(" ".join(command), args.machine)
    process = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(process.stdout)
    if process.returncode != 0:
      print(
        f"error: the command exited with code {process.returncode}; nothing recorded",
        file=sys.stderr,
      )
      return 1
    records = json_objects(process.stdout.splitlines())
    if not records:
      print("error: the command printed no JSON object; nothing recorded", file=sys.stderr)
      return 1
  append_records(args.record, records, where)
  print(f"appended {len(records)} record(s) to {args.record}; run `make docs` to render them")
  return 0


def main(argv: list[str]) -> int:
  command = []
  if "--" in argv:
    command = argv[argv.index("--") + 1 :]
    argv = argv[: argv.index("--")]
  parser = _parser()
  args = parser.parse_args(argv)
  if args.record:
    return _record(args, parser, command)

  try:
    changed = render(check=args.check)
    outdated = record_sources.outdated() if args.check else []
  except RecordError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  if args.check:
    for relative in changed:
      print(f"stale: {relative} (run `make docs`)")
    for line in outdated:
      print(f"outdated: {line}")
    return 1 if changed or outdated else 0
  for relative in changed:
    print(f"rendered {relative}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
