"""eval.py's machinery on a tiny trained run: a split once, in order; translation;
checkpoint averaging; one-line errors for missing or incompatible runs."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.tiny_run import REPO, make_config
from transformer.evaluation import score, translate
from transformer.tools import average_checkpoints
from transformer.training import checkpoints, loop, sharding, state
from transformer.config import ConfigError
from transformer.data import pipeline


@pytest.fixture(scope="module")
def trained(small_corpus, tmp_path_factory):
  """A 4-step run with checkpoints at steps 2 and 4."""
  workdir = str(tmp_path_factory.mktemp("run"))
  config = make_config(small_corpus, num_train_steps=4, max_decode_extra_len=5)
  loop.train_and_evaluate(config, workdir)
  return config, workdir


def _params(workdir, config, **kwargs):
  params, step = checkpoints.restore_params(workdir, state.setup(config),
                                            **kwargs)
  return jax.device_get(params), step


def test_split_is_translated_once_in_order(trained):
  config, workdir = trained
  translator = translate.Translator(checkpoints.load_run_config(workdir), workdir)
  assert translator.step == 4
  results = score.evaluate_split(translator, "test")
  pairs = pipeline.load_raw_pairs(config, "test")
  stem = os.path.join(workdir, "eval", "test-4")
  files = {s: open(f"{stem}.{s}.txt", encoding="utf-8").read().split("\n")[:-1]
           for s in ("src", "ref", "hyp")}
  assert files["src"] == [s for s, _ in pairs]
  assert files["ref"] == [r for _, r in pairs]
  assert len(files["hyp"]) == len(pairs) == results["num_sentences"]
  saved = json.load(open(f"{stem}.json"))
  for key in ("bleu", "bleu_signature", "bleu_tok", "chrf", "ppl", "num_sentences",
              "sentences_per_sec", "tokens_per_sec"):
    assert key in saved, key
  assert "nrefs:1" in saved["bleu_signature"] and saved["ppl"] > 1
  # The hypotheses are the ones translate_lines produces for the same sources.
  assert translator.translate_lines(files["src"][:5]) == files["hyp"][:5]


def test_translate_handles_empty_and_overlong_lines(trained):
  _, workdir = trained
  translator = translate.Translator(checkpoints.load_run_config(workdir), workdir)
  long_line = " ".join(["the cat sat on the mat"] * 40)  # far beyond max_len tokens
  outputs = translator.translate_lines(["", "I like cats.", long_line])
  assert len(outputs) == 3 and outputs[0] == ""
  assert all(isinstance(o, str) for o in outputs)


def test_averaging_gives_the_mean(trained, tmp_path):
  config, workdir = trained
  p2, _ = _params(workdir, config, step=2)
  p4, step = _params(workdir, config)
  assert step == 4
  averaged, step = _params(workdir, config, average_last=2)
  assert step == 4
  jax.tree.map(lambda a, x, y: np.testing.assert_allclose(a, (x + y) / 2, rtol=1e-6),
               averaged, p2, p4)
  same, _ = _params(workdir, config, average_last=1)
  jax.tree.map(np.testing.assert_array_equal, same, p4)
  with pytest.raises(ConfigError, match="only 2 checkpoints"):
    _params(workdir, config, average_last=3)

  out = str(tmp_path / "avg")
  assert average_checkpoints.average_into(workdir, out, 2) == 4
  written, _ = _params(out, checkpoints.load_run_config(out))
  jax.tree.map(np.testing.assert_array_equal, written, averaged)


def test_averaging_identical_checkpoints_returns_them(trained, tmp_path):
  config, workdir = trained
  p4, _ = _params(workdir, config)
  once = str(tmp_path / "once")
  average_checkpoints.average_into(workdir, once, 1)
  # A run whose two checkpoints hold the same parameters averages to exactly them.
  twice = checkpoints.Checkpointer(once, keep=5, async_save=False)
  restored, iterator = twice.restore(4, state.setup(config).restore_target())
  twice.save(5, restored, iterator, config)
  twice.close()
  averaged, _ = _params(once, config, average_last=2)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-7), averaged, p4)


def test_incompatible_config_fails_naming_the_key(trained):
  config, workdir = trained
  other = config.copy_and_resolve_references()
  other.model.d_model = 48
  with pytest.raises(ConfigError) as error:
    translate.Translator(other, workdir)
  assert str(error.value).startswith("config.model.d_model:") and "\n" not in str(error.value)


def _eval_py(*args):
  env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "eval.py", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


def test_eval_py_translates_to_stdout_and_reports_errors_in_one_line(trained, tmp_path):
  _, workdir = trained
  result = _eval_py("--workdir", workdir, "--translate", "Good morning.")
  assert result.returncode == 0, result.stderr[-2000:]
  assert len(result.stdout.splitlines()) == 1  # only the translation

  missing = _eval_py("--workdir", str(tmp_path / "nowhere"), "--split", "test")
  assert missing.returncode != 0
  assert missing.stderr.strip().splitlines()[-1].startswith("error: --workdir")


def test_eval_py_writes_attention_maps(trained, tmp_path):
  config, workdir = trained
  out = tmp_path / "maps"
  result = _eval_py("--workdir", workdir, "--attention_maps", "I like cats.",
                    "--output_dir", str(out))
  assert result.returncode == 0, result.stderr[-2000:]
  pngs = sorted(p.name for p in out.glob("*.png"))
  # One figure per layer for each of encoder self-, decoder self- and cross-attention.
  assert len(pngs) == 3 * config.model.num_layers
  assert all((out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
