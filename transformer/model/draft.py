"""A draft model for speculative decoding that reads the target's encoder output.

"Deep encoder, shallow decoder" (Kasai et al. 2021): the target's encoder does the
source's work once per sentence, and the draft is only a shallow decoder (one layer by
default) that proposes tokens from that encoder output. `ShallowDraft` holds the
target's encoder and tied embedding (copied from the target run when its training
starts, transformer/training/draft.py) and its own decoder layers. Both copied parts
are frozen: their gradients are stopped, so Adam (without weight decay, which
validation enforces) leaves them exactly as the target has them. Speculative decoding
never runs the draft's encoder: it hands the draft the target's encoder output
(`reads_target_encoding`, transformer/model/decoding/speculative.py), so a draft pass
costs only its decoder layers and output projection.

The output projection is the target's tied embedding. With `shortlist` (token ids,
most frequent first) the draft scores only those ids when it decodes (whenever the
cache is mutable); every other id gets -inf, so at batch 1, where the projection's
[V, D] read dominates a one-layer step, a draft pass reads len(shortlist) rows of it
instead of V. Training and validation score the whole vocabulary, so the loss and
perplexity are the usual ones. The shortlist only changes what the draft can propose:
the speculative output is the target's either way.

Shape letters follow transformer/model/primitives.py; Z is the shortlist's length.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.model.layers import tied_projection
from transformer.model.primitives import (
  Array,
  ModelConfig,
  default_positions,
  segment_ids_from_tokens,
)
from transformer.model.transformer import Decoder, Encoder, Transformer


class FrozenEmbed(nn.Module):
  """The target's tied embedding, read with its gradient stopped (it is never trained).

  `attend` scores the whole vocabulary, or while decoding only the `shortlist` ids,
  scattered back to [.., V] with -inf elsewhere, so every search reads it as logits.
  """

  config: ModelConfig
  shortlist: tuple[int, ...] = ()

  def setup(self):
    cfg = self.config
    # The name and initializer of layers.Embed's table: the target's checkpoint fits.
    self.embedding = self.param(
      "embedding",
      nn.with_logical_partitioning(
        nn.initializers.normal(stddev=cfg.d_model**-0.5), ("vocab", "embed")
      ),
      (cfg.vocab_size, cfg.d_model),
      cfg.param_dtype,
    )

  def _table_VxD(self) -> Array:
    return jax.lax.stop_gradient(jnp.asarray(self.embedding, self.config.dtype))

  def __call__(self, ids_BxL: Array) -> Array:
    return jnp.take(self._table_VxD(), ids_BxL, axis=0)

  def output_table(self) -> Array:
    return self._table_VxD()

  def attend(self, x_BxLxD: Array) -> Array:
    batch, length, d_model = x_BxLxD.shape
    x_BLxD = x_BxLxD.reshape(batch * length, d_model).astype(self.config.dtype)
    if not self.shortlist or not self.is_mutable_collection("cache"):
      return tied_projection(x_BLxD, self._table_VxD()).reshape(batch, length, -1)
    ids_Z = jnp.array(self.shortlist, jnp.int32)
    short_logits_BLxZ = tied_projection(x_BLxD, jnp.take(self._table_VxD(), ids_Z, axis=0))
    logits_BLxV = jnp.full((batch * length, self.config.vocab_size), -jnp.inf, jnp.float32)
    return logits_BLxV.at[:, ids_Z].set(short_logits_BLxZ).reshape(batch, length, -1)


def draft_decoder_config(target: ModelConfig, num_layers: int, d_ff: int = 0) -> ModelConfig:
  """The draft decoder's config: the target's widths, `num_layers` layers, and d_ff
  (0: the target's)."""
  return dataclasses.replace(target, num_layers=num_layers, d_ff=d_ff or target.d_ff)


class ShallowDraft(Transformer):
  """The target's frozen encoder and embedding, and a shallow decoder of its own.

  A Transformer whose parts come from two configs: `config` is the draft decoder's (its
  num_layers and d_ff), `target_config` the target's, whose encoder this reads. Only
  `setup` and `encode` are its own; `decode` and `__call__` are Transformer's, so it
  trains with train.py's steps and decodes, through transformer/model/incremental.py,
  with every search.
  """

  target_config: ModelConfig
  shortlist: tuple[int, ...] = ()

  # Speculative decoding hands this draft the target's encoder output
  # (transformer/model/decoding/speculative.py).
  reads_target_encoding = True

  def setup(self):
    self.shared_embedding = FrozenEmbed(self.target_config, self.shortlist)
    self.encoder = Encoder(self.target_config, self.shared_embedding)
    self.decoder = Decoder(self.config, self.shared_embedding)

  def encode(
    self,
    source_BxS: Array,
    source_segment_ids: Array | None = None,
    source_positions: Array | None = None,
    deterministic: bool = True,
  ) -> Array:
    """The target's encoder output [B, S, D], gradient stopped, and never with dropout
    (`deterministic` is ignored): the draft learns to read the encoder output decoding
    will give it."""
    if source_segment_ids is None:
      source_segment_ids = segment_ids_from_tokens(source_BxS)
    if source_positions is None:
      source_positions = default_positions(source_BxS)
    return jax.lax.stop_gradient(
      self.encoder(source_BxS, source_segment_ids, source_positions, True)
    )
