"""Beam search speed with and without the decoding cache, on random weights.

    python -m transformer.tools.decoding_speed            # configs/default.py's model, beam 4
    python -m transformer.tools.decoding_speed --batch 8 --steps 32

Every sentence runs exactly `--steps` decoding steps (early stopping off and the length
budget set to match), so both paths do the same search and only the per-step cost
differs. Compilation is timed apart from the run. docs/decoding.md records the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer import config as config_lib
from transformer import host_memory
from transformer.config import EOS_ID
from transformer.model import decoding
from transformer.training import state


def time_beam_search(
  model, params, source_BxS, *, beam_size: int, steps: int, use_cache: bool, repeats: int = 1
) -> dict[str, float]:
  """Compiles, runs once untimed (first-call allocations), then times `repeats` runs;
  returns the median run's seconds and rates."""
  prompts = decoding.translation_prompts(
    source_BxS, steps - source_BxS.shape[1], model.config.decoder_only
  )
  search = decoding.BeamSearch(beam_size, alpha=0.6, early_stop=False)
  start = time.perf_counter()
  compiled = decoding.decode.lower(model, params, prompts, search, use_cache=use_cache).compile()
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
  model = state.build_model(config)
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
