"""Decoding on tiny random models: cache vs recompute, beam vs greedy vs exhaustive search."""

import dataclasses
import itertools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.model_helpers import SOURCE as SPEC_SOURCE
from tests.helpers.model_helpers import make_model
from transformer.config import BOS_ID, EOS_ID, PAD_ID
from transformer.model import ModelConfig, Transformer, decoding, incremental, stack_layer_params
from transformer.model.decoding import beam as beam_lib
from transformer.tools.decoding_speed import Recomputing

VOCAB = 6  # PAD, EOS, BOS, UNK and two words: EOS, UNK, 4 and 5 can be generated
GENERATED = (EOS_ID, 3, 4, 5)
EXTRA = 3
# Sentences of 3, 1 and 4 tokens (with EOS): budgets of 6, 4 and 7 output tokens.
SOURCE = jnp.array([[4, 5, 1, 0], [1, 0, 0, 0], [5, 3, 4, 1]], jnp.int32)


@pytest.fixture(scope="module")
def model():
  return Transformer(
    ModelConfig(
      vocab_size=VOCAB,
      max_position=32,
      num_layers=2,
      d_model=16,
      d_ff=32,
      num_heads=2,
      d_k=8,
      d_v=8,
    )
  )


@pytest.fixture(scope="module")
def params(model):
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), SOURCE, jnp.ones((3, 4), jnp.int32))
  return nn.unbox(variables["params"])


def constant_output_params(params, eos_logit):
  """Decoder output fixed to a unit vector u and E[EOS] = eos_logit * u.

  Every step then predicts the same distribution, with EOS's logit at `eos_logit` and
  the other tokens' near 0, whatever the input.
  """
  params = jax.tree.map(lambda x: x, params)  # a copy whose dicts we may change
  last = params["decoder"][f"layer_{len(params['decoder']) - 1}"]["ffn_block"]["norm"]
  u = jnp.zeros_like(last["bias"]).at[0].set(1.0)
  last["scale"], last["bias"] = jnp.zeros_like(last["scale"]), u
  embedding = params["shared_embedding"]["embedding"]
  params["shared_embedding"]["embedding"] = embedding.at[EOS_ID].set(eos_logit * u)
  return params


@pytest.fixture(scope="module")
def sequence_logprobs(model, params):
  """log P(output | source) for each output (a list of token lists), by full forward."""
  forward = jax.jit(
    lambda source, decoder_input: model.apply({"params": params}, source, decoder_input)
  )

  def logprobs(source_1xS, outputs):
    # One shape for every call (128 outputs of 8 tokens), so it compiles once.
    targets = np.zeros((128, 8), np.int32)
    for i, o in enumerate(outputs):
      targets[i, : len(o)] = o
    decoder_input = np.concatenate([np.full((128, 1), BOS_ID), targets[:, :-1]], axis=1)
    decoder_input = np.where((targets != PAD_ID), decoder_input, PAD_ID)
    logits = forward(jnp.repeat(source_1xS, 128, axis=0), jnp.asarray(decoder_input))
    token_logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)
    per_output = jnp.sum(jnp.where(targets != PAD_ID, token_logprobs[..., 0], 0.0), axis=1)
    return np.asarray(per_output)[: len(outputs)]

  return logprobs


def gnmt_penalty(length, alpha):
  """The paper's length penalty, written out independently of the code under test."""
  return ((5.0 + length) / 6.0) ** alpha


def translate(model, params, source, search, extra=EXTRA, use_cache=True, rng=None):
  """decoding.decode on translation prompts: the Generation; use_cache=False decodes
  without K/V, rerunning the decoder over the whole prefix at every call."""
  prompts = decoding.translation_prompts(source, extra, model.config.decoder_only)
  if not use_cache:
    model = Recomputing(model)
  return decoding.decode(model, params, prompts, search, rng)


def beam(model, params, source=SOURCE, beam_size=4, alpha=0.6, early_stop=True, **kwargs):
  return translate(
    model, params, source, decoding.BeamSearch(beam_size, alpha, early_stop), **kwargs
  )


def greedy(model, params, source=SOURCE, **kwargs):
  return translate(model, params, source, decoding.Greedy(), **kwargs).tokens_BxO


