"""transformer/model/speculative.py and the multi-token, per-row cache it decodes with.

Speculative decoding must reproduce the target's own decoding exactly, whatever the
draft: greedy token for token, sampling in distribution (checked statistically, against
the target's exact distribution enumerated over a tiny vocabulary).
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.model_helpers import random_params, tiny_config
from transformer.config import BOS_ID, EOS_ID, PAD_ID
from transformer.model import Transformer, decoding, speculative, stack_layer_params

# Sentences of 3, 1, 5 and 2 tokens (with EOS): budgets of 7, 5, 9 and 6 output tokens.
SOURCE = jnp.array([[4, 5, 1, 0, 0], [1, 0, 0, 0, 0], [5, 3, 4, 6, 1], [7, 1, 0, 0, 0]],
                   jnp.int32)
EXTRA = 4


def make_model(seed, *, scan_layers=False, decoder_only=False, num_layers=2, d_model=8,
               vocab_size=13, positional=None):
  """A tiny model with random weights far from init's near-uniform outputs.

  Untied embeddings: tied ones make random models repeat their input token forever.
  The same seed gives the same function scanned or not.
  """
  positional = positional or ("rope" if decoder_only else "sinusoidal")
  cfg = tiny_config(vocab_size=vocab_size, max_position=48, num_layers=num_layers,
                    d_model=d_model, decoder_only=decoder_only, positional=positional,
                    tie_embeddings=False)
  params = random_params(cfg, seed)
  if scan_layers:
    cfg = dataclasses.replace(cfg, scan_layers=True)
    params = stack_layer_params(params, num_layers)
  return Transformer(cfg), params


def strip(tokens):
  """Token list up to and including the first EOS (or all of it)."""
  tokens = [int(t) for t in tokens if t != PAD_ID]
  return tokens[:tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


# ----------------------------------------------------------------------------------
# The cache: several tokens per call, a position per row, rollback.


@functools.partial(jax.jit, static_argnums=0)
def _apply_cached(model, params, cache, source, tokens, position=None):
  if position is not None:
    cache = speculative.set_positions(cache, position)
  logits, variables = model.apply({"params": params, "cache": cache}, None, source, tokens,
                                  use_cache=True, mutable=["cache"], method="decode")
  return logits, variables["cache"]


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _fresh_cache(model, params, source, batch, cache_len):
  encoded = None if source is None else model.apply({"params": params}, source,
                                                    method="encode")
  _, variables = model.apply({"params": params}, encoded, source,
                             jnp.zeros((batch, cache_len), jnp.int32), use_cache=True,
                             mutable=["cache"], method="decode")
  return variables["cache"]


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, params, source, decoder_input):
  return model.apply({"params": params}, source, decoder_input)


@pytest.mark.parametrize("scan_layers,decoder_only,positional", [
    pytest.param(False, False, "learned", id="learned"),
    pytest.param(True, True, "rope", id="scanned-rope-decoder_only"),
])
def test_multi_token_calls_match_one_token_calls_and_teacher_forcing(
    scan_layers, decoder_only, positional):
  model, params = make_model(0, scan_layers=scan_layers, decoder_only=decoder_only,
                             positional=positional)
  source = None if decoder_only else SOURCE[:3]
  inputs = jnp.array([[BOS_ID, 4, 5, 6, 3, 7, 8], [BOS_ID, 9, 3, 3, 4, 5, 6],
                      [BOS_ID, 10, 11, 4, 4, 5, 3]], jnp.int32)
  full = _forward(model, params, source, inputs)
  cache_len = 10
  assert speculative.set_positions(_fresh_cache(model, params, source, 3, cache_len),
                                   jnp.zeros(3, jnp.int32))["decoder"]["position"].shape == (3,)

  # Rows at different positions: row b has read its first `start[b]` inputs one at a
  # time (scalar counter), then reads the next 3 in one call at its own position.
  start = np.array([1, 3, 2])
  cache = _fresh_cache(model, params, source, 3, cache_len)
  one_at_a_time = []
  for t in range(4):
    logits, cache = _apply_cached(model, params, cache, source, inputs[:, t:t + 1])
    one_at_a_time.append(logits[:, 0])
  one_at_a_time = jnp.stack(one_at_a_time, axis=1)
  np.testing.assert_allclose(one_at_a_time, full[:, :4], atol=2e-5, rtol=1e-5)
  chunk = jnp.stack([inputs[b, start[b]:start[b] + 3] for b in range(3)])
  logits, cache = _apply_cached(model, params, cache, source, chunk, jnp.asarray(start))
  expected = jnp.stack([full[b, start[b]:start[b] + 3] for b in range(3)])
  np.testing.assert_allclose(logits, expected, atol=2e-5, rtol=1e-5)
  np.testing.assert_array_equal(cache["decoder"]["position"], start + 3)
  # Scalar counter with several tokens: the prefill's path.
  logits, _ = _apply_cached(model, params, _fresh_cache(model, params, source, 3, cache_len),
                            source, inputs[:, :5])
  np.testing.assert_allclose(logits, full[:, :5], atol=2e-5, rtol=1e-5)


def test_rolled_back_rows_forget_what_they_were_fed():
  model, params = make_model(1, scan_layers=True)
  source = SOURCE[:2]
  inputs = jnp.array([[BOS_ID, 4, 5, 6, 3], [BOS_ID, 9, 3, 3, 4]], jnp.int32)
  cache = _fresh_cache(model, params, source, 2, 9)
  _, cache = _apply_cached(model, params, cache, source, inputs, jnp.zeros(2, jnp.int32))
  # Row 0 goes back to 2 tokens, row 1 to 4; then both read 3 tokens unlike the old ones.
  new = jnp.array([[8, 7, 10], [11, 12, 8]], jnp.int32)
  logits, _ = _apply_cached(model, params, cache, source, new, jnp.array([2, 4]))
  fresh = [jnp.concatenate([inputs[0, :2], new[0]]), jnp.concatenate([inputs[1, :4], new[1]])]
  for b, (keep, row) in enumerate(zip([2, 4], fresh)):
    expected = _forward(model, params, source[b:b + 1], row[None])[0, keep:]
    np.testing.assert_allclose(logits[b], expected, atol=2e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------
# Greedy: identical tokens for any draft.


@pytest.mark.parametrize("scan_layers,draft_len,draft_kind", [
    (False, 1, "random"), (False, 3, "target"), (True, 3, "random"), (True, 1, "target")])
def test_speculative_greedy_equals_greedy(scan_layers, draft_len, draft_kind):
  target, target_params = make_model(2, scan_layers=scan_layers)
  if draft_kind == "target":
    draft, draft_params = target, target_params
  else:
    # A seed whose draft agrees now and then, so rows accept different amounts.
    draft, draft_params = make_model(9, num_layers=1, scan_layers=scan_layers)
  greedy = decoding.greedy_decode(target, target_params, SOURCE, max_decode_extra_len=EXTRA)
  out = speculative.speculative_greedy_decode(target, target_params, draft, draft_params,
                                              SOURCE, draft_len=draft_len,
                                              max_decode_extra_len=EXTRA)
  np.testing.assert_array_equal(out.tokens_BxC, greedy)
  lengths = [len(strip(row)) for row in np.asarray(greedy)]
  assert len(set(lengths)) > 2  # rows end at different points: EOS or their budgets
  generated = sum(lengths)
  # The prefill yields each row's first token; every round then yields 1 .. k + 1.
  rounds = int(out.target_calls)
  assert generated - len(lengths) <= rounds * (draft_len + 1) * len(lengths)
  assert float(out.tokens_per_target_call) == pytest.approx(generated / rounds)
  if draft_kind == "target":
    assert float(out.acceptance_rate) == 1.0
    # Each row needs ceil((its tokens - 1) / (k + 1)) rounds; the batch, the slowest row's.
    assert rounds == max(-(-(n - 1) // (draft_len + 1)) for n in lengths)
  else:
    assert 0.0 < float(out.acceptance_rate) < 1.0


def test_speculative_greedy_when_no_row_ever_ends_with_eos():
  """Every row runs into its length budget, mid-round for most draft lengths."""
  target, target_params = make_model(2)
  never_eos = jax.tree.map(lambda x: x, target_params)
  kernel_DxV = never_eos["decoder"]["output_projection"]["kernel"]
  # Logits are y W[:, v]: EOS's becomes 0, and one of tokens 3 and 4 always beats it.
  never_eos["decoder"]["output_projection"]["kernel"] = kernel_DxV.at[:, EOS_ID].set(
      0.0).at[:, 4].set(-kernel_DxV[:, 3])
  greedy = decoding.greedy_decode(target, never_eos, SOURCE, max_decode_extra_len=EXTRA)
  budgets = np.sum(np.asarray(SOURCE) != PAD_ID, axis=1) + EXTRA
  out = speculative.speculative_greedy_decode(target, never_eos, target, never_eos, SOURCE,
                                              draft_len=3, max_decode_extra_len=EXTRA)
  np.testing.assert_array_equal(out.tokens_BxC, greedy)
  assert not np.any(np.asarray(greedy) == EOS_ID)
  np.testing.assert_array_equal(np.sum(np.asarray(greedy) != PAD_ID, axis=1), budgets)


# ----------------------------------------------------------------------------------
# Decoder-only: prompt continuation.


def _naive_prompt_greedy(model, params, prompt, max_new_tokens):
  """Argmax of the teacher-forced model over each row's prompt + output so far."""
  forward = lambda x: _forward(model, params, None, x)
  prompt = np.asarray(prompt)
  rows = []
  for row in prompt:
    sequence = [int(t) for t in row if t != PAD_ID]
    out = []
    while len(out) < max_new_tokens and (not out or out[-1] != EOS_ID):
      buffer = np.zeros((1, prompt.shape[1] + max_new_tokens), np.int32)
      buffer[0, :len(sequence)] = sequence
      logits = np.array(forward(jnp.asarray(buffer))[0, len(sequence) - 1])
      logits[[PAD_ID, BOS_ID]] = -np.inf
      out.append(int(np.argmax(logits)))
      sequence.append(out[-1])
    rows.append(out + [PAD_ID] * (max_new_tokens - len(out)))
  return np.array(rows)


