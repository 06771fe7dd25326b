"""Decoding on tiny random models: cache vs recompute, beam vs greedy vs exhaustive search."""

import dataclasses
import itertools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.model import decoding
from transformer.config import BOS_ID, EOS_ID, PAD_ID
from transformer.model import ModelConfig, Transformer, stack_layer_params

VOCAB = 6  # PAD, EOS, BOS, UNK and two words: EOS, UNK, 4 and 5 can be generated
GENERATED = (EOS_ID, 3, 4, 5)
EXTRA = 3
# Sentences of 3, 1 and 4 tokens (with EOS): budgets of 6, 4 and 7 output tokens.
SOURCE = jnp.array([[4, 5, 1, 0], [1, 0, 0, 0], [5, 3, 4, 1]], jnp.int32)


@pytest.fixture(scope="module")
def model():
  return Transformer(ModelConfig(vocab_size=VOCAB, max_position=32, num_layers=2, d_model=16,
                                 d_ff=32, num_heads=2, d_k=8, d_v=8))


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
  forward = jax.jit(lambda source, decoder_input: model.apply({"params": params}, source,
                                                             decoder_input))

  def logprobs(source_1xS, outputs):
    # One shape for every call (128 outputs of 8 tokens), so it compiles once.
    targets = np.zeros((128, 8), np.int32)
    for i, o in enumerate(outputs):
      targets[i, :len(o)] = o
    decoder_input = np.concatenate([np.full((128, 1), BOS_ID), targets[:, :-1]], axis=1)
    decoder_input = np.where((targets != PAD_ID), decoder_input, PAD_ID)
    logits = forward(jnp.repeat(source_1xS, 128, axis=0), jnp.asarray(decoder_input))
    token_logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)
    per_output = jnp.sum(jnp.where(targets != PAD_ID, token_logprobs[..., 0], 0.0), axis=1)
    return np.asarray(per_output)[:len(outputs)]
  return logprobs


def gnmt_penalty(length, alpha):
  """The paper's length penalty, written out independently of the code under test."""
  return ((5.0 + length) / 6.0)**alpha


