"""Beam search speed with and without the decoding cache, on random weights.

    python -m transformer.tools.decoding_speed            # configs/default.py's model, beam 4
    python -m transformer.tools.decoding_speed --batch 8 --steps 32

Every sentence runs exactly `--steps` decoding steps (early stopping off and the length
budget set to match), so both paths do the same search and only the per-step cost
differs. Compilation is timed apart from the run. docs/decoding.md records the figures.

Without the cache is `Recomputing`: the model's incremental side
(transformer/model/incremental.py) keeping no K/V, every call rerunning the decoder over
all the tokens fed so far. It is also the reference the cache is tested against.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer import config as config_lib
from transformer import host_memory
from transformer.config import EOS_ID
from transformer.inference import model_setup
from transformer.model import decoding, incremental
from transformer.model.primitives import Array


class RecomputedState(NamedTuple):
  tokens_NxC: Array  # every token fed so far, each at its slot
  position: Array  # int32: the next slot, a scalar or one per row [N]
  source_NxS: Array | None  # each row's encoder input
  encoded_BxSxD: Array | None  # the encoder output, one per sentence


@dataclasses.dataclass(frozen=True)
class Recomputing(incremental.IncrementalModel):
  """Decoding without K/V: the state holds the tokens fed so far, and every `feed` writes
  the new ones into it and reruns the whole decoder over all C slots (causal masking keeps
  the later ones out), cross-attention projections included."""

  def prepare(self, params) -> tuple[Recomputing, Any]:
    return self, params  # no cache: a scanned stack reruns as it is

  def prefill(
    self, params, prompt_BxP, *, cache_len, source_BxS=None, encoded_BxSxD=None
  ) -> incremental.Prefilled:
    if encoded_BxSxD is None and source_BxS is not None:
      encoded_BxSxD = self.model.apply({"params": params}, source_BxS, method=self.model.encode)
    batch = prompt_BxP.shape[0]
    tokens_NxC = jnp.zeros((batch, cache_len), jnp.int32)
    start = RecomputedState(tokens_NxC, jnp.zeros((), jnp.int32), source_BxS, encoded_BxSxD)
    prompt_len_B = jnp.sum(prompt_BxP != config_lib.PAD_ID, axis=1).astype(jnp.int32)
    if prompt_BxP.shape[1] == 1:
      prompt_len_B = jnp.ones((batch,), jnp.int32)
    logits_BxPxV, recomputed = self.feed(params, start, prompt_BxP)
    logits_BxV = jnp.take_along_axis(logits_BxPxV, (prompt_len_B - 1)[:, None, None], axis=1)
    if prompt_BxP.shape[1] > 1:
      recomputed = self.set_positions(recomputed, prompt_len_B)
    return incremental.Prefilled(recomputed, logits_BxV[:, 0], prompt_len_B, encoded_BxSxD)

  def feed(self, params, recomputed, tokens_NxL, position_N=None):
    if position_N is not None:
      recomputed = self.set_positions(recomputed, position_N)
    rows, length = tokens_NxL.shape
    position_N = jnp.broadcast_to(recomputed.position, (rows,))
    tokens_NxC = jax.vmap(
      lambda row_C, new_L, at: jax.lax.dynamic_update_slice(row_C, new_L, (at,))
    )(recomputed.tokens_NxC, tokens_NxL, position_N)
    encoded = recomputed.encoded_BxSxD
    if encoded is not None:  # one per sentence: repeated for its rows
      encoded = jnp.repeat(encoded, rows // encoded.shape[0], axis=0)
    logits_NxCxV = self.model.apply(
      {"params": params}, encoded, recomputed.source_NxS, tokens_NxC, method=self.model.decode
    )
    at_NxL = position_N[:, None] + jnp.arange(length)
    logits_NxLxV = jnp.take_along_axis(logits_NxCxV, at_NxL[:, :, None], axis=1)
    return logits_NxLxV, recomputed._replace(
      tokens_NxC=tokens_NxC, position=recomputed.position + length
    )

  def set_positions(self, recomputed, position_N):
    return recomputed._replace(position=jnp.asarray(position_N, jnp.int32))

  def repeat_rows(self, recomputed, copies):
    """Tokens, per-row positions and the source repeated; the encoder output stays one
    per sentence (`feed` repeats it for the rows)."""
    per_row = lambda x: x if x is None or x.ndim == 0 else jnp.repeat(x, copies, axis=0)
    return recomputed._replace(
      tokens_NxC=per_row(recomputed.tokens_NxC),
      position=per_row(recomputed.position),
      source_NxS=per_row(recomputed.source_NxS),
    )

  def reorder_rows(self, recomputed, row_N):
    """Row n becomes row row_N[n] of the same sentence: the source stays."""
    per_row = lambda x: x if x.ndim == 0 else jnp.take(x, row_N, axis=0)
    return recomputed._replace(
      tokens_NxC=per_row(recomputed.tokens_NxC), position=per_row(recomputed.position)
    )

  def grow(self, recomputed, cache_len):
    slots = cache_len - recomputed.tokens_NxC.shape[1]
    return recomputed._replace(tokens_NxC=jnp.pad(recomputed.tokens_NxC, ((0, 0), (0, slots))))


def time_beam_search(
  model, params, source_BxS, *, beam_size: int, steps: int, use_cache: bool, repeats: int = 1
) -> dict[str, float]:
  """Compiles, runs once untimed (first-call allocations), then times `repeats` runs;
  returns the median run's seconds and rates."""
  prompts = decoding.translation_prompts(
    source_BxS, steps - source_BxS.shape[1], model.config.decoder_only
  )
  search = decoding.BeamSearch(beam_size, alpha=0.6, early_stop=False)
  if not use_cache:
    model = Recomputing(model)
  start = time.perf_counter()
  compiled = decoding.compile_decode(model, params, prompts, search)
  compile_s = time.perf_counter() - start

  jax.block_until_ready(compiled(params, prompts))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(params, prompts))
    times.append(time.perf_counter() - start)
  run_s = statistics.median(times)
  ran = int(out.calls) + 1  # the prefill's logits give the first token
  if ran != steps:  # early stopping is off: every sentence runs all steps
    raise RuntimeError(f"beam search ran {ran} steps, expected {steps}")
  sentences = source_BxS.shape[0]
  return dict(
    compile_s=compile_s,
    run_s=run_s,
    sentences_per_s=sentences / run_s,
    tokens_per_s=sentences * steps / run_s,
    hypothesis_tokens_per_s=sentences * beam_size * steps / run_s,
  )


