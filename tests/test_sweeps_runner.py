"""The local runner (runner.py): what a row's workdir says about it, and running rows'
train.py and eval.py in turn. Most tests stand a tiny fake interpreter in for Python, so
the commands, their order and the error handling are checked without training."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import types

import pytest

from tests.helpers import tiny_run
from tests.helpers.sweep_helpers import REPO, fake_finished_row, write_sweep
from transformer import config as config_lib
from transformer import storage, versions
from transformer.sweeps import runner, spec
from transformer.training import checkpoints, loop

# Stands in for `python`: logs [script, cwd, args], then acts as BEHAVIOUR[script] says:
# train.py writes checkpoints up to "reach" and exits "rc"; eval.py writes its report.
FAKE_PYTHON = f"""#!{sys.executable}
import json, os, signal, sys, time
here = os.path.dirname(os.path.abspath(__file__))
script, args = os.path.basename(sys.argv[1]), sys.argv[2:]
with open(os.path.join(here, "calls.jsonl"), "a") as f:
  f.write(json.dumps([script, os.getcwd(), args]) + "\\n")
behaviour = json.load(open(os.path.join(here, "behaviour.json"))).get(script, {{}})
workdir = args[args.index("--workdir") + 1]
if behaviour.get("sigterm_parent"):
  def terminated(signum, frame):
    open(os.path.join(here, "got_sigterm"), "w").close()
    sys.exit(0)
  signal.signal(signal.SIGTERM, terminated)
  time.sleep(1.0)
  os.kill(os.getppid(), signal.SIGTERM)
  time.sleep(30)
  sys.exit(5)
if script == "train.py":
  for step in range(2, behaviour.get("reach", 6) + 1, 2):
    os.makedirs(os.path.join(workdir, "checkpoints", str(step)), exist_ok=True)
else:
  step = args[args.index("--step") + 1]
  os.makedirs(os.path.join(workdir, "eval"), exist_ok=True)
  with open(os.path.join(workdir, "eval", f"validation-{{step}}.json"), "w") as f:
    json.dump({{"ppl": 3.0, "bleu": 10.0, "num_sentences": 7}}, f)
