"""Training's periodic validation with BLEU, as train.py runs it."""

import numpy as np
import pytest

from tests.helpers.tiny_run import make_config, read_metrics
from transformer import config as config_lib
from transformer import data
from transformer.evaluation.validation import ValidationWithBleu
from transformer.inference import checkpoints as inference_checkpoints
from transformer.inference.metrics import ValidationLoss
from transformer.training import loop, state


def test_without_bleu_sentences_it_is_the_loops_validation(trained_run):
  """eval_bleu_sentences=0: the loop's validation, the same loss on the same batches and
  no BLEU, on the shared tiny run's parameters (no training, no beam search: quick)."""
  trained_config, workdir = trained_run
  config = trained_config.copy_and_resolve_references()
  config_lib.apply_overrides(config, {"eval_bleu_sentences": 0, "num_eval_batches": 2})
  setup = state.setup(config)
  params, _ = inference_checkpoints.restore_params(workdir, setup)
  tokenizer = data.load_workdir_tokenizer(workdir)
  plain = ValidationLoss(config, setup.model_setup, tokenizer)(params)
  with_bleu = ValidationWithBleu(config, setup.model_setup, tokenizer)(params)
  assert "bleu" not in with_bleu and with_bleu == plain
  assert plain["ppl"] == pytest.approx(np.exp(plain["ce"]), rel=1e-6) and plain["ppl"] > 1


def test_periodic_validation_reports_perplexity_and_bleu(small_corpus, tmp_path):
  workdir = str(tmp_path / "validated")
  config = make_config(
    small_corpus,
    num_train_steps=4,
    eval_every_steps=2,
    eval_bleu_sentences=8,
    max_decode_extra_len=4,
  )
  result = loop.train_and_evaluate(config, workdir, validation=ValidationWithBleu)
  records = read_metrics(workdir, kind="validation")
  assert [r["step"] for r in records] == [2, 4]
  for r in records:
    assert r["ppl"] > 1 and 0 <= r["bleu"] <= 100
    assert r["ppl"] == pytest.approx(np.exp(r["ce"]), rel=1e-6)
  assert result["step"] == 4 and result["ppl"] == records[-1]["ppl"]
  train = read_metrics(workdir)
  for key in ("step", "loss", "ce", "ppl", "lr", "tokens_per_sec", "mfu", "elapsed_s"):
    assert key in train[-1], key


# Slow when alone: it compiles the validation beam search, which the full suite's
# earlier test in this file compiled for it (13.7 s there, 61 s in the fast tier).
@pytest.mark.slow
def test_the_loops_own_validation_is_the_same_loss_without_bleu(small_corpus, tmp_path):
  """Without evaluation's ValidationWithBleu the loop reports the same validation loss,
  and no BLEU: the training layer never imports the evaluation layer."""
  config = make_config(
    small_corpus,
    num_train_steps=2,
    eval_every_steps=2,
    eval_bleu_sentences=8,
    max_decode_extra_len=4,
  )
  plain, with_bleu = str(tmp_path / "plain"), str(tmp_path / "bleu")
  loop.train_and_evaluate(config, plain)
  loop.train_and_evaluate(config, with_bleu, validation=ValidationWithBleu)
  [plain_record] = read_metrics(plain, kind="validation")
  [bleu_record] = read_metrics(with_bleu, kind="validation")
  assert "bleu" not in plain_record and "bleu" in bleu_record
  assert plain_record["ce"] == bleu_record["ce"]
