"""The code each record file of docs/results/ measures, and the rendered records older
than it.

    python -m docs.render.record_sources    # one line per stale record; exit 1 if any

A record is stale when its commit (`abc1234-dirty` counts as abc1234) predates a change
to a path that produces it, as PRODUCERS lists them per file. A change is a change to
executable code: a .py file whose syntax tree, with docstrings removed, differs (comments
never reach the tree), or any other file whose content differs. Only the records the
docs show count: those a view names in its Records line, or, for a view that quotes one
record without such a line, the newest of its file. Git answers, in a few calls; without
git or with a shallow clone there is no history to ask, and `check` says so.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from docs.render import doc_views

Record = dict[str, Any]

# The model's training-step code, without decoding (model/decoding/) and the draft
# (model/draft.py), which a training step never runs, and the shardings it is placed by.
_TRAIN_STEP_MODEL = (
  "transformer/inference/sharding.py",
  "transformer/model/transformer.py",
  "transformer/model/layers.py",
  "transformer/model/attention.py",
  "transformer/model/attention_kernels.py",
  "transformer/model/primitives.py",
)

# Record file (docs/results/NAME.jsonl) -> the paths whose code its records measure; a
# folder stands for every file under it.
PRODUCERS: dict[str, tuple[str, ...]] = {
  # `make train`: the default config trained, then beam-searched on the test split.
  "make_train": (
    "transformer/model/",
    "transformer/data/",
    "transformer/training/",
    "configs/default.py",
  ),
  # `make test`: the suite's size and time, which the package and the tests both move.
  "make_test": ("transformer/", "tests/", "Makefile"),
  # bench on a CPU (bench/cpu.sh): training steps of the shipped configs and beam search
  # on the default, with freed host memory kept or returned.
  "cpu": (
    "transformer/tools/bench/",
    "transformer/tools/decoding_speed.py",
    "transformer/host_memory.py",
    "transformer/model/",
    "transformer/training/",
    "configs/default.py",
    "configs/wmt14.py",
    "bench/cpu.sh",
  ),
  # bench on one GPU (bench/gpu.sh): the WMT configs' training steps, their precisions and
  # attention kernels, and big's beam search (bench's train_step and beam_search, which
  # run no training loop).
  "gpu": (
    "transformer/tools/bench/",
    "transformer/tools/decoding_speed.py",
    "transformer/config.py",
    "transformer/model/",
    "transformer/inference/",
    "transformer/training/steps.py",
    "transformer/training/state.py",
    "transformer/training/optimizer.py",
    "transformer/training/flops.py",
    "configs/wmt14.py",
    "bench/gpu.sh",
  ),
  # The default's input pipeline (input_speed) and training loop (bench --only
  # train_loop), with freed host memory kept or returned.
  "host_memory": (
    "transformer/tools/input_speed.py",
    "transformer/tools/bench/",
    "transformer/host_memory.py",
    "transformer/data/",
    "transformer/model/",
    "transformer/training/",
    "configs/default.py",
  ),
  # tools.memory: the compiled training step's bytes per device, mesh by mesh.
  "memory": (
    "transformer/tools/memory.py",
    "transformer/training/",
    *_TRAIN_STEP_MODEL,
    "configs/wmt14.py",
  ),
  # tools.compile_check: the training step compiled for TPU slices.
  "compile_check": (
    "transformer/tools/compile_check.py",
    "transformer/tools/op_profile.py",
    "transformer/tools/memory.py",
    "transformer/training/",
    *_TRAIN_STEP_MODEL,
    "configs/wmt14.py",
  ),
  # bench's train_step and beam_search beside the Flax example's (its side is outside
  # this repository).
  "flax_side_by_side": (
    "transformer/tools/bench/",
    "transformer/tools/decoding_speed.py",
    "transformer/host_memory.py",
    "transformer/model/",
    "transformer/training/",
    "configs/wmt14.py",
  ),
  # `sweeps --compile_check v5e-8 --json`: each Table 3 row's training step compiled
  # for a TPU slice (compile_check, run by the sweep per row; report.py only formats the
  # table printed without --json).
  "table3_compile_check": (
    "transformer/sweeps/__main__.py",
    "transformer/sweeps/spec.py",
    "transformer/tools/compile_check.py",
    "transformer/tools/op_profile.py",
    "transformer/tools/memory.py",
    "transformer/training/",
    *_TRAIN_STEP_MODEL,
    "configs/sweeps/table3.py",
    "configs/wmt14.py",
  ),
  # `sweeps --dry_run` of Table 3: each row's parameters and FLOPs per token.
  "table3_dry_run": (
    "transformer/sweeps/",
    "transformer/training/",
    *_TRAIN_STEP_MODEL,
    "configs/sweeps/table3.py",
    "configs/wmt14.py",
  ),
  # The CPU-scale sweeps: each row trained on the default's data, then scored.
  "table3_small": (
    "transformer/sweeps/",
    "transformer/model/",
    "transformer/data/",
    "transformer/training/",
    "transformer/evaluation/",
    "configs/sweeps/table3_small.py",
    "configs/default.py",
  ),
  "decoder_only_vs_encoder_decoder": (
    "transformer/sweeps/",
    "transformer/model/",
    "transformer/data/",
    "transformer/training/",
    "transformer/evaluation/",
    "configs/sweeps/decoder_only_vs_encoder_decoder.py",
    "configs/default.py",
  ),
  "mixed_precision": (
    "transformer/sweeps/",
    "transformer/model/",
    "transformer/data/",
    "transformer/training/",
    "transformer/evaluation/",
    "configs/sweeps/mixed_precision.py",
    "configs/default.py",
  ),
  # bench --only speculative: two trained runs decoded greedily and speculatively.
  "speculative": (
    "transformer/tools/bench/",
    "transformer/model/",
    "transformer/data/",
    "transformer/training/",
    "transformer/evaluation/",
    "configs/default.py",
  ),
  # compare_ctranslate2: `make train`'s run exported (export.py) and decoded both ways.
  "ctranslate2": (
    "transformer/tools/compare_ctranslate2.py",
    "transformer/tools/export.py",
    "transformer/model/",
    "transformer/data/",
    "transformer/training/",
    "transformer/evaluation/",
    "configs/default.py",
  ),
  # tools.restore_memory: restoring averaged parameters, alone or with the whole state.
  "restore_memory": (
    "transformer/tools/restore_memory.py",
    "configs/wmt14.py",  # the configs it restores
    "transformer/inference/checkpoints.py",
    "transformer/inference/model_setup.py",
    "transformer/training/checkpoints.py",
    "transformer/training/state.py",
  ),
  # tools.input_speed: real tokens and padding of the default's batches per batching.
  "input_pipeline": (
    "transformer/tools/input_speed.py",
    "transformer/data/",
    "configs/default.py",
  ),
}


# Record files allowed to trail the code they measure, with why. `make test`'s record
# measures the whole package and suite, so any commit after it, its own record's commit
# included, would make it stale: it is remade when the suite's size or time moves, and
# its view names the commit it was taken at. check() leaves these out.
TRAILS_THE_CODE: dict[str, str] = {
  "make_test": "the suite's own record: every later commit moves it a little",
}

# Record files whose shown records predate code they measure, each with why it is not
# rerun yet. The list is strict both ways: a file that goes stale and is not here fails
# tests/test_render_docs.py, and so does a file here that is fresh again, until its entry
# goes. It lives here, not in the tests, so that editing it changes no record's producers.
# Why the records below wait: two changes touched files they measure. The first day on a
# pod (jax.distributed's start-up, the exit paths, bounded reads, a notice's place in the
# loop, a log line's wording, config.final_step) changed no compiled step, batch or
# decoded token. The serving layer (transformer/inference) moved the sharding rules, the eval
# step and the checkpoints' read side below training and made a search's arrays inputs of
# decode's program (the same computation); the decoding and loss tests hold every output
# equal. Their figures should not move; one rerun of each confirms it. Since then the
# einsum kernel takes the softmax's denominator from its P V matmul and recomputes the
# weights in its backward pass (attention_kernels.softmax_attention_with_ones): the same
# function to float32 rounding (tests/test_model_attention_kernels.py holds it to 1e-5),
# but the CPU's step times and peak memory may move by it. make_train was rerun with it:
# validation perplexity 10.13 against 10.32, BLEU 28.38 against 27.98.
_NO_FIGURE_MOVED = (
  "code moved, and the einsum kernel's softmax is computed in another order (the same "
  "function to float32 rounding): see the comment above"
)
AWAITING_RERUN: dict[str, str] = {
  name: _NO_FIGURE_MOVED
  for name in (
    "cpu",
    "ctranslate2",
    "decoder_only_vs_encoder_decoder",
    "flax_side_by_side",
    "host_memory",
    "input_pipeline",
    "memory",
    "speculative",
    "table3_dry_run",
    "table3_small",
  )
}
# compile_check's records of the configs as they are (base and big on a v5e-8, the
# bf16 override, every slice and --search_mesh in "Before you launch") are remade at the
# code as it is. The step experiments (docs/performance.md, "Changes to the step"), each
# one config override compiled beside the config as it was then, are the history of
# those changes: each row shows the step it was measured against.
AWAITING_RERUN["compile_check"] = (
  "the step experiments: each override compiled beside the config as it was then, which "
  "its row shows as 'step before' (the configs and slices are remade)"
)
# bench/gpu.sh ran on one GPU, a mesh of one device. Since then each scanned layer's
# gradient is split over the data axis inside the layer loop (model/transformer.py:
# _split_layer_grads), which applies only where the data axis has more than one device:
# the one-GPU step is the program it was. The einsum kernel's new form (above) changes
# the rows that ran einsum (float32, and bf16 with einsum), not those with cuDNN. Since
# then the WMT configs compile their layers unrolled without recomputation and fuse the
# loss, which changes every row; no GPU has been lent since.
AWAITING_RERUN["gpu"] = (
  "the einsum kernel's new softmax, and the WMT configs' unrolled layers without "
  "recomputation and fused loss, change the rows: to be rerun on the next GPU"
)
# The mixed-precision sweep's float32 rows, and its bf16 rows as they were, ran the commit
# before the residual stream went to float32 in every precision: that change leaves a
# float32 run's computation as it was, and the earlier bf16 rows are the "before" the docs
# show beside the new ones.
# The sweep's four rows at 2b1ee99 ran before rbg masks were drawn manual over every mesh
# axis (model/primitives.py: _random_bits). The sweep trains the default config, which
# draws threefry masks on one device, a path that change leaves as it was: make_train,
# the same config, was rerun after it and ended with the same perplexity and BLEU.
AWAITING_RERUN["mixed_precision"] = (
  "the bf16 rows with the residual stream in bf16, which the float32 residual stream was "
  "measured against; the sweep's four rows predate a change to rbg masks on a mesh, which "
  "the sweep (threefry, one device) does not run"
)


def rendered_records(
  views: dict[str, Callable[[], str]] | None = None,
) -> dict[str, list[Record]]:
  """Record file name -> the records the views show: those each view passes to its
  Records line (doc_views.source), else the newest of each file the view read."""
  shown: dict[str, list[Record]] = {}
  original_source, original_read = doc_views.source, doc_views.read_records

  def add(name: str, records: list[Record]) -> None:
    kept = shown.setdefault(name, [])
    kept += [r for r in records if r not in kept]  # views read their own copies

  try:
    for view in (views or doc_views.views()).values():
      sourced: list[str] = []
      read: dict[str, list[Record]] = {}

      def source(name: str, records: Any, sourced: list = sourced) -> str:
        sourced.append(name)
        add(name, list(records))
        return original_source(name, records)

      def read_records(name: str, results_dir: str | None = None, read: dict = read) -> list:
        read[name] = original_read(name, results_dir)
        return read[name]

      doc_views.source, doc_views.read_records = source, read_records
      view()
      for name, records in read.items():
        if name not in sourced and records:
          add(name, records[-1:])
  finally:
    doc_views.source, doc_views.read_records = original_source, original_read
  return shown


def executable(path: str, text: bytes | None) -> str | bytes | None:
  """What of a file runs: a .py file's syntax tree without docstrings (None: no file)."""
  if text is None or not path.endswith(".py"):
    return text
  try:
    tree = ast.parse(text)
  except SyntaxError:
    return text
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      first = node.body[0] if node.body else None
      if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
      ):
        node.body = node.body[1:] or [ast.Pass()]
  return ast.dump(tree)


