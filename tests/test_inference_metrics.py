"""Step metrics summed on the host, per-token averages, and `evaluate_loss` over a split."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer import config as config_lib
from transformer.inference import metrics, scoring, sharding
from transformer.training import state

VOCAB, ROWS, LENGTH = 24, 4, 6


def test_sum_metrics_adds_key_by_key_into_floats():
  pending = [
    {"ce_sum": jnp.float32(1.5), "num_tokens": jnp.float32(3.0)},
    {"ce_sum": jnp.float32(2.25), "num_tokens": jnp.float32(4.0)},
    {"ce_sum": np.float32(0.25), "num_tokens": 1.0},
  ]
  summed = metrics.sum_metrics(pending)
  assert summed == {"ce_sum": 4.0, "num_tokens": 8.0}
  assert all(type(v) is float for v in summed.values())


def test_token_averages_divide_by_the_token_count():
  sums = {"loss_sum": 12.0, "ce_sum": 10.0, "correct_sum": 3.0, "num_tokens": 4.0}
  averages = metrics.token_averages(sums)
  assert averages["loss"] == pytest.approx(3.0)
  assert averages["ce"] == pytest.approx(2.5)
  assert averages["ppl"] == pytest.approx(math.exp(2.5))
  assert averages["accuracy"] == pytest.approx(0.75)
  assert averages["num_tokens"] == 4.0


def test_perplexity_is_capped_at_exp_50():
  """A diverged run (ce 1000 nats) still prints a number, not an OverflowError."""
  sums = {"loss_sum": 1000.0, "ce_sum": 1000.0, "correct_sum": 0.0, "num_tokens": 1.0}
  averages = metrics.token_averages(sums)
  assert averages["ce"] == 1000.0
  assert averages["ppl"] == math.exp(50.0)
  just_below = metrics.token_averages(dict(sums, ce_sum=49.0))
  assert just_below["ppl"] == pytest.approx(math.exp(49.0))


def test_zero_tokens_give_zeros_not_a_division_error():
  sums = {"loss_sum": 0.0, "ce_sum": 0.0, "correct_sum": 0.0, "num_tokens": 0.0}
  averages = metrics.token_averages(sums)
  assert averages == {"loss": 0.0, "ce": 0.0, "ppl": 1.0, "accuracy": 0.0, "num_tokens": 0.0}


# ----------------------------------------------------------------------------------
# evaluate_loss on a tiny model over a 2 x 2 x 2 mesh.


@pytest.fixture(scope="module")
def tiny_run():
  """(setup, params, jitted eval step) of a one-layer model on the 8 fake devices."""
  config = config_lib.base_config()
  config_lib.apply_overrides(
    config,
    {
      "vocab_size": VOCAB,
      "max_len": 8,
      "model.num_layers": 1,
      "model.d_model": 16,
      "model.d_ff": 32,
      "model.num_heads": 2,
      "model.d_k": 8,
      "model.d_v": 8,
      "mesh.data": 2,
      "mesh.fsdp": 2,
      "mesh.tensor": 2,
    },
  )
  run = state.setup(config, sharding.create_mesh(config))
  params = run.init_state(jax.random.key(0)).params
  return run, params, scoring.jit_eval_step(run.model_setup)


def make_batches(count, seed=0):
  """Batches as the input pipeline yields them, with an 'index' column and padding."""
  rng = np.random.default_rng(seed)
  batches = []
  for i in range(count):
    target = rng.integers(4, VOCAB, (ROWS, LENGTH)).astype(np.int32)
    lengths = rng.integers(2, LENGTH + 1, ROWS)
    target[np.arange(LENGTH)[None, :] >= lengths[:, None]] = config_lib.PAD_ID
    decoder_input = np.concatenate(
      [np.full((ROWS, 1), config_lib.BOS_ID, np.int32), target[:, :-1]], 1
    )
    decoder_input[target == config_lib.PAD_ID] = config_lib.PAD_ID
    source = rng.integers(4, VOCAB, (ROWS, LENGTH)).astype(np.int32)
    source[:, -1] = config_lib.PAD_ID
    batches.append(
      {
        "source": source,
        "decoder_input": decoder_input,
        "target": target,
        "index": np.arange(i * ROWS, (i + 1) * ROWS),
      }
    )
  return batches


def concatenate(batches):
  return {k: np.concatenate([b[k] for b in batches]) for k in batches[0] if k != "index"}


def numpy_cross_entropy(run, params, batch):
  """Unsmoothed CE per real token and accuracy, from the model's logits in NumPy."""
  logits = np.asarray(
    run.model.apply(
      {"params": params},
      source=jnp.asarray(batch["source"]),
      decoder_input=jnp.asarray(batch["decoder_input"]),
    ),
    np.float64,
  )
  log_probs = (
    logits
    - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True))
    - logits.max(-1, keepdims=True)
  )
  target = batch["target"]
  real = target != config_lib.PAD_ID
  ce = -np.take_along_axis(log_probs, target[..., None], -1)[..., 0]
  correct = logits.argmax(-1) == target
  return ce[real].mean(), correct[real].mean(), real.sum()


def test_evaluate_loss_equals_one_step_on_the_concatenated_batches(tiny_run):
  """Summing per-batch sums before dividing is exact: 3 batches = 1 batch of their rows."""
  run, params, eval_step = tiny_run
  batches = make_batches(3)
  got = metrics.evaluate_loss(eval_step, params, iter(batches), run.mesh, run.rules)
  together = concatenate(batches)
  once = metrics.token_averages(
    metrics.sum_metrics([eval_step(params, sharding.global_batch(together, run.mesh, run.rules))])
  )
  assert set(got) == {"loss", "ce", "ppl", "accuracy", "num_tokens"}
  for key in got:
    assert got[key] == pytest.approx(once[key], rel=1e-5), key
  ce, accuracy, tokens = numpy_cross_entropy(run, params, together)
  assert got["num_tokens"] == tokens
  assert got["ce"] == pytest.approx(ce, rel=1e-4)
  assert got["ppl"] == pytest.approx(math.exp(ce), rel=1e-4)
  assert got["accuracy"] == pytest.approx(accuracy)
  assert got["loss"] != pytest.approx(got["ce"], rel=1e-3)  # label-smoothed, not the CE


def test_no_batches_reduce_to_zero_tokens():
  """An empty split sums to nothing and averages to zero tokens, not an IndexError."""
  assert metrics.sum_metrics([]) == {}
  averages = metrics.token_averages(metrics.sum_metrics([]))
  assert averages["num_tokens"] == 0.0 and averages["ce"] == 0.0 and averages["ppl"] == 1.0
