"""eval.py and generate.py on a tiny trained run: a split (or a file with references)
scored once, in order; translation; one job per command, each with its own flags;
one-line errors for missing or incompatible runs and for moved flags. Checkpoint
averaging is in test_tools_average_checkpoints.py."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import jax.experimental.multihost_utils
import pytest

from tests.helpers.processes import subprocess_env
from tests.helpers.tiny_run import REPO, TRAINED_RUN_STEPS
from transformer.config import ConfigError
from transformer.data import pipeline
from transformer.evaluation import score, translate
from transformer.inference import checkpoints, distributed


def test_split_is_translated_once_in_order(trained_run):
  config, workdir = trained_run
  translator = translate.Translator(checkpoints.load_run_config(workdir), workdir)
  assert translator.step == TRAINED_RUN_STEPS[-1]
  results = score.evaluate_split(translator, "test")
  pairs = pipeline.load_raw_pairs(config, "test")
  stem = os.path.join(workdir, "eval", f"test-{translator.step}")
  files = {
    s: pathlib.Path(f"{stem}.{s}.txt").read_text(encoding="utf-8").split("\n")[:-1]
    for s in ("src", "ref", "hyp")
  }
  assert files["src"] == [s for s, _ in pairs]
  assert files["ref"] == [r for _, r in pairs]
  assert len(files["hyp"]) == len(pairs) == results["num_sentences"]
  saved = json.loads(pathlib.Path(f"{stem}.json").read_text())
  for key in (
    "bleu",
    "bleu_signature",
    "bleu_tok",
    "chrf",
    "ppl",
    "num_sentences",
    "sentences_per_sec",
    "tokens_per_sec",
  ):
    assert key in saved, key
  assert "nrefs:1" in saved["bleu_signature"] and saved["ppl"] > 1
  # The hypotheses are the ones translate_lines produces for the same sources.
  assert translator.translate_lines(files["src"][:5]) == files["hyp"][:5]


def test_translate_handles_empty_and_overlong_lines(trained_run):
  _, workdir = trained_run
  translator = translate.Translator(checkpoints.load_run_config(workdir), workdir)
  long_line = " ".join(["the cat sat on the mat"] * 40)  # far beyond max_len tokens
  outputs = translator.translate_lines(["", "I like cats.", long_line])
  assert len(outputs) == 3 and outputs[0] == ""
  assert all(isinstance(o, str) for o in outputs)


def test_incompatible_config_fails_naming_the_key(trained_run):
  config, workdir = trained_run
  other = config.copy_and_resolve_references()
  other.model.d_model = 48
  with pytest.raises(ConfigError) as error:
    translate.Translator(other, workdir)
  assert str(error.value).startswith("config.model.d_model:") and "\n" not in str(error.value)


@pytest.mark.slow  # three batches of beam search
def test_a_notice_stops_the_search_between_batches(trained_run, monkeypatch):
  """eval.py and generate.py stop so on SIGTERM. Several processes: after the batch
  JAX's preemption sync agrees on (here the second), asked after every batch. One
  process: at once, from the handler."""
  _, workdir = trained_run
  translator = translate.Translator(checkpoints.load_run_config(workdir), workdir)
  asked = []

  def reached_preemption_sync_point(count):
    asked.append(count)
    return count == 2

  monkeypatch.setattr(
    jax.experimental.multihost_utils, "reached_preemption_sync_point", reached_preemption_sync_point
  )
  stop = distributed.StopBetweenBatches(several_processes=True)
  translator.after_batch = stop.after_batch
  rows = translator.config.eval_batch_size
  with pytest.raises(distributed.Stopped, match="^stopped by SIGTERM .* after 2 batches; "):
    translator.translate_lines(["I like cats."] * (3 * rows))  # three batches
  assert asked == [1, 2]

  before = signal.getsignal(signal.SIGTERM)
  with (
    pytest.raises(distributed.Stopped, match="after 0 batches; nothing was written"),
    distributed.stop_between_batches(),
  ):
    signal.raise_signal(signal.SIGTERM)
  assert signal.getsignal(signal.SIGTERM) is before


def test_an_output_write_cut_short_leaves_no_file(tmp_path, monkeypatch):
  """What a SIGTERM's exception (or a full disk) does in the middle of a whole-file write:
  the old file stays as it was, and no temporary file is left beside it."""
  from transformer import storage

  path = tmp_path / "test-30.hyp.txt"
  storage.write_lines(path, ["old"])

  def stopped(*args):
    raise distributed.Stopped("stopped by SIGTERM")

  monkeypatch.setattr(os, "replace", stopped)
  with pytest.raises(distributed.Stopped):
    storage.write_lines(path, ["new"])
  assert os.listdir(tmp_path) == [path.name] and path.read_text() == "old\n"


def _run(script, *args):
  env = subprocess_env(devices=1)
  return subprocess.run(
    [sys.executable, script, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
  )


def test_a_file_with_references_is_scored_as_a_split(trained_run, tmp_path):
  _, workdir = trained_run
  translator = translate.Translator(checkpoints.load_run_config(workdir), workdir)
  sources, references = ["I like cats.", "Good morning."], ["Me gustan los gatos.", "Hola."]
  (tmp_path / "news.txt").write_text("\n".join(sources) + "\n")
  (tmp_path / "news.ref").write_text("\n".join(references) + "\n")
  results = score.evaluate_files(translator, str(tmp_path / "news.txt"), str(tmp_path / "news.ref"))
  stem = os.path.join(workdir, "eval", f"news-{TRAINED_RUN_STEPS[-1]}")
  assert results["path"] == stem + ".json" and results["num_sentences"] == 2
  hypotheses = pathlib.Path(f"{stem}.hyp.txt").read_text(encoding="utf-8").split("\n")[:-1]
  assert hypotheses == translator.translate_lines(sources)
  (tmp_path / "short.ref").write_text("Hola.\n")
  with pytest.raises(ConfigError, match="^reference_file: .* has 1 lines"):
    score.evaluate_files(translator, str(tmp_path / "news.txt"), str(tmp_path / "short.ref"))


def test_generate_py_translates_to_stdout_and_reports_errors_in_one_line(trained_run, tmp_path):
  _, workdir = trained_run
  result = _run("generate.py", "translate", "--workdir", workdir, "Good morning.")
  assert result.returncode == 0, result.stderr[-2000:]
  assert len(result.stdout.splitlines()) == 1  # only the translation

  missing = _run("eval.py", "--workdir", str(tmp_path / "nowhere"), "--split", "test")
  assert missing.returncode != 0
  assert missing.stderr.strip().splitlines()[-1].startswith("error: --workdir")


def test_each_job_has_its_own_command_and_flags():
  """eval.py only scores: its generation flags name their new home in one line; each
  generate.py job's --help lists its own flags and no other job's."""
  for flag, job in (
    ("--translate=Hi", "generate.py translate"),
    ("--prompt=Hi", "generate.py continue"),
    ("--attention_maps=Hi", "generate.py attention"),
  ):
    moved = _run("eval.py", "--workdir", "w", flag)
    assert moved.returncode != 0
    [line] = moved.stderr.strip().splitlines()
    assert line.startswith("error: eval.py only scores") and job in line
  helps = {
    job: _run("generate.py", job, "--help") for job in ("translate", "continue", "attention")
  }
  assert all(h.returncode == 0 for h in helps.values())
  own = {"translate": "--input_file", "continue": "--max_new_tokens", "attention": "--output_dir"}
  for job, result in helps.items():
    for other, flag in own.items():
      assert (flag in result.stdout) == (job == other), (job, flag)
    assert ("--draft_workdir" in result.stdout) == (job != "attention")
    assert "--coordinator_address" not in result.stdout  # the cluster's, not the job's


def test_generate_py_writes_attention_maps(trained_run, tmp_path):
  config, workdir = trained_run
  out = tmp_path / "maps"
  result = _run(
    "generate.py", "attention", "--workdir", workdir, "I like cats.", "--output_dir", str(out)
  )
  assert result.returncode == 0, result.stderr[-2000:]
  pngs = sorted(p.name for p in out.glob("*.png"))
  # One figure per layer for each of encoder self-, decoder self- and cross-attention.
  assert len(pngs) == 3 * config.model.num_layers
  assert all((out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