sys.exit(behaviour.get("rc", 0))
"""


@pytest.fixture
def fake_python(tmp_path):
  """(path of the fake interpreter, set its behaviour, read its calls)."""
  directory = tmp_path / "fake"
  directory.mkdir()
  path = directory / "python"
  path.write_text(FAKE_PYTHON)
  path.chmod(0o755)
  (directory / "behaviour.json").write_text("{}")

  def behave(**behaviour):
    (directory / "behaviour.json").write_text(json.dumps(behaviour))

  def calls():
    log = directory / "calls.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

  return types.SimpleNamespace(path=str(path), behave=behave, calls=calls, dir=directory)


def _sweep(*names, base_overrides=None, num_train_steps=6, grad_accum_steps=1):
  rows = [spec.Row(name, {"model.d_model": 16}) for name in names]
  configs = {
    name: types.SimpleNamespace(num_train_steps=num_train_steps, grad_accum_steps=grad_accum_steps)
    for name in names
  }
  return spec.Sweep("s", "configs/default.py", base_overrides or {}, rows), configs


def _read_log(workdir):
  with open(os.path.join(workdir, "sweep_log.jsonl")) as f:
    return [json.loads(line) for line in f]


def _write_metrics(row_dir, records):
  os.makedirs(row_dir, exist_ok=True)
  with open(os.path.join(row_dir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)


# ----------------------------------------------------------------------------------
# final_results and row_state: reading a row's workdir.


def test_final_results_none_without_a_final_validation(tmp_path):
  """Nothing evaluated at the final step: no workdir, no metrics, or validation only at
  an earlier step (and eval.py's report for another step) is not a result."""
  row_dir = str(tmp_path / "r")
  assert runner.final_results(row_dir, 6) is None
  _write_metrics(
    row_dir,
    [{"step": 4, "kind": "validation", "ppl": 9.0}, {"step": 6, "kind": "train", "ppl": 8.0}],
  )
  os.makedirs(os.path.join(row_dir, "eval"))
  with open(os.path.join(row_dir, "eval", "validation-4.json"), "w") as f:
    json.dump({"ppl": 1.0, "bleu": 1.0}, f)
  assert runner.final_results(row_dir, 6) is None


def test_final_results_from_metrics_take_the_last_validation_record(tmp_path):
  """Without eval.py's report, the training run's last validation record at the final
  step counts (BLEU only if it has one); no tokenized BLEU, no sentence count."""
  row_dir = fake_finished_row(str(tmp_path), "r", 6, ppl=5.0, bleu=20.0, from_eval_py=False)
  assert runner.final_results(row_dir, 6) == {
    "ppl": 5.0,
    "bleu": 20.0,
    "bleu_tok": None,
    "bleu_sentences": None,
    "source": "metrics.jsonl",
  }
  _write_metrics(row_dir, [{"step": 6, "kind": "validation", "ppl": 7.0}])
  assert runner.final_results(row_dir, 6)["bleu"] is None


def test_final_results_prefer_eval_py_over_metrics(tmp_path):
  """eval.py's beam search of the whole split wins over the training run's record."""
  row_dir = fake_finished_row(str(tmp_path), "r", 6, ppl=5.0, bleu=25.0)
  _write_metrics(row_dir, [{"step": 6, "kind": "validation", "ppl": 9.0, "bleu": 1.0}])
  assert runner.final_results(row_dir, 6) == {
    "ppl": 5.0,
    "bleu": 25.0,
    "bleu_tok": 25.5,
    "bleu_sentences": 3000,
    "source": "eval.py",
  }
  # A report without the optional fields still reads.
  with open(os.path.join(row_dir, "eval", "validation-6.json"), "w") as f:
    json.dump({"ppl": 4.0, "bleu": 24.0}, f)
  assert runner.final_results(row_dir, 6) == {
    "ppl": 4.0,
    "bleu": 24.0,
    "bleu_tok": None,
    "bleu_sentences": None,
    "source": "eval.py",
  }


def test_row_state_from_checkpoints_and_results(tmp_path):
  """new -> partial -> trained -> finished as the workdir fills; a final evaluation from
  metrics.jsonl finishes a row only when eval.py's evaluation was not asked for."""
  row_dir = str(tmp_path / "r")
  assert runner.row_state(row_dir, 6, final_eval=True) == "new"
  os.makedirs(os.path.join(row_dir, "checkpoints"))
  assert runner.row_state(row_dir, 6, final_eval=True) == "new"
  os.makedirs(os.path.join(row_dir, "checkpoints", "2"))
  os.makedirs(os.path.join(row_dir, "checkpoints", "4"))
  os.makedirs(os.path.join(row_dir, "checkpoints", "6.orbax-checkpoint-tmp-1"))  # torn save
  assert runner.row_state(row_dir, 6, final_eval=False) == "partial"
  os.makedirs(os.path.join(row_dir, "checkpoints", "6"))
  for final_eval in (True, False):
    assert runner.row_state(row_dir, 6, final_eval=final_eval) == "trained"
  _write_metrics(row_dir, [{"step": 6, "kind": "validation", "ppl": 9.0}])
  assert runner.row_state(row_dir, 6, final_eval=False) == "finished"
  assert runner.row_state(row_dir, 6, final_eval=True) == "trained"
  os.makedirs(os.path.join(row_dir, "eval"))
  with open(os.path.join(row_dir, "eval", "validation-6.json"), "w") as f:
    json.dump({"ppl": 4.0, "bleu": 24.0}, f)
  assert runner.row_state(row_dir, 6, final_eval=True) == "finished"


# ----------------------------------------------------------------------------------
# run_local with a fake interpreter.


def test_run_local_trains_then_evaluates_with_absolute_workdirs(tmp_path, monkeypatch, fake_python):
  """A new row runs train.py then eval.py from the repo root, each with the row's
  absolute workdir (the sweep's workdir may be relative), and logs both; a rerun skips it."""
  sweep, configs = _sweep("r", base_overrides={"seed": 3})
  monkeypatch.chdir(tmp_path)
  done = runner.run_local(sweep, sweep.rows, configs, "runs", python=fake_python.path)
  row_dir = str(tmp_path / "runs" / "r")
  assert fake_python.calls() == [
    [
      "train.py",
      REPO,
      [
        "--config",
        os.path.join(REPO, "configs", "default.py"),
        "--workdir",
        row_dir,
        "--config.seed=3",
        "--config.model.d_model=16",
      ],
    ],
    ["eval.py", REPO, ["--workdir", row_dir, "--split", "validation", "--step", "6"]],
  ]
  assert [(d["row"], d["phase"], d["returncode"], d["resumed"]) for d in done] == [
    ("r", "train", 0, False),
    ("r", "eval", 0, False),
  ]
  assert [(e["phase"], e["returncode"]) for e in _read_log("runs")] == [("train", 0), ("eval", 0)]
  assert _read_log("runs")[0]["versions"] == versions.library_versions()
  assert runner.row_state(row_dir, 6, final_eval=True) == "finished"

  again = runner.run_local(sweep, sweep.rows, configs, "runs", python=fake_python.path)
  assert again == [{"row": "r", "seed": None, "phase": "skipped"}]
  assert len(fake_python.calls()) == 2


def test_run_local_only_evaluates_a_trained_row(tmp_path, fake_python):
  """A row trained to its last step but never evaluated by eval.py runs eval.py only."""
  sweep, configs = _sweep("r")
  workdir = str(tmp_path / "runs")
  os.makedirs(os.path.join(workdir, "r", "checkpoints", "6"))
  done = runner.run_local(sweep, sweep.rows, configs, workdir, python=fake_python.path)
  assert [d["phase"] for d in done] == ["eval"]
  assert [call[0] for call in fake_python.calls()] == ["eval.py"]


def test_run_local_without_final_eval_and_without_validation_says_so(tmp_path, capsys, fake_python):
  """--nofinal_eval on a trained row with no final validation record runs nothing and
  says what is missing, rather than retraining."""
  sweep, configs = _sweep("r")
  workdir = str(tmp_path / "runs")
  os.makedirs(os.path.join(workdir, "r", "checkpoints", "6"))
  done = runner.run_local(
    sweep, sweep.rows, configs, workdir, final_eval=False, python=fake_python.path
  )
  assert done == [] and fake_python.calls() == []
  assert "no final validation to record" in capsys.readouterr().out
  assert not os.path.exists(os.path.join(workdir, "sweep_log.jsonl"))


def test_run_local_stops_at_a_failed_phase(tmp_path, fake_python):
  """A child's non-zero exit is logged and stops the sweep: no eval.py, no next row."""
  sweep, configs = _sweep("first", "second")
  workdir = str(tmp_path / "runs")
  fake_python.behave(**{"train.py": {"rc": 3}})
  with pytest.raises(spec.SweepError) as error:
    runner.run_local(sweep, sweep.rows, configs, workdir, python=fake_python.path)
  assert str(error.value) == (
    "row first: train exited with code 3; rerun the same command to resume"
  )
  assert [call[0] for call in fake_python.calls()] == ["train.py"]
  assert [(e["row"], e["phase"], e["returncode"]) for e in _read_log(workdir)] == [
    ("first", "train", 3)
  ]


def test_run_local_stops_when_training_ends_short_of_the_last_step(tmp_path, fake_python):
  """train.py exiting 0 before the last checkpoint (preempted) stops the sweep; the
  rerun resumes that row."""
  sweep, configs = _sweep("r")
  workdir = str(tmp_path / "runs")
  fake_python.behave(**{"train.py": {"reach": 4}})
  with pytest.raises(spec.SweepError, match=r"^row r: stopped before step 6 \(preempted\?\)"):
    runner.run_local(sweep, sweep.rows, configs, workdir, python=fake_python.path)
  assert [call[0] for call in fake_python.calls()] == ["train.py"]

  fake_python.behave()
  done = runner.run_local(sweep, sweep.rows, configs, workdir, python=fake_python.path)
  assert [(d["phase"], d["resumed"]) for d in done] == [("train", True), ("eval", False)]


def test_with_gradient_accumulation_a_row_is_trained_at_its_last_batch_step(tmp_path, fake_python):
  """Checkpoint steps count batches: 3 updates of 2 batches each end at step 6. A row
  that stopped at step 4 (past num_train_steps, short of the last step) resumes rather
  than being scored half-way, and eval.py scores step 6."""
  sweep, configs = _sweep("r", num_train_steps=3, grad_accum_steps=2)
  workdir = str(tmp_path / "runs")
  fake_python.behave(**{"train.py": {"reach": 4}})
  with pytest.raises(spec.SweepError, match=r"^row r: stopped before step 6 \(preempted\?\)"):
    runner.run_local(sweep, sweep.rows, configs, workdir, python=fake_python.path)
  row_dir = os.path.join(workdir, "r")
  assert runner.row_state(row_dir, 6, final_eval=True) == "partial"
  fake_python.behave()
  done = runner.run_local(sweep, sweep.rows, configs, workdir, python=fake_python.path)
  assert [(d["phase"], d["resumed"]) for d in done] == [("train", True), ("eval", False)]
  assert fake_python.calls()[-1][2] == [
    "--workdir", row_dir, "--split", "validation", "--step", "6"
  ]  # fmt: skip
  assert runner.row_state(row_dir, 6, final_eval=True) == "finished"


def test_sigterm_is_passed_to_the_child_and_stops_the_sweep(tmp_path, fake_python):
  """SIGTERM to the sweep reaches the running child (so it can checkpoint), the sweep
  stops after it instead of starting the next phase, and the old handler is restored."""
  sweep, configs = _sweep("r")
  fake_python.behave(**{"train.py": {"sigterm_parent": True}})
  # Our own handler around the sweep: it is what must be restored, and it keeps a
  # runner that fails to catch SIGTERM from ending the test session.
  reached_us = []
  before = signal.signal(signal.SIGTERM, lambda signum, frame: reached_us.append(signum))
  ours = signal.getsignal(signal.SIGTERM)
  try:
    with pytest.raises(spec.SweepError, match="^stopped by SIGTERM; rerun the same command"):
      runner.run_local(sweep, sweep.rows, configs, str(tmp_path / "runs"), python=fake_python.path)
    assert signal.getsignal(signal.SIGTERM) is ours
  finally:
    signal.signal(signal.SIGTERM, before)
  assert reached_us == []
  assert (fake_python.dir / "got_sigterm").exists()
  assert [call[0] for call in fake_python.calls()] == ["train.py"]


# ----------------------------------------------------------------------------------
# A real row: train.py resumes it.


def test_local_runner_resumes_an_interrupted_row_and_skips_a_finished_one(tmp_path, small_corpus):
  sweep = spec.load_sweep(write_sweep(tmp_path, small_corpus, '[Row("r", {})]'))
  configs = {"r": spec.row_config(sweep, sweep.rows[0])}
  workdir = str(tmp_path / "runs")
  row_dir = os.path.join(workdir, "r")
  assert runner.row_state(row_dir, 6, final_eval=False) == "new"

  # The row's run, trained here to save a process start; then an interruption after
  # step 4: the step-6 checkpoint never got written.
  loop.train_and_evaluate(configs["r"], row_dir)
  assert checkpoints.steps_on_disk(row_dir) == [2, 4, 6]
  assert runner.row_state(row_dir, 6, final_eval=False) == "finished"
  shutil.rmtree(os.path.join(row_dir, "checkpoints", "6"))
  assert runner.row_state(row_dir, 6, final_eval=False) == "partial"

  done = runner.run_local(sweep, sweep.rows, configs, workdir, final_eval=False)
  assert [(d["phase"], d["resumed"], d["returncode"]) for d in done] == [("train", True, 0)]
  lines = storage.read_log_lines(os.path.join(row_dir, "metrics.jsonl"))
  logged = [r["step"] for r in map(json.loads, lines) if r["kind"] == "train"]
  assert logged == [1, 2, 3, 4, 5, 6, 5, 6]  # resumed at 5, not restarted at 1
  # Readers see each step once: the rerun's 5 and 6.
  assert [r["step"] for r in tiny_run.read_metrics(row_dir)] == [1, 2, 3, 4, 5, 6]
  assert checkpoints.steps_on_disk(row_dir)[-1] == 6

  done = runner.run_local(sweep, sweep.rows, configs, workdir, final_eval=False)
  assert done == [{"row": "r", "seed": None, "phase": "skipped"}]
  assert storage.read_log_lines(os.path.join(row_dir, "metrics.jsonl")) == lines
  # Asking for the full-split evaluation would now run only eval.py, not training.
  assert runner.row_state(row_dir, 6, final_eval=True) == "trained"


def test_a_real_row_with_gradient_accumulation_ends_at_its_final_step(tmp_path, small_corpus):
  """What config.final_step promises, on a real run: 3 updates of 2 batches save their
  last checkpoint at step 6, the step the runner and the cluster scripts wait for."""
  sweep = spec.load_sweep(
    write_sweep(tmp_path, small_corpus, '[Row("r", {"grad_accum_steps": 2, "num_train_steps": 3})]')
  )
  config = spec.row_config(sweep, sweep.rows[0])
  row_dir = str(tmp_path / "runs" / "r")
  loop.train_and_evaluate(config, row_dir)
  assert checkpoints.steps_on_disk(row_dir) == [2, 4, 6]
  assert config_lib.final_step(config) == 6
  assert runner.row_state(row_dir, config_lib.final_step(config), final_eval=False) == "finished"
