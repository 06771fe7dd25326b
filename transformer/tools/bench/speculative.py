"""bench's speculative: speculative against plain greedy decoding, on trained runs.

The target (`workdir`, trained with bench's --config) and the draft (`draft_workdir`,
e.g. configs/default.py:shallow_draft), restored as eval.py --draft_workdir restores
them. The first `num_sentences` sentences of the test split, in order, at each of
`batch_sizes` (bench's default 1 and 32: one sentence at a time, what a user
translating a line waits for, and batched throughput), decoded by cached greedy
decoding (decoding.Greedy) and by speculative greedy decoding with `draft_len` draft
tokens per target pass, alternating which of the two goes first on each batch, after an
untimed pass that compiles every batch shape. The tokens must be identical. Reports ms
per sentence of each, the speed-up, the acceptance rate a, the measured cost c of a
draft pass relative to a target pass at that batch (and of the (k + 1)-token check), and
the speed-up (1 - a^(k+1)) / ((1 - a)(k c + 1)) they predict.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer import config as config_lib
from transformer.config import BOS_ID
from transformer.inference import sharding
from transformer.model import decoding, incremental
from transformer.model.decoding import speculative as speculative_lib


def _count(params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def _timed(decode, source) -> tuple[Any, float]:
  """(decode(source), its wall seconds), synchronized."""
  start = time.perf_counter()
  out = jax.block_until_ready(decode(source))
  return out, time.perf_counter() - start


@functools.partial(jax.jit, static_argnames=("model", "calls"))
def _cached_passes(model, params, state, tokens_BxL, position, *, calls: int):
  """`calls` cached passes of L tokens per row, each written at `position` (a scalar, as
  greedy decoding writes, or one per row [B], as speculative decoding does), each fed
  the argmax of the last, so none can be skipped."""

  def body(_, carry):
    state, tokens_BxL = carry
    logits_BxLxV, state = model.feed(params, state, tokens_BxL, position)
    return state, jnp.argmax(logits_BxLxV, axis=-1).astype(jnp.int32)

  return jax.lax.fori_loop(0, calls, body, (state, tokens_BxL))[1]


def _pass_costs(
  target, draft, source_BxS, draft_len: int, extra: int, calls: int = 32, repeats: int = 5
) -> dict[str, float]:
  """Seconds per cached pass at this batch, medians of `repeats` interleaved runs of
  `calls` passes: the target's one-token pass as greedy decoding makes it, the draft's
  one-token pass and the target's (k + 1)-token check as speculative decoding makes them."""
  batch = source_BxS.shape[0]
  bos_Bx1 = jnp.full((batch, 1), BOS_ID, jnp.int32)
  cache_len = source_BxS.shape[1] + extra + draft_len + 1
  row_position_B = jnp.ones((batch,), jnp.int32)  # speculative decoding's, one per row
  prefill = jax.jit(incremental.IncrementalModel.prefill, static_argnames=("self", "cache_len"))
  target_model, target_params = incremental.of(target.model).prepare(target.params)
  draft_model, draft_params = incremental.of(draft.model).prepare(draft.params)
  encoded_BxSxD = prefill(
    target_model, target_params, bos_Bx1, cache_len=cache_len, source_BxS=source_BxS
  ).encoded_BxSxD
  shared = encoded_BxSxD if decoding.reads_target_encoding(draft.model) else None
  runs = {}
  for name, model, params, tokens in (
    ("target", target_model, target_params, 1),
    ("draft", draft_model, draft_params, 1),
    ("check", target_model, target_params, draft_len + 1),
  ):
    state = prefill(
      model,
      params,
      bos_Bx1,
      cache_len=cache_len,
      source_BxS=source_BxS,
      encoded_BxSxD=shared if name == "draft" else None,
    ).state
    position = jnp.array(1, jnp.int32) if name == "target" else row_position_B
    state = model.set_positions(state, position)  # the loop carries its kind
    tokens_BxL = jnp.full((batch, tokens), 5, jnp.int32)
    runs[name] = functools.partial(
      _cached_passes, model, params, state, tokens_BxL, position, calls=calls
    )
    jax.block_until_ready(runs[name]())  # compiles
  seconds: dict[str, list[float]] = {name: [] for name in runs}
  for _ in range(repeats):
    for name, run in runs.items():
      seconds[name].append(_timed(lambda _, run=run: run(), None)[1] / calls)
  return {name: statistics.median(times) for name, times in seconds.items()}


