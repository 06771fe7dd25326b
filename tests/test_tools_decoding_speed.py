"""`python -m transformer.tools.decoding_speed`'s measurement on a tiny random model: the
search runs exactly the asked number of steps, and the rates agree with the run time.

Timings themselves are not asserted (they depend on the machine)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from transformer.config import EOS_ID, PAD_ID
from transformer.model import ModelConfig, Transformer, decoding
from transformer.tools import decoding_speed

VOCAB, BATCH, SOURCE_LEN, STEPS, BEAM = 16, 3, 5, 9, 2


@pytest.fixture(scope="module")
def model_and_params():
  model = Transformer(
    ModelConfig(
      vocab_size=VOCAB,
      max_position=32,
      num_layers=1,
      d_model=16,
      d_ff=32,
      num_heads=2,
      d_k=8,
      d_v=8,
    )
  )
  source = _source()
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), source[:1], source[:1, :2])
  return model, nn.unbox(variables["params"])


def _source():
  """BATCH random sentences of SOURCE_LEN tokens, no padding, ending in EOS."""
  return (
    jax.random.randint(jax.random.PRNGKey(1), (BATCH, SOURCE_LEN), 4, VOCAB, jnp.int32)
    .at[:, -1]
    .set(EOS_ID)
  )


@pytest.fixture
def searched_steps(monkeypatch):
  """The search, the budget and whether the model kept its cache (not Recomputing) of
  each compiled search, and the steps it ran (its passes after the prefill, plus the
  prefill's)."""
  real = decoding.compile_decode
  seen = []

  def recording(model, params, prompts, search):
    compiled = real(model, params, prompts, search)
    cached = not isinstance(model, decoding_speed.Recomputing)

    def run(*args):
      out = compiled(*args)
      seen.append(((search, prompts.out_len, cached), int(out.calls) + 1))
      return out

    return run

  monkeypatch.setattr(decoding, "compile_decode", recording)
  return seen


@pytest.mark.parametrize("use_cache", [True, False])
def test_rates_agree_with_the_run_time(model_and_params, searched_steps, use_cache):
  """sentences/s * run time = the batch; output tokens = sentences * steps; hypothesis
  tokens = that times the beam; the search ran `steps` steps without early stopping."""
  model, params = model_and_params
  r = decoding_speed.time_beam_search(
    model, params, _source(), beam_size=BEAM, steps=STEPS, use_cache=use_cache
  )
  assert set(r) == {
    "compile_s",
    "run_s",
    "sentences_per_s",
    "tokens_per_s",
    "hypothesis_tokens_per_s",
  }
  assert r["compile_s"] > 0 and r["run_s"] > 0
  assert r["sentences_per_s"] * r["run_s"] == pytest.approx(BATCH)
  assert r["tokens_per_s"] * r["run_s"] == pytest.approx(BATCH * STEPS)
  assert r["tokens_per_s"] == pytest.approx(r["sentences_per_s"] * STEPS)
  assert r["hypothesis_tokens_per_s"] * r["run_s"] == pytest.approx(BATCH * BEAM * STEPS)
  # One untimed run, then the timed one.
  [(kwargs, step), timed] = searched_steps
  assert timed == (kwargs, step) and step == STEPS
  assert kwargs == (decoding.BeamSearch(BEAM, alpha=0.6, early_stop=False), STEPS, use_cache)


def test_a_search_that_ends_early_is_not_timed_as_a_full_one(model_and_params):
  """Padded sources have shorter budgets, so the search stops before `steps`: the tool
  refuses to report rates for steps that did not run."""
  model, params = model_and_params
  padded = _source().at[:, 2:].set(PAD_ID).at[:, 1].set(EOS_ID)
  # Budgets of 2 source tokens + (STEPS - SOURCE_LEN) = 6 steps.
  with pytest.raises(RuntimeError, match=rf"^beam search ran 6 steps, expected {STEPS}$"):
    decoding_speed.time_beam_search(
      model, params, padded, beam_size=BEAM, steps=STEPS, use_cache=True
    )