class _Git:
  def __init__(self, root: str):
    self.root = root
    self._blobs = subprocess.Popen(
      ["git", "cat-file", "--batch"],
      cwd=root,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
    )

  def __call__(self, *args: str) -> str:
    return subprocess.run(
      ["git", *args], cwd=self.root, capture_output=True, text=True, check=True
    ).stdout

  def blob(self, commit: str, path: str) -> bytes | None:
    """The file at a commit, or None where it does not exist."""
    assert self._blobs.stdin and self._blobs.stdout
    self._blobs.stdin.write(f"{commit}:{path}\n".encode())
    self._blobs.stdin.flush()
    header = self._blobs.stdout.readline().split()
    if header[-1] == b"missing":
      return None
    size = int(header[2])
    data = self._blobs.stdout.read(size + 1)[:-1]  # the content, then a newline
    return data

  def close(self) -> None:
    assert self._blobs.stdin
    self._blobs.stdin.close()
    self._blobs.wait()


def _first_change(git: _Git, since: str, path: str) -> str:
  """The first commit after `since` that changed the executable code of `path`."""
  before = executable(path, git.blob(since, path))
  for commit in git("log", "--reverse", "--format=%h", f"{since}..HEAD", "--", path).split():
    after = executable(path, git.blob(commit, path))
    if after != before:
      return commit
  return "HEAD"