def measure(
  config,
  workdir: str,
  draft_workdir: str,
  draft_len: int,
  num_sentences: int,
  batch_sizes: list[int],
) -> list[dict[str, Any]]:
  """Cached greedy against speculative greedy decoding of the test split's first
  sentences, on the restored target and draft, at each batch size (see the module
  docstring): one record per batch size."""
  # Imported here: restoring runs needs the evaluation and checkpoint code only.
  from transformer import data
  from transformer.evaluation import translate

  # Restored as eval.py --draft_workdir restores them: the vocabularies are checked to be
  # identical and the draft is placed on the target's mesh before anything compiles.
  target = translate.Translator(
    config,
    workdir,
    draft_workdir=draft_workdir,
    settings=translate.SearchSettings(kind="greedy", draft_len=draft_len),
  )
  lines = [source for source, _ in data.load_raw_pairs(config, "test")[:num_sentences]]
  if not lines:
    raise config_lib.ConfigError(f"config.dataset: {config.dataset} has no test sentences")
  row_shards = sharding.batch_row_shards(target.mesh, target.rules)
  if any(rows % row_shards for rows in batch_sizes):
    raise config_lib.ConfigError(
      f"--speculative_batch_sizes: each must split over the "
      f"{row_shards} devices a batch's rows are spread over"
    )
  results = []
  with sharding.activation_sharding(target.mesh, target.rules):
    for rows in batch_sizes:
      sources = []
      for start in range(0, len(lines), rows):  # as eval.py batches: in order, padded rows
        ids = target.tokenizer.encode_for_model(lines[start : start + rows], config.max_len)
        sources.append(
          sharding.global_batch_from_whole(
            {"source": data.pad_batch(ids, rows=rows)}, target.mesh, target.rules
          )["source"]
        )
      results.append(_compare_at_batch(config, target, sources, len(lines), draft_len))
  return results


def _identical_outputs(outputs: dict[str, list[Any]], num_lines: int) -> tuple[int, int]:
  """(tokens generated, greedy's target passes) over the batches, once speculative
  decoding is checked to give greedy's tokens on every sentence."""
  # Only the last batch has fill rows: the first num_lines rows hold the sentences.
  differ, generated, greedy_passes = 0, 0, 0
  for b, (plain, spec) in enumerate(zip(outputs["greedy"], outputs["speculative"])):
    rows = np.asarray(plain).shape[0]
    real = np.arange(rows) < num_lines - b * rows
    fast = np.asarray(spec.tokens_BxO)
    differ += int(np.sum(np.any(np.asarray(plain) != fast, axis=1) & real))
    generated += int(np.sum((fast != config_lib.PAD_ID) & real[:, None]))
    # Greedy decoding runs one target pass per token until every row (fill rows too)
    # is done: as many passes as the batch's longest output.
    greedy_passes += int(np.max(np.sum(np.asarray(plain) != config_lib.PAD_ID, axis=1)))
  if differ:
    raise RuntimeError(
      f"speculative greedy decoding differs from greedy decoding on "
      f"{differ} of {num_lines} sentences at batch {rows}"
    )
  return generated, greedy_passes


def _alternating_timings(
  decoders: dict[str, Callable[[Any], Any]], sources: list
) -> tuple[dict[str, float], dict[str, float], dict[str, list[Any]]]:
  """(untimed first pass's seconds, timed seconds, outputs on the host) of each decoder
  over the same batches. The first pass compiles every batch shape; then the decoders
  take turns going first on each batch, so a change in the machine's load falls on all."""
  compile_s = {
    name: sum(_timed(decode, source)[1] for source in sources) for name, decode in decoders.items()
  }
  seconds = {name: 0.0 for name in decoders}
  outputs: dict[str, list[Any]] = {name: [] for name in decoders}
  names = list(decoders)
  for b, source in enumerate(sources):
    for name in names if b % 2 == 0 else names[::-1]:
      out, elapsed = _timed(decoders[name], source)
      seconds[name] += elapsed
      outputs[name].append(jax.device_get(out))
  return compile_s, seconds, outputs


def _decoders(target, draft, extra: int, draft_len: int) -> dict[str, Callable]:
  """{"greedy": ..., "speculative": ...}: each decodes a source batch [B, S] with `target`."""
  prompts = lambda source: decoding.translation_prompts(source, extra, False)
  return {
    "greedy": lambda source: (
      decoding.decode(target.model, target.params, prompts(source), decoding.Greedy()).tokens_BxO
    ),
    "speculative": lambda source: decoding.decode(
      target.model,
      target.params,
      prompts(source),
      decoding.Speculative(draft.model, draft_len, draft_params=draft.params),
    ),
  }