def strip(tokens):
  """Token list up to and including the first EOS (or all of it)."""
  tokens = [int(t) for t in tokens if t != PAD_ID]
  return tokens[:tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


def test_cached_decoding_equals_full_recompute(model, params):
  cached = decoding.greedy_decode(model, params, SOURCE, max_decode_extra_len=EXTRA)
  recomputed = decoding.greedy_decode(model, params, SOURCE, max_decode_extra_len=EXTRA,
                                      use_cache=False)
  chex.assert_shape(cached, (3, 4 + EXTRA))
  np.testing.assert_array_equal(cached, recomputed)

  # Beam search reorders the cache rows at every step; recomputing needs no reordering.
  # Compare every hypothesis kept, not only the best (often the one-token [EOS] here).
  kwargs = dict(beam_size=4, alpha=0.6, max_decode_extra_len=EXTRA, early_stop=True)
  cached = decoding.beam_search_state(model, params, SOURCE, use_cache=True, **kwargs)
  recomputed = decoding.beam_search_state(model, params, SOURCE, use_cache=False, **kwargs)
  assert int(cached.step) == int(recomputed.step) > 2
  np.testing.assert_array_equal(cached.live_seqs_BxKxC1, recomputed.live_seqs_BxKxC1)
  np.testing.assert_array_equal(cached.finished_seqs_BxKxC1, recomputed.finished_seqs_BxKxC1)
  np.testing.assert_allclose(cached.live_logprobs_BxK, recomputed.live_logprobs_BxK, rtol=1e-5)
  np.testing.assert_allclose(cached.finished_scores_BxK, recomputed.finished_scores_BxK,
                             rtol=1e-5)


def test_cache_segments_double_from_sixteen_up_to_the_cache_length():
  assert decoding.cache_segments(64) == (16, 32, 64)
  assert decoding.cache_segments(82) == (16, 32, 64, 82)
  assert decoding.cache_segments(17) == (16, 17)
  assert decoding.cache_segments(16) == (16,)
  assert decoding.cache_segments(7) == (7,)


def test_a_long_search_grows_its_cache_and_shares_cross_attention_per_sentence(model, params):
  """24 slots: steps 0-15 run on a 16-slot cache, the rest on 24 (cache_segments), and the
  cross-attention K/V stay one row per sentence; every hypothesis must still match the
  search that recomputes the whole prefix at each step."""
  extra = 20
  _, params_copy = decoding.unrolled(model, params)
  cache, source_NxS = decoding._init_decoder_state(model, params_copy, SOURCE, 4, 16, True)
  layer = cache["decoder"]["layer_0"]
  chex.assert_shape(source_NxS, (12, 4))
  chex.assert_shape(layer["self_attention"]["key"], (12, 2, 8, 16))  # [N, H, K, C]
  chex.assert_shape(layer["cross_attention"]["cross_key"], (3, 2, 8, 4))  # [B, H, K, S]

  kwargs = dict(beam_size=4, alpha=0.6, max_decode_extra_len=extra, early_stop=False)
  cached = decoding.beam_search_state(model, params, SOURCE, use_cache=True, **kwargs)
  recomputed = decoding.beam_search_state(model, params, SOURCE, use_cache=False, **kwargs)
  assert int(cached.step) == int(recomputed.step) == 4 + extra  # past the first segment
  chex.assert_shape(cached.decoder_state["decoder"]["layer_1"]["self_attention"]["value"],
                    (12, 2, 4 + extra, 8))  # grown to the full length: [N, H, C, E]
  np.testing.assert_array_equal(cached.live_seqs_BxKxC1, recomputed.live_seqs_BxKxC1)
  np.testing.assert_array_equal(cached.finished_seqs_BxKxC1, recomputed.finished_seqs_BxKxC1)
  np.testing.assert_allclose(cached.live_logprobs_BxK, recomputed.live_logprobs_BxK, rtol=1e-4)
  np.testing.assert_allclose(cached.finished_scores_BxK, recomputed.finished_scores_BxK,
                             rtol=1e-4)


def test_beam_scores_are_penalized_logprobs_of_the_hypotheses(model, params, sequence_logprobs):
  kwargs = dict(beam_size=4, alpha=0.6, max_decode_extra_len=EXTRA, use_cache=True)
  tokens, scores = decoding.beam_search(model, params, SOURCE, early_stop=True, **kwargs)
  state = decoding.beam_search_state(model, params, SOURCE, early_stop=True, **kwargs)
  np.testing.assert_array_equal(tokens, state.finished_seqs_BxKxC1[:, 0, 1:])
  np.testing.assert_array_equal(scores, state.finished_scores_BxK[:, 0])
  for b in range(SOURCE.shape[0]):
    outputs = [strip(seq[1:]) for seq in np.asarray(state.finished_seqs_BxKxC1[b])]
    assert max(len(o) for o in outputs) > 2
    penalties = np.array([gnmt_penalty(len(o), 0.6) for o in outputs])
    expected = sequence_logprobs(SOURCE[b:b + 1], outputs) / penalties
    np.testing.assert_allclose(state.finished_scores_BxK[b], expected, rtol=1e-5)


def test_beam_size_one_is_greedy(model, params):
  # alpha = 0: with a length penalty a finished hypothesis can lose to a longer one that
  # greedy never looks at.
  greedy = decoding.greedy_decode(model, params, SOURCE, max_decode_extra_len=EXTRA)
  beam, _ = decoding.beam_search(model, params, SOURCE, beam_size=1, alpha=0.0,
                                 max_decode_extra_len=EXTRA)
  np.testing.assert_array_equal(beam, greedy)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 3.0])