def _line_numbers(name: str, records: list[Record], root: str) -> list[int]:
  """Where the records are in docs/results/NAME.jsonl (1-based)."""
  path = os.path.join(root, "docs", "results", f"{name}.jsonl")
  with open(path, encoding="utf-8") as f:
    return [n for n, line in enumerate(f, 1) if line.strip() and json.loads(line) in records]


def stale(
  shown: dict[str, list[Record]], producers: dict[str, tuple[str, ...]], root: str
) -> list[str]:
  """One line for each shown record whose commit predates a change to its producers."""
  git = _Git(root)
  problems = []
  try:
    by_commit: dict[tuple[str, str], list[Record]] = {}
    for name, records in shown.items():
      for record in records:
        by_commit.setdefault((name, str(record["commit"]).split("-")[0]), []).append(record)
    for (name, commit), records in sorted(by_commit.items()):
      if name not in producers:
        problems.append(f"docs/results/{name}.jsonl: no producing paths in PRODUCERS")
        continue
      try:
        git("cat-file", "-e", f"{commit}^{{commit}}")
      except subprocess.CalledProcessError:
        problems.append(
          f"docs/results/{name}.jsonl: commit {commit} of {len(records)} shown record(s) "
          "is not in this repository's history"
        )
        continue
      changed = git("diff", "--name-only", commit, "HEAD", "--", *producers[name]).split()
      code_changed = [
        path
        for path in changed
        if executable(path, git.blob(commit, path)) != executable(path, git.blob("HEAD", path))
      ]
      if code_changed:
        path = code_changed[0]
        others = f" (and {len(code_changed) - 1} more)" if len(code_changed) > 1 else ""
        lines = ", ".join(map(str, _line_numbers(name, records, root)))
        problems.append(
          f"docs/results/{name}.jsonl line(s) {lines}: commit {commit} predates "
          f"{_first_change(git, commit, path)}, which changed {path}{others}: rerun and append"
        )
  finally:
    git.close()
  return problems


def unavailable(root: str) -> str | None:
  """Why the history cannot be asked (no git, not a clone, a shallow clone), or None."""
  try:
    shallow = subprocess.run(
      ["git", "rev-parse", "--is-shallow-repository"],
      cwd=root,
      capture_output=True,
      text=True,
    )
  except OSError:
    return "git is not installed"
  if shallow.returncode != 0:
    return f"{root} is not a git clone"
  if shallow.stdout.strip() == "true":
    return "a shallow clone has no history to compare the records' commits with"
  return None


def check(root: str = doc_views.REPO_ROOT) -> tuple[list[str], str | None]:
  """(a line per stale shown record, why nothing could be checked or None)."""
  reason = unavailable(root)
  if reason:
    return [], reason
  shown = {
    name: records for name, records in rendered_records().items() if name not in TRAILS_THE_CODE
  }
  return stale(shown, PRODUCERS, root), None


def main() -> int:
  problems, reason = check()
  if reason:
    print(f"not checked: {reason}")
    return 0
  for line in problems:
    print(line)
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