def _speculation_counts(spec_out: list, greedy_passes: int) -> dict[str, Any]:
  """What speculation proposed, accepted and cost in target passes, over the batches'
  speculative outputs (one decoding.Generation per batch)."""
  proposed = sum(int(o.proposed) for o in spec_out)
  accepted = sum(int(o.accepted) for o in spec_out)
  target_calls = sum(int(o.calls) for o in spec_out)
  return {
    "acceptance_rate": accepted / max(proposed, 1),
    "proposed": proposed,
    "accepted": accepted,
    "target_calls": target_calls,
    # Whole-batch passes of the target, the first token's included (speculative: the
    # prefill, uncounted in target_calls; greedy: its first step). Their ratio is what
    # speculation saves in target passes; the speed-up is what it saves in time.
    "target_passes_greedy": greedy_passes,
    "target_passes_speculative": target_calls + len(spec_out),
    "target_pass_reduction": greedy_passes / (target_calls + len(spec_out)),
    # As decoding.Generation and eval.py count it: tokens per sentence per target pass
    # (at most k + 1, plus the first token, which the uncounted prefill yields).
    "tokens_per_target_call": sum(
      int(np.sum(np.asarray(o.tokens_BxO) != config_lib.PAD_ID)) for o in spec_out
    )
    / max(sum(int(o.row_calls) for o in spec_out), 1),
  }


def _compare_at_batch(
  config, target, sources: list, num_lines: int, draft_len: int
) -> dict[str, Any]:
  """Greedy and speculative decoding of the same batches, alternating which goes first
  on each batch (so a change in the machine's load falls on both), after an untimed
  pass that compiles every batch shape."""
  draft, extra, rows = target.draft, config.max_decode_extra_len, sources[0].shape[0]
  assert draft is not None  # a draft_workdir always gives the translator one
  decoders = _decoders(target, draft, extra, draft_len)
  compile_s, seconds, outputs = _alternating_timings(decoders, sources)
  generated, greedy_passes = _identical_outputs(outputs, num_lines)
  counts = _speculation_counts(outputs["speculative"], greedy_passes)
  acceptance, target_calls = counts["acceptance_rate"], counts["target_calls"]
  passes = _pass_costs(target, draft, sources[0], draft_len, extra)
  draft_cost = passes["draft"] / passes["target"]
  greedy_s, spec_s = seconds["greedy"], seconds["speculative"]
  return {
    "name": "speculative",
    "sentences": num_lines,
    "batch_size": rows,
    "draft_len": draft_len,
    "target_params": _count(target.params),
    "draft_params": _count(draft.params),
    "draft_kind": type(draft.model).__name__,
    **counts,
    "generated_tokens": generated,
    # The untimed first passes: compiling every batch shape, plus one run.
    "greedy_compile_s": compile_s["greedy"],
    "speculative_compile_s": compile_s["speculative"],
    "greedy_s": greedy_s,
    "speculative_s": spec_s,
    "greedy_ms_per_sentence": 1e3 * greedy_s / num_lines,
    "speculative_ms_per_sentence": 1e3 * spec_s / num_lines,
    "greedy_sentences_per_sec": num_lines / greedy_s,
    "speculative_sentences_per_sec": num_lines / spec_s,
    "speedup": greedy_s / spec_s,
    # Seconds per cached pass at this batch (_pass_costs): c, the draft's one-token
    # pass over the target's, and the (k + 1)-token check over a one-token pass.
    "target_pass_s": passes["target"],
    "draft_pass_s": passes["draft"],
    "check_pass_s": passes["check"],
    "draft_cost_ratio": draft_cost,
    "check_cost_ratio": passes["check"] / passes["target"],
    "expected_speedup": speculative_lib.expected_speedup(acceptance, draft_len, draft_cost),
    "tokens_per_sec": generated / spec_s,
    "step_time_s": spec_s / max(target_calls, 1),
    "mfu": None,
  }


def describe(result: dict[str, Any]) -> str:
  return (
    f"speculative: {result['sentences']} test sentences at batch "
    f"{result['batch_size']}, k={result['draft_len']}, acceptance "
    f"{100 * result['acceptance_rate']:.1f}%, "
    f"{result['tokens_per_target_call']:.2f} tokens per sentence per target call, "
    f"{result['target_pass_reduction']:.2f}x fewer target passes; greedy "
    f"{result['greedy_ms_per_sentence']:,.2f} ms/sentence, speculative "
    f"{result['speculative_ms_per_sentence']:,.2f} ms/sentence (identical tokens), "
    f"speed-up {result['speedup']:.2f}x; pass cost: draft/target c = "
    f"{result['draft_cost_ratio']:.2f}, (k + 1)-token check/target "
    f"{result['check_cost_ratio']:.2f}; expected (1 - a^(k+1)) / ((1 - a)(k c + 1)) "
    f"= {result['expected_speedup']:.2f}x"
  )