def test_decoder_only_prompt_greedy_and_speculative_greedy():
  target, target_params = make_model(2, decoder_only=True)
  draft, draft_params = make_model(9, decoder_only=True, num_layers=1)
  prompt = speculative.translation_prompt(SOURCE)
  new_tokens = 8
  plain = speculative.prompt_greedy_decode(target, target_params, prompt,
                                           max_new_tokens=new_tokens)
  np.testing.assert_array_equal(plain, _naive_prompt_greedy(target, target_params, prompt,
                                                            new_tokens))
  assert len({len(strip(row)) for row in np.asarray(plain)}) > 1
  out = speculative.speculative_greedy_decode(target, target_params, draft, draft_params,
                                              prompt, draft_len=2, max_new_tokens=new_tokens)
  np.testing.assert_array_equal(out.tokens_BxC, plain)
  assert 0.0 < float(out.acceptance_rate) < 1.0
  # Sampling runs on a decoder-only pair too, and stops as it must.
  sampled = speculative.speculative_sample_decode(
      target, target_params, draft, draft_params, prompt, jax.random.key(0), draft_len=2,
      max_new_tokens=new_tokens).tokens_BxC
  assert sampled.shape == (4, new_tokens)
  assert not np.any(np.isin(np.asarray(sampled), [BOS_ID]))
  for row in np.asarray(sampled):
    assert np.all(row[len(strip(row)):] == PAD_ID)