def test_wide_beam_finds_the_exhaustive_best(model, params, sequence_logprobs, alpha):
  source = jnp.array([[4, 5, 1], [3, 1, 0]], jnp.int32)  # budgets of 4 and 3 tokens
  extra = 1
  # 128 beams hold every prefix (at most 3^3 live, 4 * 27 candidates) at every step.
  tokens, scores = decoding.beam_search(model, params, source, beam_size=128, alpha=alpha,
                                        max_decode_extra_len=extra)
  for b, budget in enumerate([4, 3]):
    # Every output that ends with EOS within the budget, or fills it without EOS.
    outputs = [list(words) + [EOS_ID] for n in range(budget)
               for words in itertools.product((3, 4, 5), repeat=n)]
    outputs += [list(words) for words in itertools.product((3, 4, 5), repeat=budget)]
    logprobs = sequence_logprobs(source[b:b + 1], outputs)
    penalized = logprobs / np.array([gnmt_penalty(len(o), alpha) for o in outputs])
    best = int(np.argmax(penalized))
    assert strip(tokens[b]) == outputs[best]
    np.testing.assert_allclose(scores[b], penalized[best], rtol=1e-4)


def test_output_stops_at_source_length_plus_extra_when_eos_never_comes(model, params):
  never_eos = constant_output_params(params, eos_logit=-30.0)
  budgets = np.sum(np.asarray(SOURCE) != PAD_ID, axis=1) + EXTRA
  beam, _ = decoding.beam_search(model, never_eos, SOURCE, beam_size=4, alpha=0.6,
                                 max_decode_extra_len=EXTRA)
  greedy = decoding.greedy_decode(model, never_eos, SOURCE, max_decode_extra_len=EXTRA)
  for tokens in (np.asarray(beam), np.asarray(greedy)):
    assert not np.any(tokens == EOS_ID)
    np.testing.assert_array_equal(np.sum(tokens != PAD_ID, axis=1), budgets)
    assert np.all(tokens[np.arange(tokens.shape[1]) >= budgets[:, None]] == PAD_ID)


def test_early_stop_ends_the_search_without_changing_the_result(model, params):
  eos_first = constant_output_params(params, eos_logit=30.0)
  # Called as beam_search calls it, so the compilation is shared with the other tests.
  kwargs = dict(beam_size=4, alpha=0.6, max_decode_extra_len=EXTRA, use_cache=True)
  early = decoding.beam_search_state(model, eos_first, SOURCE, early_stop=True, **kwargs)
  full = decoding.beam_search_state(model, eos_first, SOURCE, early_stop=False, **kwargs)
  # Step 0 finishes [EOS]; step 1 fills the beam with [w, EOS] (about -30 / penalty(2)
  # = -26); no live beam, at about -60 for two tokens, can then reach more than
  # -60 / penalty(7) = -40 (7: the longest budget, the smallest bound).
  assert int(early.step) == 2
  assert int(full.step) == 4 + EXTRA
  np.testing.assert_array_equal(early.finished_seqs_BxKxC1[:, 0, 1], EOS_ID)
  np.testing.assert_array_equal(early.finished_seqs_BxKxC1[:, 0], full.finished_seqs_BxKxC1[:, 0])

  # On the random model too, stopping early never changes the outcome, also when a
  # strong length penalty (alpha 3) lets long hypotheses overtake finished short ones.
  for alpha in (0.6, 3.0):
    kwargs["alpha"] = alpha
    early = decoding.beam_search_state(model, params, SOURCE, early_stop=True, **kwargs)
    full = decoding.beam_search_state(model, params, SOURCE, early_stop=False, **kwargs)
    np.testing.assert_array_equal(early.finished_seqs_BxKxC1[:, 0],
                                  full.finished_seqs_BxKxC1[:, 0])
    np.testing.assert_allclose(early.finished_scores_BxK[:, 0], full.finished_scores_BxK[:, 0],
                               rtol=1e-6)


def test_early_stop_bound_uses_the_penalty_at_the_maximum_length():
  # A live hypothesis at log P = -4 may grow to the sentence's maximum length of 10 and
  # then score -4 / penalty(10) = -2.31 (alpha 0.6) or better.
  max_len_B = jnp.array([10, 10])
  state = decoding.BeamState(
      step=jnp.array(2), live_seqs_BxKxC1=None, live_logprobs_BxK=jnp.array([[-4.0], [-4.0]]),
      finished_seqs_BxKxC1=None, finished_scores_BxK=jnp.array([[-1.5], [-2.5]]),
      decoder_state=None)
  assert -4.0 / gnmt_penalty(10, 0.6) == pytest.approx(-2.31, abs=0.01)
  np.testing.assert_array_equal(decoding._is_done(state, max_len_B, 0.6, early_stop=True),
                                [True, False])
  np.testing.assert_array_equal(decoding._is_done(state, max_len_B, 0.6, early_stop=False),
                                [False, False])


