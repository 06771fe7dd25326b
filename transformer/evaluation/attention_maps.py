"""Heatmaps of every attention head for one sentence and the model's own translation.

The sentence is translated (greedy or beam search), then the translation is fed back
teacher-forced so every attention module sows its weights [1, H, Lq, Lk]. One PNG per
layer and kind (encoder self-, decoder self-, decoder cross-attention), one panel per
head, axes labelled with subword pieces.

Decoder rows are labelled with the token each position predicts (the translation),
decoder self-attention columns with the decoder inputs (BOS, then the translation
shifted right).
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from transformer import storage
from transformer.config import BOS_ID, EOS_ID, PAD_ID
from transformer.model import decoding

# (file name prefix, stack, module name) for each attention kind.
ATTENTION_KINDS = (
  ("encoder_self_attention", "encoder", "self_attention"),
  ("decoder_self_attention", "decoder", "self_attention"),
  ("decoder_cross_attention", "decoder", "cross_attention"),
)


class Tokenizer(Protocol):
  def encode_for_model(self, texts: Sequence[str], max_len: int) -> list[np.ndarray]: ...

  def id_to_piece(self, token_id: int) -> str: ...


def translate(
  model,
  params,
  source_ids: Sequence[int],
  *,
  beam_size: int,
  alpha: float,
  max_decode_extra_len: int,
) -> list[int]:
  """One sentence -> its translation's ids, EOS included when the model produced one."""
  prompts = decoding.translation_prompts(
    jnp.asarray([source_ids], jnp.int32), max_decode_extra_len, model.config.decoder_only
  )
  search = decoding.BeamSearch(beam_size, alpha) if beam_size > 1 else decoding.Greedy()
  tokens_1xO = decoding.decode(model, params, prompts, search).tokens_BxO
  output = [int(t) for t in np.asarray(tokens_1xO)[0] if t != PAD_ID]
  return output[: output.index(EOS_ID) + 1] if EOS_ID in output else output


def attention_weights(
  model, params, source_ids: Sequence[int], target_ids: Sequence[int]
) -> dict[tuple[str, int, str], np.ndarray]:
  """Teacher-forced pass -> {(stack, layer, module): weights [H, Lq, Lk]}."""
  source_1xS = jnp.asarray([source_ids], jnp.int32)
  decoder_input_1xT = jnp.asarray([[BOS_ID] + list(target_ids[:-1])], jnp.int32)
  # Compiled: one compilation is quicker than dispatching the whole model op by op.
  forward = jax.jit(functools.partial(model.apply, mutable=["intermediates"]))
  _, state = forward({"params": params}, source_1xS, decoder_input_1xT)
  weights = {}
  for stack in ("encoder", "decoder"):
    for layer in range(model.config.num_layers):
      if model.config.scan_layers:  # one scanned module; its sown values gain a layer axis
        modules = jax.tree.map(lambda x, i=layer: x[i], state["intermediates"][stack]["layers"])
      else:
        modules = state["intermediates"][stack][f"layer_{layer}"]
      for name in ("self_attention", "cross_attention"):
        if name in modules:
          (weights_1xHxLxL,) = modules[name]["attention_weights"]
          weights[(stack, layer, name)] = np.asarray(weights_1xHxLxL[0])
  return weights


def _plot_heads(
  weights_HxTxS: np.ndarray,  # queries T, keys S (a self-attention's both its own)
  query_labels: Sequence[str],
  key_labels: Sequence[str],
  title: str,
  path: str,
) -> None:
  num_heads, num_queries, num_keys = weights_HxTxS.shape
  columns = min(num_heads, 4)
  rows = math.ceil(num_heads / columns)
  # Room for every label: about a fifth of an inch per token, at least 3 inches a panel.
  panel_w, panel_h = max(3.0, 0.2 * num_keys + 1.0), max(3.0, 0.2 * num_queries + 1.0)
  figure = Figure(figsize=(columns * panel_w, rows * panel_h + 0.6))
  FigureCanvasAgg(figure)  # raster output without touching pyplot's global backend
  figure.suptitle(title)
  for head in range(num_heads):
    axes = figure.add_subplot(rows, columns, head + 1)
    axes.imshow(weights_HxTxS[head], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    axes.set_title(f"head {head}", fontsize=9)
    axes.set_xticks(range(num_keys), key_labels, rotation=90, fontsize=7)
    axes.set_yticks(range(num_queries), query_labels, fontsize=7)
  figure.tight_layout()
  png = io.BytesIO()  # rendered in memory, then written whole: out_dir may be gs://
  figure.savefig(png, format="png", dpi=100)
  storage.write_bytes(path, png.getvalue())


def plot_attention_maps(
  model,
  params: Any,
  tokenizer: Tokenizer,
  source_text: str,
  out_dir: str,
  *,
  max_len: int,
  beam_size: int = 1,
  alpha: float = 0.6,
  max_decode_extra_len: int = 50,
) -> list[str]:
  """Translates `source_text` and writes one heatmap PNG per layer and attention kind.

  Args:
    max_len: source tokens kept, EOS included (the training maximum).
    beam_size: 1 decodes greedily; more uses beam search with length penalty `alpha`.

  Returns:
    The paths written, `<kind>_layer<i>.png` under `out_dir`, in layer order per kind.
  """
  if model.config.decoder_only:
    raise ValueError("attention maps need the encoder-decoder model (decoder_only=False)")
  source_ids = tokenizer.encode_for_model([source_text], max_len)[0].tolist()
  target_ids = translate(
    model,
    params,
    source_ids,
    beam_size=beam_size,
    alpha=alpha,
    max_decode_extra_len=max_decode_extra_len,
  )
  weights = attention_weights(model, params, source_ids, target_ids)

  piece = lambda ids: [tokenizer.id_to_piece(int(i)) for i in ids]
  source_pieces, target_pieces = piece(source_ids), piece(target_ids)
  decoder_input_pieces = piece([BOS_ID] + target_ids[:-1])
  labels = {  # (query labels, key labels) per kind
    "encoder_self_attention": (source_pieces, source_pieces),
    "decoder_self_attention": (target_pieces, decoder_input_pieces),
    "decoder_cross_attention": (target_pieces, source_pieces),
  }
  storage.makedirs(out_dir)
  written = []
  for kind, stack, module in ATTENTION_KINDS:
    for layer in range(model.config.num_layers):
      path = storage.join(out_dir, f"{kind}_layer{layer}.png")
      query_labels, key_labels = labels[kind]
      title = f"{kind.replace('_', ' ')}, layer {layer}"
      _plot_heads(weights[(stack, layer, module)], query_labels, key_labels, title, path)
      written.append(path)
  return written
