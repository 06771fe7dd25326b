"""transformer/model/decoding/speculative.py and the multi-token, per-row cache it
decodes with.

Speculative decoding must reproduce the target's own decoding exactly, whatever the
draft: greedy token for token, sampling in distribution (checked statistically, against
the target's exact distribution enumerated over a tiny vocabulary).
"""

import dataclasses
import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.model_helpers import (
  EXTRA,
  MAX_POSITION,
  SOURCE,
  acceptance_rate,
  make_model,
  random_params,
  strip,
  tiny_config,
  tokens_per_call,
)
from transformer.config import BOS_ID, EOS_ID, PAD_ID
from transformer.model import Transformer, decoding, incremental


def translate(model, params, search, draft_params=None, source=SOURCE, extra=EXTRA, rng=None):
  """decoding.decode of `search` translating `source` (a speculative search given its
  draft's parameters, which it owns): the Generation."""
  prompts = decoding.translation_prompts(source, extra, model.config.decoder_only)
  if draft_params is not None:
    search = dataclasses.replace(search, draft_params=draft_params)
  return decoding.decode(model, params, prompts, search, rng)


# ----------------------------------------------------------------------------------
# The cache: several tokens per call, a position per row, rollback.


@functools.partial(jax.jit, static_argnums=0)
def _apply_cached(model, params, cache, source, tokens, position=None):
  if position is not None:
    cache = (
      incremental.of(model).set_positions(incremental.DecoderState(cache, source), position).cache
    )
  logits, variables = model.apply(
    {"params": params, "cache": cache},
    None,
    source,
    tokens,
    use_cache=True,
    mutable=["cache"],
    method="decode",
  )
  return logits, variables["cache"]


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _fresh_cache(model, params, source, batch, cache_len):
  encoded = None if source is None else model.apply({"params": params}, source, method="encode")
  _, variables = model.apply(
    {"params": params},
    encoded,
    source,
    jnp.zeros((batch, cache_len), jnp.int32),
    use_cache=True,
    mutable=["cache"],
    method="decode",
  )
  return variables["cache"]


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, params, source, decoder_input):
  return model.apply({"params": params}, source, decoder_input)