def test_sampling_with_top_k_one_or_tiny_top_p_is_greedy(model, params):
  greedy = decoding.greedy_decode(model, params, SOURCE, max_decode_extra_len=EXTRA)
  # All arguments spelled out, so the three calls share one compilation.
  sample = lambda **kw: decoding.sample_decode(model, params, SOURCE, jax.random.PRNGKey(7),
                                               max_decode_extra_len=EXTRA, use_cache=True,
                                               temperature=5.0, **kw)
  np.testing.assert_array_equal(sample(top_k=1, top_p=1.0), greedy)
  np.testing.assert_array_equal(sample(top_k=0, top_p=1e-6), greedy)
  # A hot unfiltered sampler does wander off the greedy path.
  hot = sample(top_k=0, top_p=1.0)
  assert not np.array_equal(hot, greedy)


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
  unrolled_model, unrolled_params = decoding.unrolled(scanned, stacked)
  assert not unrolled_model.config.scan_layers
  chex.assert_trees_all_equal(unrolled_params, params)  # exactly the looped weights
  kwargs = dict(beam_size=3, alpha=0.6, max_decode_extra_len=EXTRA)
  looped_tokens, looped_scores = decoding.beam_search(model, params, SOURCE, **kwargs)
  scanned_tokens, scanned_scores = decoding.beam_search(scanned, stacked, SOURCE, **kwargs)
  np.testing.assert_array_equal(scanned_tokens, looped_tokens)
  np.testing.assert_allclose(scanned_scores, looped_scores, rtol=1e-5, atol=1e-5)
  greedy = decoding.greedy_decode(scanned, stacked, SOURCE, max_decode_extra_len=EXTRA)
  np.testing.assert_array_equal(
      greedy, decoding.greedy_decode(model, params, SOURCE, max_decode_extra_len=EXTRA))


def test_dot_product_attention_kernel_decodes_as_einsum(model, params):
  fused = Transformer(dataclasses.replace(model.config, attention_kernel="xla"))
  kwargs = dict(beam_size=3, alpha=0.6, max_decode_extra_len=EXTRA)
  tokens, scores = decoding.beam_search(model, params, SOURCE, **kwargs)
  fused_tokens, fused_scores = decoding.beam_search(fused, params, SOURCE, **kwargs)
  np.testing.assert_array_equal(fused_tokens, tokens)
  np.testing.assert_allclose(fused_scores, scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", [37_000, 1_000, 997, 40])
def test_chunked_top_k_is_lax_top_k(vocab):
  rng = np.random.default_rng(vocab)
  x = rng.normal(size=(6, vocab)).astype(np.float32)
  x[0, :] = 1.0  # all tied: the lowest indices win, as in lax.top_k
  x[1, ::7] = 5.0  # ties spread over many chunks
  x[2, -10:] = 9.0  # the best ones all in the last chunk
  for k in (1, 8, 10):
    values, indices = decoding.top_k(jnp.asarray(x), k)
    want_values, want_indices = jax.lax.top_k(jnp.asarray(x), k)
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_array_equal(indices, want_indices)


def test_best_tokens_are_the_top_of_the_log_softmax_without_pad_and_bos():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(5, 3_000)).astype(np.float32)
  logits[:, PAD_ID] = logits[:, BOS_ID] = 50.0  # the most likely, and never generated
  logprobs, tokens = decoding.best_tokens(jnp.asarray(logits), 8)
  reference = np.array(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
  reference[:, [PAD_ID, BOS_ID]] = -np.inf
  want_tokens = np.argsort(-reference, axis=1, kind="stable")[:, :8]
  np.testing.assert_array_equal(tokens, want_tokens)
  np.testing.assert_allclose(logprobs, np.take_along_axis(reference, want_tokens, axis=1),
                             rtol=1e-6, atol=1e-5)