# ----------------------------------------------------------------------------------
# Sampling: the target's distribution, exactly.

SAMPLE_VOCAB = 8  # EOS and the words 3 .. 7 can be generated
SAMPLES = 20000
FILTER = dict(temperature=0.7, top_k=5, top_p=0.95)


def _outputs_and_token_logprobs(model, params, source_1xS, budget):
  """Every output of at most `budget` tokens (PAD-padded tuples) and each of its tokens'
  log-probability under sample_decode's filtered distribution [outputs, budget]."""
  words = range(3, SAMPLE_VOCAB)
  outputs = [tuple(w) + (EOS_ID,) for n in range(budget)
             for w in itertools.product(words, repeat=n)]
  outputs += list(itertools.product(words, repeat=budget))
  outputs = [o + (PAD_ID,) * (budget - len(o)) for o in outputs]
  targets = np.array(outputs, np.int32)
  decoder_input = np.concatenate([np.full((len(outputs), 1), BOS_ID), targets[:, :-1]], axis=1)
  logits = _forward(model, params, jnp.repeat(source_1xS, len(outputs), axis=0),
                    jnp.asarray(decoder_input))
  logprobs = speculative._filtered_logprobs(logits, **FILTER)
  token_logprobs = np.asarray(jnp.take_along_axis(logprobs, targets[..., None], -1)[..., 0])
  return outputs, np.where(targets != PAD_ID, token_logprobs, 0.0)