@pytest.mark.parametrize(
  "scan_layers,decoder_only,positional",
  [
    pytest.param(False, False, "learned", id="learned"),
    pytest.param(True, True, "rope", id="scanned-rope-decoder_only"),
  ],
)
def test_multi_token_calls_per_row_positions_and_rollback(scan_layers, decoder_only, positional):
  """Cached calls of one and of several tokens, at a shared or a per-row position, give
  the teacher-forced logits, also after rows were rolled back and fed other tokens."""
  model, params = make_model(
    0, scan_layers=scan_layers, decoder_only=decoder_only, positional=positional
  )
  source = None if decoder_only else SOURCE[:3]
  inputs = jnp.array(
    [[BOS_ID, 4, 5, 6, 3, 7, 8], [BOS_ID, 9, 3, 3, 4, 5, 6], [BOS_ID, 10, 11, 4, 4, 5, 3]],
    jnp.int32,
  )
  full = _forward(model, params, source, inputs)
  cache_len = 10

  # Several tokens at the shared (scalar) counter: the prefill's call.
  fresh = _fresh_cache(model, params, source, 3, cache_len)
  logits, cache = _apply_cached(model, params, fresh, source, inputs[:, :5])
  np.testing.assert_allclose(logits, full[:, :5], atol=2e-5, rtol=1e-5)
  assert int(cache["decoder"]["position"]) == 5

  # One token at a time, as beam search feeds them.
  cache = fresh
  for t in range(4):
    logits, cache = _apply_cached(model, params, cache, source, inputs[:, t : t + 1])
    np.testing.assert_allclose(logits[:, 0], full[:, t], atol=2e-5, rtol=1e-5)

  # Rows rolled back to 1, 3 and 2 tokens read 3 tokens unlike the ones they had, each at
  # its own position; stale slots must not leak in.
  keep = np.array([1, 3, 2])
  new = jnp.array([[8, 7, 10], [11, 12, 8], [12, 3, 9]], jnp.int32)
  logits, cache = _apply_cached(model, params, cache, source, new, jnp.asarray(keep))
  np.testing.assert_array_equal(cache["decoder"]["position"], keep + 3)
  # Then one more token each, the per-row counters advancing on their own.
  last = jnp.array([5, 6, 7], jnp.int32)
  last_logits, cache = _apply_cached(model, params, cache, source, last[:, None])
  np.testing.assert_array_equal(cache["decoder"]["position"], keep + 4)
  rolled = np.zeros_like(np.asarray(inputs))
  for b in range(3):
    rolled[b, : keep[b] + 4] = np.concatenate(
      [np.asarray(inputs[b, : keep[b]]), new[b], last[b : b + 1]]
    )
  refed = _forward(model, params, source, jnp.asarray(rolled))
  expected = jnp.stack([refed[b, keep[b] : keep[b] + 4] for b in range(3)])
  np.testing.assert_allclose(logits, expected[:, :3], atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(last_logits[:, 0], expected[:, 3], atol=2e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------
# Greedy: identical tokens for any draft.


# Each of scan_layers, draft_len and the draft in both its values, in three compilations.
# A random draft's seed is one that agrees now and then, so rows accept different
# amounts; None: the target drafts for itself.
@pytest.mark.parametrize(
  "scan_layers,draft_len,draft_seed,positional",
  [
    pytest.param(False, 1, 9, "sinusoidal", id="k1-random"),
    pytest.param(True, 3, 27, "learned", id="k3-random-scanned-learned"),
    pytest.param(False, 3, None, "sinusoidal", id="k3-target"),
  ],
)
def test_speculative_greedy_equals_greedy(scan_layers, draft_len, draft_seed, positional):
  target, target_params = make_model(2, scan_layers=scan_layers, positional=positional)
  if draft_seed is None:
    draft, draft_params = target, target_params
  else:
    draft, draft_params = make_model(draft_seed, num_layers=1, scan_layers=scan_layers)
  greedy = translate(target, target_params, decoding.Greedy()).tokens_BxO
  out = translate(target, target_params, decoding.Speculative(draft, draft_len), draft_params)
  np.testing.assert_array_equal(out.tokens_BxO, greedy)
  lengths = [len(strip(row)) for row in np.asarray(greedy)]
  assert len(set(lengths)) > 2  # rows end at different points: EOS or their budgets
  generated = sum(lengths)
  # The prefill yields each row's first token; every round then yields 1 .. k + 1 for
  # each row still going, and the batch runs until its longest row is done.
  rounds = int(out.calls)
  assert -(-(max(lengths) - 1) // (draft_len + 1)) <= rounds <= max(lengths) - 1
  row_rounds = int(out.row_calls)
  assert tokens_per_call(out) == pytest.approx(generated / row_rounds)
  if draft_seed is None:
    assert acceptance_rate(out) == 1.0
    # Each row needs ceil((its tokens - 1) / (k + 1)) rounds; the batch, the slowest row's.
    per_row = [-(-(n - 1) // (draft_len + 1)) for n in lengths]
    assert rounds == max(per_row) and row_rounds == sum(per_row)
  else:
    assert 0.0 < acceptance_rate(out) < 1.0


def test_speculative_greedy_when_no_row_ever_ends_with_eos():
  """Every row runs into its length budget, mid-round for most draft lengths."""
  target, target_params = make_model(2)
  never_eos = jax.tree.map(lambda x: x, target_params)
  kernel_DxV = never_eos["decoder"]["output_projection"]["kernel"]
  # Logits are y W[:, v]: EOS's becomes 0, and one of tokens 3 and 4 always beats it.
  never_eos["decoder"]["output_projection"]["kernel"] = (
    kernel_DxV.at[:, EOS_ID].set(0.0).at[:, 4].set(-kernel_DxV[:, 3])
  )
  greedy = translate(target, never_eos, decoding.Greedy()).tokens_BxO
  budgets = np.sum(np.asarray(SOURCE) != PAD_ID, axis=1) + EXTRA
  out = translate(target, never_eos, decoding.Speculative(target, 3), never_eos)
  np.testing.assert_array_equal(out.tokens_BxO, greedy)
  assert not np.any(np.asarray(greedy) == EOS_ID)
  np.testing.assert_array_equal(np.sum(np.asarray(greedy) != PAD_ID, axis=1), budgets)


class _ReadsTargetEncoding(Transformer):
  """A draft without an encoder of its own: its decoder reads the target's encoding."""

  reads_target_encoding = True


def test_a_draft_reading_the_targets_encoding_is_just_another_draft():
  """The target's own decoder as such a draft, with no encoder parameters at all: the
  draft must be fed the target's encoder output (encoding for itself would fail), and
  then it agrees with every token."""
  target, target_params = make_model(2)
  draft = _ReadsTargetEncoding(target.config)
  assert decoding.reads_target_encoding(draft) and not decoding.reads_target_encoding(target)
  draft_params = {k: v for k, v in target_params.items() if k != "encoder"}
  greedy = translate(target, target_params, decoding.Greedy()).tokens_BxO
  out = translate(target, target_params, decoding.Speculative(draft, 3), draft_params)
  np.testing.assert_array_equal(out.tokens_BxO, greedy)
  assert acceptance_rate(out) == 1.0
  with pytest.raises(ValueError, match="d_model"):
    other, other_params = make_model(9, d_model=16)
    translate(
      target,
      target_params,
      decoding.Speculative(_ReadsTargetEncoding(other.config), 3),
      other_params,
    )


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
      buffer[0, : len(sequence)] = sequence
      logits = np.array(forward(jnp.asarray(buffer))[0, len(sequence) - 1])
      logits[[PAD_ID, BOS_ID]] = -np.inf
      out.append(int(np.argmax(logits)))
      sequence.append(out[-1])
    rows.append(out + [PAD_ID] * (max_new_tokens - len(out)))
  return np.array(rows)


def test_decoder_only_prompt_greedy_and_speculative_greedy():
  target, target_params = make_model(2, decoder_only=True)
  draft, draft_params = make_model(9, decoder_only=True, num_layers=1)
  prompts = decoding.continuation_prompts(
    decoding.translation_prompts(SOURCE, EXTRA, True).prompt_BxP, max_new_tokens=8
  )
  plain = decoding.decode(target, target_params, prompts, decoding.Greedy()).tokens_BxO
  np.testing.assert_array_equal(
    plain, _naive_prompt_greedy(target, target_params, prompts.prompt_BxP, prompts.out_len)
  )
  assert len({len(strip(row)) for row in np.asarray(plain)}) > 1
  out = decoding.decode(
    target, target_params, prompts, decoding.Speculative(draft, 2, draft_params=draft_params)
  )
  np.testing.assert_array_equal(out.tokens_BxO, plain)
  assert 0.0 < acceptance_rate(out) < 1.0


# ----------------------------------------------------------------------------------
# Sampling: the target's distribution, exactly.

SAMPLE_VOCAB = 8  # EOS and the words 3 .. 7 can be generated
SAMPLES = 10000
FILTER = dict(temperature=0.7, top_k=5, top_p=0.95)


def _outputs_and_token_logprobs(model, params, source_1xS, budget):
  """Every output of at most `budget` tokens (PAD-padded tuples) and each of its tokens'
  log-probability under sample_decode's filtered distribution [outputs, budget]."""
  words = range(3, SAMPLE_VOCAB)
  outputs = [
    tuple(w) + (EOS_ID,) for n in range(budget) for w in itertools.product(words, repeat=n)
  ]
  outputs += list(itertools.product(words, repeat=budget))
  outputs = [o + (PAD_ID,) * (budget - len(o)) for o in outputs]
  targets = np.array(outputs, np.int32)
  decoder_input = np.concatenate([np.full((len(outputs), 1), BOS_ID), targets[:, :-1]], axis=1)
  logits = _forward(
    model, params, jnp.repeat(source_1xS, len(outputs), axis=0), jnp.asarray(decoder_input)
  )
  logprobs = decoding.Sampling(**FILTER).filtered_logprobs(logits)
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
  draft, draft_params = (
    target,
    jax.tree.map(lambda x: x + 0.1 * noise.normal(size=x.shape).astype(x.dtype), target_params),
  )
  source_1xS = jnp.array([[5, 1]], jnp.int32)
  extra = 1  # budget: 3 tokens
  outputs, target_logprobs = _outputs_and_token_logprobs(target, target_params, source_1xS, 3)
  exact = _distribution(outputs, target_logprobs)
  assert sum(exact.values()) == pytest.approx(1.0, abs=1e-4)
  source = jnp.repeat(source_1xS, SAMPLES, axis=0)
  out = translate(
    target,
    target_params,
    decoding.Speculative(draft, 2, decoding.Sampling(**FILTER)),
    draft_params,
    source=source,
    extra=extra,
    rng=jax.random.key(0),
  )
  assert 0.05 < acceptance_rate(out) < 0.95  # both branches of the rule are exercised
  # Sampling error alone gives TV ~ 0.011 here (57 possible outputs, 10^4 samples);
  # its spread is a few thousandths, so 0.03 never flakes.
  bound = 0.03
  assert _total_variation(_empirical(out.tokens_BxO), exact) < bound
  # Power: accepting every proposal would take the first token from the target (the
  # prefill) and the next two from the draft; that distribution is far off.
  _, draft_logprobs = _outputs_and_token_logprobs(draft, draft_params, source_1xS, 3)
  always_accept = _distribution(
    outputs, np.concatenate([target_logprobs[:, :1], draft_logprobs[:, 1:]], axis=1)
  )
  assert _total_variation(always_accept, exact) > 4 * bound  # 0.165


def test_speculative_greedy_of_one_sentence_at_a_time_equals_greedy():
  """One sentence at a time, as a user translating a line decodes: greedy's tokens."""
  target, target_params = make_model(2)
  draft, draft_params = make_model(9, num_layers=1)
  accepted = 0
  for row in range(SOURCE.shape[0]):
    source = SOURCE[row : row + 1]
    greedy = translate(target, target_params, decoding.Greedy(), source=source).tokens_BxO
    out = translate(
      target, target_params, decoding.Speculative(draft, 3), draft_params, source=source
    )
    np.testing.assert_array_equal(out.tokens_BxO, greedy)
    accepted += int(out.accepted)
  assert accepted > 0  # the rounds did keep draft tokens, not only the target's own


# ----------------------------------------------------------------------------------
# A shallow draft on the target's encoder output (transformer/model/draft.py).


def _shallow_draft(target_cfg, target_params, seed, shortlist=()):
  """A one-layer ShallowDraft holding the target's encoder and embedding, as training
  leaves it (transformer/training/draft.py copies them)."""
  from transformer.model.draft import ShallowDraft, draft_decoder_config

  draft = ShallowDraft(draft_decoder_config(target_cfg, 1), target_cfg, shortlist)
  shapes = jax.eval_shape(draft.init, jax.random.PRNGKey(0), SOURCE[:1], SOURCE[:1, :2])
  rng = np.random.default_rng(seed)
  params = jax.tree.map(
    lambda s: jnp.asarray(rng.normal(0, 1, s.shape), s.dtype), nn.unbox(shapes["params"])
  )
  return draft, {
    **params,
    "encoder": target_params["encoder"],
    "shared_embedding": target_params["shared_embedding"],
  }


def test_shallow_draft_speculative_greedy_equals_greedy_and_reads_the_targets_encoder():
  cfg = tiny_config(vocab_size=13, max_position=MAX_POSITION, num_layers=2, d_model=8)
  target_params = random_params(cfg, 2)
  target = Transformer(cfg)
  draft, draft_params = _shallow_draft(cfg, target_params, 5, shortlist=(1, 4, 5, 6, 7, 9))
  greedy = translate(target, target_params, decoding.Greedy()).tokens_BxO
  decode = lambda params: translate(target, target_params, decoding.Speculative(draft, 3), params)
  out = decode(draft_params)
  np.testing.assert_array_equal(out.tokens_BxO, greedy)
  assert 0.0 < acceptance_rate(out) < 1.0
  # The draft's own encoder copy is never run: spoiling it changes nothing.
  spoiled = {**draft_params, "encoder": jax.tree.map(jnp.zeros_like, draft_params["encoder"])}
  assert int(decode(spoiled).accepted) == int(out.accepted)


def test_shallow_draft_decodes_over_its_shortlist_and_trains_only_its_decoder():
  cfg = tiny_config(vocab_size=13, max_position=MAX_POSITION, num_layers=2, d_model=8)
  shortlist = (1, 4, 5, 9)
  draft, params = _shallow_draft(cfg, random_params(cfg, 2), 5, shortlist=shortlist)
  decoder_input = jnp.full((SOURCE.shape[0], 3), BOS_ID, jnp.int32)
  full_BxTxV = draft.apply({"params": params}, SOURCE, decoder_input)
  assert np.isfinite(np.asarray(full_BxTxV)).all()  # training scores every id
  encoded = draft.apply({"params": params}, SOURCE, method=draft.encode)
  cache = draft.apply(
    {"params": params},
    encoded,
    SOURCE,
    jnp.zeros((4, 8), jnp.int32),
    use_cache=True,
    mutable=["cache"],
    method=draft.decode,
  )[1]["cache"]
  logits_BxLxV = draft.apply(
    {"params": params, "cache": cache},
    None,
    SOURCE,
    decoder_input,
    use_cache=True,
    mutable=["cache"],
    method=draft.decode,
  )[0]
  finite_V = np.isfinite(np.asarray(logits_BxLxV)).all(axis=(0, 1))
  assert tuple(np.flatnonzero(finite_V)) == shortlist
  # Decoding scores the shortlist as training does.
  np.testing.assert_allclose(
    np.asarray(logits_BxLxV)[..., list(shortlist)],
    np.asarray(full_BxTxV)[..., list(shortlist)],
    rtol=1e-5,
    atol=1e-5,
  )

  def loss(p):
    return jnp.sum(jax.nn.log_softmax(draft.apply({"params": p}, SOURCE, decoder_input)) ** 2)

  grads = jax.grad(loss)(params)
  for frozen in ("encoder", "shared_embedding"):
    assert all(not np.asarray(g).any() for g in jax.tree.leaves(grads[frozen])), frozen
  assert any(np.asarray(g).any() for g in jax.tree.leaves(grads["decoder"]))