def main():
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  parser.add_argument("--batch", type=int, default=32, help="sentences per batch")
  parser.add_argument("--source_len", type=int, default=20, help="source tokens, EOS included")
  parser.add_argument("--steps", type=int, default=64, help="decoding steps (output tokens)")
  parser.add_argument("--beam_size", type=int, default=4, help="beams per sentence")
  args = parser.parse_args()
  if args.steps <= args.source_len:
    parser.error("--steps must exceed --source_len: the budget is source length + extra")

  config = config_lib.load_config(config_lib.DEFAULT_CONFIG)
  model = model_setup.build_model(config)
  rng_init, rng_source = jax.random.split(jax.random.PRNGKey(0))
  source_BxS = (
    jax.random.randint(rng_source, (args.batch, args.source_len), 4, config.vocab_size, jnp.int32)
    .at[:, -1]
    .set(EOS_ID)
  )
  params = nn.unbox(jax.jit(model.init)(rng_init, source_BxS[:1], source_BxS[:1, :2])["params"])
  mc = model.config
  print(
    f"{jax.devices()[0].device_kind}: {mc.num_layers} layers, d_model {mc.d_model}, "
    f"d_ff {mc.d_ff}, {mc.num_heads} heads, vocab {mc.vocab_size}; {args.batch} sentences "
    f"of {args.source_len} source tokens, beam {args.beam_size}, {args.steps} steps"
  )

  results = {}
  for use_cache in (True, False):
    r = time_beam_search(
      model, params, source_BxS, beam_size=args.beam_size, steps=args.steps, use_cache=use_cache
    )
    results[use_cache] = r
    print(
      f"{'with' if use_cache else 'without'} cache: {r['run_s']:.2f} s "
      f"(compile {r['compile_s']:.1f} s), {r['sentences_per_s']:.2f} sentences/s, "
      f"{r['tokens_per_s']:.0f} output tokens/s, "
      f"{r['hypothesis_tokens_per_s']:.0f} hypothesis tokens/s"
    )
  print(f"speed-up from the cache: {results[False]['run_s'] / results[True]['run_s']:.1f}x")


if __name__ == "__main__":
  host_memory.retain_freed_memory()  # a command's setting, before JAX starts (host_memory.py)
  main()