def strip(tokens):
  """Token list up to and including the first EOS (or all of it)."""
  tokens = [int(t) for t in tokens if t != PAD_ID]
  return tokens[: tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


def test_cached_decoding_equals_full_recompute(model, params):
  cached = greedy(model, params)
  recomputed = greedy(model, params, use_cache=False)
  chex.assert_shape(cached, (3, 4 + EXTRA))
  np.testing.assert_array_equal(cached, recomputed)

  # Beam search reorders the cache rows at every step; recomputing needs no reordering.
  # (Its longer searches are compared below.)
  cached = beam(model, params)
  recomputed = beam(model, params, use_cache=False)
  assert int(cached.calls) == int(recomputed.calls) > 1
  np.testing.assert_array_equal(cached.tokens_BxO, recomputed.tokens_BxO)
  np.testing.assert_allclose(cached.scores_B, recomputed.scores_B, rtol=1e-5)


def test_cache_segments_double_from_sixteen_up_to_the_cache_length():
  assert decoding.cache_segments(64) == (16, 32, 64)
  assert decoding.cache_segments(82) == (16, 32, 64, 82)
  assert decoding.cache_segments(17) == (16, 17)
  assert decoding.cache_segments(16) == (16,)
  assert decoding.cache_segments(7) == (7,)


def test_prefill_keeps_cross_attention_per_sentence_and_repeats_the_rest(model, params):
  """The prefill projects the cross-attention K/V once per sentence; repeating the rows
  for 4 beams repeats the self-attention K/V and the source, not the cross K/V."""
  seam, params_copy = incremental.of(model).prepare(params)
  prompt = jnp.full((3, 1), BOS_ID, jnp.int32)
  prefilled = seam.prefill(params_copy, prompt, cache_len=16, source_BxS=SOURCE)
  state = seam.repeat_rows(prefilled.state, 4)
  layer = state.cache["decoder"]["layer_0"]
  chex.assert_shape(state.source_NxS, (12, 4))
  chex.assert_shape(layer["self_attention"]["key"], (12, 2, 8, 16))  # [N, H, K, C]
  chex.assert_shape(layer["cross_attention"]["cross_key"], (3, 2, 8, 4))  # [B, H, K, S]
  grown = seam.grow(state, 24)
  chex.assert_shape(
    grown.cache["decoder"]["layer_1"]["self_attention"]["value"], (12, 2, 24, 8)
  )  # [N, H, C, E]


def test_a_long_search_grows_its_cache_as_the_recomputing_search():
  """Outputs of up to 25 tokens: steps 0-15 run on a 16-slot cache, the rest on 25
  (cache_segments); the outcome must still be the search that recomputes the whole
  prefix at each step, for beam search and greedy decoding alike. The model is random
  and far from uniform (test_model_speculative.make_model), so outputs are long."""
  model, params = make_model(4)
  extra = 20
  for search in (decoding.BeamSearch(3, 0.6), decoding.Greedy()):
    cached = translate(model, params, SPEC_SOURCE, search, extra=extra)
    recomputed = translate(model, params, SPEC_SOURCE, search, extra=extra, use_cache=False)
    assert max(len(strip(row)) for row in np.asarray(cached.tokens_BxO)) > 16
    np.testing.assert_array_equal(cached.tokens_BxO, recomputed.tokens_BxO)
    np.testing.assert_allclose(cached.scores_B, recomputed.scores_B, rtol=1e-4)


def test_beam_scores_are_penalized_logprobs_of_the_hypotheses(model, params, sequence_logprobs):
  out = beam(model, params, alpha=0.6)
  outputs = [strip(row) for row in np.asarray(out.tokens_BxO)]
  for b in range(SOURCE.shape[0]):
    expected = sequence_logprobs(SOURCE[b : b + 1], [outputs[b]]) / gnmt_penalty(
      len(outputs[b]), 0.6
    )
    np.testing.assert_allclose(out.scores_B[b], expected[0], rtol=1e-5)
  # Greedy and sampling report log P itself.
  out = translate(model, params, SOURCE, decoding.Greedy())
  for b, row in enumerate(np.asarray(out.tokens_BxO)):
    expected = sequence_logprobs(SOURCE[b : b + 1], [strip(row)])[0]
    np.testing.assert_allclose(out.scores_B[b], expected, rtol=1e-5)


def test_beam_size_one_is_greedy(model, params):
  # alpha = 0: with a length penalty a finished hypothesis can lose to a longer one that
  # greedy never looks at.
  np.testing.assert_array_equal(
    beam(model, params, beam_size=1, alpha=0.0).tokens_BxO, greedy(model, params)
  )


@pytest.mark.parametrize("alpha", [0.0, 0.6, 3.0])
def test_wide_beam_finds_the_exhaustive_best(model, params, sequence_logprobs, alpha):
  source = jnp.array([[4, 5, 1], [3, 1, 0]], jnp.int32)  # budgets of 4 and 3 tokens
  extra = 1
  # 128 beams hold every prefix (at most 3^3 live, 4 * 27 candidates) at every step.
  out = beam(model, params, source, beam_size=128, alpha=alpha, extra=extra)
  tokens, scores = out.tokens_BxO, out.scores_B
  for b, budget in enumerate([4, 3]):
    # Every output that ends with EOS within the budget, or fills it without EOS.
    outputs = [
      list(words) + [EOS_ID]
      for n in range(budget)
      for words in itertools.product((3, 4, 5), repeat=n)
    ]
    outputs += [list(words) for words in itertools.product((3, 4, 5), repeat=budget)]
    logprobs = sequence_logprobs(source[b : b + 1], outputs)
    penalized = logprobs / np.array([gnmt_penalty(len(o), alpha) for o in outputs])
    best = int(np.argmax(penalized))
    assert strip(tokens[b]) == outputs[best]
    np.testing.assert_allclose(scores[b], penalized[best], rtol=1e-4)


def test_output_stops_at_source_length_plus_extra_when_eos_never_comes(model, params):
  never_eos = constant_output_params(params, eos_logit=-30.0)
  budgets = np.sum(np.asarray(SOURCE) != PAD_ID, axis=1) + EXTRA
  for tokens in (
    np.asarray(beam(model, never_eos).tokens_BxO),
    np.asarray(greedy(model, never_eos)),
  ):
    assert not np.any(tokens == EOS_ID)
    np.testing.assert_array_equal(np.sum(tokens != PAD_ID, axis=1), budgets)
    assert np.all(tokens[np.arange(tokens.shape[1]) >= budgets[:, None]] == PAD_ID)


def test_early_stop_ends_the_search_without_changing_the_result(model, params):
  eos_first = constant_output_params(params, eos_logit=30.0)
  early = beam(model, eos_first, early_stop=True)
  full = beam(model, eos_first, early_stop=False)
  # Step 0 finishes [EOS]; step 1 fills the beam with [w, EOS] (about -30 / penalty(2)
  # = -26); no live beam, at about -60 for two tokens, can then reach more than
  # -60 / penalty(7) = -40 (7: the longest budget, the smallest bound).
  assert int(early.calls) + 1 == 2
  assert int(full.calls) + 1 == 4 + EXTRA
  np.testing.assert_array_equal(early.tokens_BxO[:, 0], EOS_ID)
  np.testing.assert_array_equal(early.tokens_BxO, full.tokens_BxO)

  # On the random model too, stopping early never changes the outcome, also when a
  # strong length penalty (alpha 3) lets long hypotheses overtake finished short ones.
  for alpha in (0.6, 3.0):
    early = beam(model, params, alpha=alpha, early_stop=True)
    full = beam(model, params, alpha=alpha, early_stop=False)
    np.testing.assert_array_equal(early.tokens_BxO, full.tokens_BxO)
    np.testing.assert_allclose(early.scores_B, full.scores_B, rtol=1e-6)


def test_early_stop_bound_uses_the_penalty_at_the_maximum_length():
  # A live hypothesis at log P = -4 may grow to the sentence's maximum length of 10 and
  # then score -4 / penalty(10) = -2.31 (alpha 0.6) or better.
  state = beam_lib.BeamState(
    step=jnp.array(2),
    live_seqs_BxWxO1=None,
    live_logprobs_BxW=jnp.array([[-4.0], [-4.0]]),
    finished_seqs_BxWxO1=None,
    finished_scores_BxW=jnp.array([[-1.5], [-2.5]]),
    budget_B=jnp.array([10, 10]),
  )
  assert -4.0 / gnmt_penalty(10, 0.6) == pytest.approx(-2.31, abs=0.01)
  np.testing.assert_array_equal(beam_lib.is_done(state, 0.6, early_stop=True), [True, False])
  np.testing.assert_array_equal(beam_lib.is_done(state, 0.6, early_stop=False), [False, False])


def test_sampling_with_top_k_one_or_tiny_top_p_is_greedy(model, params):
  expected = greedy(model, params)
  sample = lambda **kw: (
    translate(
      model, params, SOURCE, decoding.Sampling(temperature=5.0, **kw), rng=jax.random.PRNGKey(7)
    ).tokens_BxO
  )
  np.testing.assert_array_equal(sample(top_k=1, top_p=1.0), expected)
  np.testing.assert_array_equal(sample(top_k=0, top_p=1e-6), expected)
  # A hot unfiltered sampler does wander off the greedy path.
  hot = sample(top_k=0, top_p=1.0)
  assert not np.array_equal(hot, expected)


def test_filter_logits_keeps_the_top_k_and_the_nucleus():
  logits = jnp.log(jnp.array([[0.5, 0.2, 0.2, 0.1]]))
  kept = lambda **kw: np.isfinite(decoding.filter_logits(logits, temperature=1.0, **kw))[0]
  np.testing.assert_array_equal(kept(top_k=1, top_p=1.0), [1, 0, 0, 0])
  # 0.5 alone is short of 0.6, so 0.2 joins, and the other 0.2 ties with it.
  np.testing.assert_array_equal(kept(top_k=0, top_p=0.6), [1, 1, 1, 0])
  np.testing.assert_array_equal(kept(top_k=0, top_p=0.5), [1, 0, 0, 0])
  np.testing.assert_array_equal(kept(top_k=0, top_p=1.0), [1, 1, 1, 1])


def test_scanned_layers_decode_as_the_looped_model(model, params):
  """Scanned weights decode as separate layers (no stacked cache to copy every step),
  with the same tokens and scores as the looped model."""
  scanned = Transformer(dataclasses.replace(model.config, scan_layers=True))
  stacked = stack_layer_params(params, model.config.num_layers)
  unrolled_model, unrolled_params = incremental.of(scanned).prepare(stacked)
  assert not unrolled_model.config.scan_layers
  chex.assert_trees_all_equal(unrolled_params, params)  # exactly the looped weights
  looped = beam(model, params, beam_size=3)
  scanned_out = beam(scanned, stacked, beam_size=3)
  np.testing.assert_array_equal(scanned_out.tokens_BxO, looped.tokens_BxO)
  np.testing.assert_allclose(scanned_out.scores_B, looped.scores_B, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(greedy(scanned, stacked), greedy(model, params))


def test_dot_product_attention_kernel_decodes_as_einsum(model, params):
  fused = Transformer(dataclasses.replace(model.config, attention_kernel="xla"))
  looped = beam(model, params, beam_size=3)
  fused_out = beam(fused, params, beam_size=3)
  np.testing.assert_array_equal(fused_out.tokens_BxO, looped.tokens_BxO)
  np.testing.assert_allclose(fused_out.scores_B, looped.scores_B, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", [37_000, 1_000, 997, 40])
def test_chunked_top_k_is_lax_top_k(vocab):
  rng = np.random.default_rng(vocab)
  x = rng.normal(size=(6, vocab)).astype(np.float32)
  x[0, :] = 1.0  # all tied: the lowest indices win, as in lax.top_k
  x[1, ::7] = 5.0  # ties spread over many chunks
  x[2, -10:] = 9.0  # the best ones all in the last chunk
  for k in (1, 8, 10):
    values, indices = beam_lib.top_k(jnp.asarray(x), k)
    want_values, want_indices = jax.lax.top_k(jnp.asarray(x), k)
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_array_equal(indices, want_indices)


def test_best_tokens_are_the_top_of_the_log_softmax_without_pad_and_bos():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(5, 3_000)).astype(np.float32)
  logits[:, PAD_ID] = logits[:, BOS_ID] = 50.0  # the most likely, and never generated
  logprobs, tokens = beam_lib.best_tokens(jnp.asarray(logits), 8)
  reference = np.array(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
  reference[:, [PAD_ID, BOS_ID]] = -np.inf
  want_tokens = np.argsort(-reference, axis=1, kind="stable")[:, :8]
  np.testing.assert_array_equal(tokens, want_tokens)
  np.testing.assert_allclose(
    logprobs, np.take_along_axis(reference, want_tokens, axis=1), rtol=1e-6, atol=1e-5
  )