def _distribution(outputs, token_logprobs):
  return dict(zip(outputs, np.exp(np.sum(token_logprobs, axis=1))))


def _empirical(tokens):
  rows, counts = np.unique(np.asarray(tokens), axis=0, return_counts=True)
  return {tuple(int(t) for t in row): c / len(tokens) for row, c in zip(rows, counts)}


def _total_variation(p, q):
  return 0.5 * sum(abs(p.get(key, 0.0) - q.get(key, 0.0)) for key in set(p) | set(q))


def test_speculative_sampling_has_the_targets_distribution():
  target, target_params = make_model(3, vocab_size=SAMPLE_VOCAB, d_model=16)
  # The draft: the target's weights perturbed, so it is accepted about half the time.
  noise = np.random.default_rng(1)
  draft, draft_params = target, jax.tree.map(
      lambda x: x + 0.07 * noise.normal(size=x.shape).astype(x.dtype), target_params)
  source_1xS = jnp.array([[5, 1]], jnp.int32)
  extra = 1  # budget: 3 tokens
  outputs, target_logprobs = _outputs_and_token_logprobs(target, target_params, source_1xS, 3)
  exact = _distribution(outputs, target_logprobs)
  assert sum(exact.values()) == pytest.approx(1.0, abs=1e-4)
  source = jnp.repeat(source_1xS, SAMPLES, axis=0)
  out = speculative.speculative_sample_decode(
      target, target_params, draft, draft_params, source, jax.random.key(0), draft_len=2,
      max_decode_extra_len=extra, **FILTER)
  assert 0.2 < float(out.acceptance_rate) < 0.9  # both branches of the rule are exercised
  # Sampling error alone: TV ~ 0.02 here (about a hundred outputs of any weight).
  bound = 0.05
  assert _total_variation(_empirical(out.tokens_BxC), exact) < bound
  # Power: accepting every proposal would take the first token from the target (the
  # prefill) and the next two from the draft; that distribution is far off.
  _, draft_logprobs = _outputs_and_token_logprobs(draft, draft_params, source_1xS, 3)
  always_accept = _distribution(
      outputs, np.concatenate([target_logprobs[:, :1], draft_logprobs[:, 1:]], axis=1))
  assert _total_variation(always_accept, exact) > 4 * bound
