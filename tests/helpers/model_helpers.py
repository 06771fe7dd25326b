"""Shared pieces of the model tests: tiny configs, random tokens and parameters, packing.

Parameters are drawn with NumPy into the tree `init` would build (found with
`jax.eval_shape`, which compiles nothing): far cheaper than `init` on a CPU, and the
LayerNorm scales and biases are not their trivial initial values, so the comparisons
against `numpy_reference` exercise them.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.config import EOS_ID, PAD_ID
from transformer.model import ModelConfig, Transformer, stack_layer_params

BATCH, SOURCE_LEN, TARGET_LEN = 2, 7, 6
VOCAB, D_MODEL, NUM_HEADS, D_K, D_V, D_FF = 13, 8, 2, 4, 6, 12  # d_k != d_v on purpose
POSITIONAL_KINDS = ("sinusoidal", "learned", "rope")
# Every position kind with an encoder, and the decoder-only model with rope.
POSITION_VARIANTS = [
  pytest.param("sinusoidal", False, id="sinusoidal"),
  pytest.param("learned", False, id="learned"),
  pytest.param("rope", False, id="rope"),
  pytest.param("rope", True, id="rope-decoder_only"),
]


def tiny_config(**overrides) -> ModelConfig:
  fields = dict(
    vocab_size=VOCAB,
    max_position=16,
    num_layers=2,
    d_model=D_MODEL,
    d_ff=D_FF,
    num_heads=NUM_HEADS,
    d_k=D_K,
    d_v=D_V,
  )
  fields.update(overrides)
  return ModelConfig(**fields)


def random_tokens(seed: int, shape) -> jax.Array:
  """Ids in [1, VOCAB): never padding."""
  return jnp.asarray(np.random.default_rng(seed).integers(1, VOCAB, size=shape), jnp.int32)


def other_tokens(ids: jax.Array) -> jax.Array:
  """Different ids at every position, still in [1, VOCAB)."""
  return ids % (VOCAB - 1) + 1


def example_inputs(cfg: ModelConfig):
  source = None if cfg.decoder_only else random_tokens(0, (BATCH, SOURCE_LEN))
  return source, random_tokens(1, (BATCH, TARGET_LEN))


def abstract_variables(cfg: ModelConfig):
  """What `init` returns (boxed), as shapes and dtypes only."""
  return jax.eval_shape(Transformer(cfg).init, jax.random.key(0), *example_inputs(cfg))


def random_params(cfg: ModelConfig, seed: int = 0):
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    values = rng.normal(scale=0.3, size=leaf.shape)
    if path[-1].key == "scale":  # LayerNorm gains around 1
      values += 1.0
    return jnp.asarray(values, leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, nn.unbox(abstract_variables(cfg))["params"])


def run(cfg: ModelConfig, params, *args, **kwargs):
  return Transformer(cfg).apply({"params": params}, *args, **kwargs)


def boxed_params(variables) -> list[nn.LogicallyPartitioned]:
  return jax.tree_util.tree_leaves(
    variables["params"], is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
  )


def param_shapes(variables) -> dict[str, tuple[int, ...]]:
  """{"decoder/layer_0/ffn/wi/kernel": (D, F), ...}."""
  leaves = jax.tree_util.tree_leaves_with_path(nn.unbox(variables["params"]))
  return {"/".join(str(key.key) for key in path): leaf.shape for path, leaf in leaves}


def packed_batch(decoder_only: bool):
  """Row 0 packs two sentence pairs and ends in padding; row 1 holds one padded pair.

  Row 0: source segments [1 1 1 2 2 2 0], target segments [1 1 1 2 2 0]; positions
  restart at 0 in every segment.
  """
  source_segment_ids = jnp.array([[1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 0, 0]], jnp.int32)
  source_positions = jnp.array([[0, 1, 2, 0, 1, 2, 0], [0, 1, 2, 3, 4, 0, 0]], jnp.int32)
  target_segment_ids = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]], jnp.int32)
  target_positions = jnp.array([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]], jnp.int32)
  batch = dict(
    decoder_input=random_tokens(3, (BATCH, TARGET_LEN)),
    target_segment_ids=target_segment_ids,
    target_positions=target_positions,
  )
  if decoder_only:
    batch["source"] = None
  else:
    batch.update(
      source=random_tokens(2, (BATCH, SOURCE_LEN)),
      source_segment_ids=source_segment_ids,
      source_positions=source_positions,
    )
  return batch


# Random tiny models for decoding: a batch of sources whose rows end at different
# points, and models whose outputs differ from row to row.

# Sentences of 3, 1, 5 and 2 tokens (with EOS): budgets of 7, 5, 9 and 6 output tokens.
SOURCE = jnp.array([[4, 5, 1, 0, 0], [1, 0, 0, 0, 0], [5, 3, 4, 6, 1], [7, 1, 0, 0, 0]], jnp.int32)
EXTRA = 4
# As small as training configs make the learned position table (max_len + extra + 1):
# speculative rounds near the budget overrun it with draft tokens they never emit.
MAX_POSITION = SOURCE.shape[1] + EXTRA + 1


def make_model(
  seed,
  *,
  scan_layers=False,
  decoder_only=False,
  num_layers=2,
  d_model=8,
  vocab_size=13,
  positional=None,
  max_position=MAX_POSITION,
):
  """A tiny model with random weights far from init's near-uniform outputs.

  Untied embeddings: tied ones make random models repeat their input token forever.
  The same seed gives the same function scanned or not.
  """
  positional = positional or ("rope" if decoder_only else "sinusoidal")
  cfg = tiny_config(
    vocab_size=vocab_size,
    max_position=max_position,
    num_layers=num_layers,
    d_model=d_model,
    decoder_only=decoder_only,
    positional=positional,
    tie_embeddings=False,
  )
  params = random_params(cfg, seed)
  if scan_layers:
    cfg = dataclasses.replace(cfg, scan_layers=True)
    params = stack_layer_params(params, num_layers)
  return Transformer(cfg), params


def strip(tokens):
  """Token list up to and including the first EOS (or all of it)."""
  tokens = [int(t) for t in tokens if t != PAD_ID]
  return tokens[: tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


def acceptance_rate(out) -> float:
  """The share of a speculative decoding.Generation's draft tokens the target took."""
  return float(out.accepted) / max(int(out.proposed), 1)


def tokens_per_call(out) -> float:
  """Generated tokens per row per counted pass of a decoding.Generation: 1 for
  one-token searches, up to k + 1 (plus the prefill's share) for speculative decoding."""
  return float(np.sum(np.asarray(out.tokens_BxO) != PAD_ID)) / max(int(out.row_calls), 1)
