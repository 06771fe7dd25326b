"""Evaluation across processes: the same hypotheses and BLEU as one process, whatever
order the mesh puts the processes' devices in; a preemption notice to one process stops
every process after the same batch."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers.processes import subprocess_env
from tests.helpers.tiny_run import REPO, free_port
from transformer.inference import distributed


def _evaluate(workdir, num_processes, devices_per_process, order):
  """(scores printed by process 0, hypotheses) of tests/helpers/multihost_eval.py."""
  env = subprocess_env(devices_per_process)
  port = free_port()
  processes = [
    subprocess.Popen(
      [
        sys.executable,
        "tests/helpers/multihost_eval.py",
        workdir,
        "test",
        str(i),
        str(num_processes),
        str(port),
        order,
      ],
      cwd=REPO,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(num_processes)
  ]
  outputs = [p.communicate(timeout=300)[0] for p in processes]
  for p, output in zip(processes, outputs):
    assert p.returncode == 0, output[-3000:]
  scores = json.loads([line for line in outputs[0].splitlines() if line.startswith("{")][-1])
  with open(scores["path"].removesuffix(".json") + ".hyp.txt", encoding="utf-8") as f:
    hypotheses = f.read().splitlines()
  os.remove(scores["path"])  # the next run must write its own
  return scores, hypotheses


def test_two_processes_on_an_interleaved_mesh_match_one_process(trained_run, tmp_path):
  _, trained = trained_run
  workdir = str(tmp_path / "run")
  shutil.copytree(trained, workdir)

  alone, alone_hypotheses = _evaluate(workdir, 1, 4, "process")
  assert alone["device_owners"] == [0, 0, 0, 0]
  # The check below can only catch a mix-up if sentences get different translations.
  assert len(set(alone_hypotheses)) > len(alone_hypotheses) * 3 // 4

  # Each process holds every other block of rows: a gather that assumed process p's
  # outputs to be block p of the batch would attach them to other sentences.
  together, hypotheses = _evaluate(workdir, 2, 2, "interleaved")
  assert together["device_owners"] == [0, 1, 0, 1]
  assert hypotheses == alone_hypotheses
  for key in ("bleu", "bleu_tok", "chrf", "num_sentences"):
    assert together[key] == alone[key], key
  assert abs(together["ppl"] - alone["ppl"]) < 1e-4 * alone["ppl"]


@pytest.mark.slow  # two eval.py (or generate.py) processes
@pytest.mark.parametrize("entry_point", ["eval.py", "generate.py"])
def test_a_notice_to_one_process_stops_both_between_batches_writing_nothing(
  trained_run, small_corpus, tmp_path, entry_point
):
  """jax.distributed's handler takes SIGTERM on several processes. Sent to process 1
  once it has searched its second batch, both processes stop after the same batch, in
  one line each, and nothing is written: no scores or output file from eval.py, no
  translation from generate.py."""
  _, trained = trained_run
  workdir = tmp_path / "run"
  shutil.copytree(trained, workdir)
  shutil.rmtree(workdir / "eval", ignore_errors=True)  # what other tests evaluated
  marker = tmp_path / "notice"
  env = subprocess_env(
    1, FAULT_NOTICE_PROCESS="1", FAULT_NOTICE_AFTER_BATCH="2", FAULT_NOTICE_MARKER=str(marker)
  )
  port = free_port()
  cluster = [f"--coordinator_address=localhost:{port}", "--num_processes=2"]
  if entry_point == "eval.py":
    job = ["--workdir", str(workdir), "--split", "test", "--search", "greedy"]
  else:  # the test split's sources, one per line, as a user's file
    sources = tmp_path / "sources.txt"
    with open(small_corpus[0], encoding="utf-8") as f:
      sources.write_text("".join(line.split("\t")[0] + "\n" for line, _ in zip(f, range(143))))
    job = [
      "translate",
      "--workdir",
      str(workdir),
      "--input_file",
      str(sources),
      "--search",
      "greedy",
    ]
  processes = [
    subprocess.Popen(
      [
        sys.executable,
        "tests/helpers/fault_injection.py",
        entry_point,
        *cluster,
        f"--process_id={i}",
        *job,
      ],
      cwd=REPO,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  try:
    outputs = [p.communicate(timeout=300) for p in processes]
  finally:
    for p in processes:
      if p.poll() is None:
        p.kill()
  assert marker.exists(), outputs[1][1][-3000:]
  last_lines = [stderr.strip().splitlines()[-1] for _, stderr in outputs]
  for p, (stdout, stderr) in zip(processes, outputs):
    assert p.returncode == distributed.NOTICE_EXIT_CODE, stderr[-3000:]
    # No scores, no translations (of 143 lines; gloo prints that it connected).
    assert "BLEU" not in stdout and len(stdout.splitlines()) < 100, stdout[-3000:]
  # 143 sentences in batches of 16: nine. The agreed batch is the second or the third.
  assert last_lines[0] == last_lines[1] and last_lines[0] in [
    f"error: stopped by SIGTERM (a preemption notice) after {n} batches; nothing was "
    "written: rerun the same command"
    for n in (2, 3)
  ], last_lines
  assert not (workdir / "eval").exists() or os.listdir(workdir / "eval") == []
