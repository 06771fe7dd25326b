"""The Transformer's forward pass in float64 NumPy, written from the paper's equations.

It shares no code with `transformer/model.py`: only the parameter tree's layout, so the
two can be compared number for number. Covers what the paper describes (sinusoidal
positions, ReLU feed-forward, tied embeddings) plus the pre-LN variant.

  Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V
  MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O
  head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)
  FFN(x) = max(0, x W_1 + b_1) W_2 + b_2
  post-LN sublayer: LayerNorm(x + Sublayer(x));  pre-LN: x + Sublayer(LayerNorm(x))
  PE(pos, 2i) = sin(pos / 10000^(2i/d_model)),  PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model))
"""

from __future__ import annotations

import numpy as np


def to_float64(tree):
  """A nested dict of arrays, as float64 NumPy arrays."""
  if isinstance(tree, dict):
    return {name: to_float64(value) for name, value in tree.items()}
  return np.asarray(tree, np.float64)


def sinusoidal_table(length: int, d_model: int) -> np.ndarray:
  table = np.zeros((length, d_model))
  for pos in range(length):
    for i in range(d_model // 2):
      angle = pos / 10000.0 ** (2 * i / d_model)
      table[pos, 2 * i] = np.sin(angle)
      table[pos, 2 * i + 1] = np.cos(angle)
  return table


def layer_norm(x, norm_params, epsilon):
  mean = x.mean(-1, keepdims=True)
  variance = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(variance + epsilon) * norm_params["scale"] + norm_params["bias"]


def scaled_dot_product_attention(q_LxK, k_SxK, v_SxE, allowed_LxS):
  """Masked positions get -inf; a query with no allowed key gets a zero output."""
  scores_LxS = q_LxK @ k_SxK.T / np.sqrt(q_LxK.shape[-1])
  scores_LxS = np.where(allowed_LxS, scores_LxS, -np.inf)
  row_max = np.max(scores_LxS, axis=-1, keepdims=True)
  row_max = np.where(np.isfinite(row_max), row_max, 0.0)
  weights_LxS = np.exp(scores_LxS - row_max)
  total = weights_LxS.sum(-1, keepdims=True)
  weights_LxS = np.divide(weights_LxS, total, out=np.zeros_like(weights_LxS), where=total > 0)
  return weights_LxS @ v_SxE


def multi_head_attention(
  x_LxD, memory_SxD, allowed_LxS, w_q_DxHxK, w_k_DxHxK, w_v_DxHxE, w_o_HxExD
):
  num_heads, d_v, d_model = w_o_HxExD.shape
  heads = [
    scaled_dot_product_attention(
      x_LxD @ w_q_DxHxK[:, i],
      memory_SxD @ w_k_DxHxK[:, i],
      memory_SxD @ w_v_DxHxE[:, i],
      allowed_LxS,
    )
    for i in range(num_heads)
  ]
  return np.concatenate(heads, axis=-1) @ w_o_HxExD.reshape(num_heads * d_v, d_model)


def self_attention(x_LxD, allowed_LxL, attention_params, d_k):
  qkv_DxHx2KE = attention_params["qkv"]["kernel"]
  w_q, w_k, w_v = (
    qkv_DxHx2KE[..., :d_k],
    qkv_DxHx2KE[..., d_k : 2 * d_k],
    qkv_DxHx2KE[..., 2 * d_k :],
  )
  return multi_head_attention(
    x_LxD, x_LxD, allowed_LxL, w_q, w_k, w_v, attention_params["out"]["kernel"]
  )


def cross_attention(y_TxD, memory_SxD, allowed_TxS, attention_params, d_k):
  kv_DxHxKE = attention_params["kv"]["kernel"]
  return multi_head_attention(
    y_TxD,
    memory_SxD,
    allowed_TxS,
    attention_params["query"]["kernel"],
    kv_DxHxKE[..., :d_k],
    kv_DxHxKE[..., d_k:],
    attention_params["out"]["kernel"],
  )


def feed_forward(x_LxD, ffn_params):
  hidden = np.maximum(0.0, x_LxD @ ffn_params["wi"]["kernel"] + ffn_params["wi"]["bias"])
  return hidden @ ffn_params["wo"]["kernel"] + ffn_params["wo"]["bias"]


def residual(x, sublayer, norm_params, norm, epsilon):
  if norm == "pre":
    return x + sublayer(layer_norm(x, norm_params, epsilon))
  return layer_norm(x + sublayer(x), norm_params, epsilon)


def embed(ids_L, embedding_VxD):
  d_model = embedding_VxD.shape[1]
  return embedding_VxD[ids_L] * np.sqrt(d_model) + sinusoidal_table(len(ids_L), d_model)


def encoder(params, source_S, cfg):
  """One sentence; id 0 is padding. Returns the final encoder output [S, D]."""
  eps = cfg.layer_norm_epsilon
  is_real_S = source_S != 0
  allowed_SxS = np.broadcast_to(is_real_S[None, :], (len(source_S), len(source_S)))
  x = embed(source_S, params["shared_embedding"]["embedding"])
  for i in range(cfg.num_layers):
    layer = params["encoder"][f"layer_{i}"]
    x = residual(
      x,
      lambda z, layer=layer: self_attention(z, allowed_SxS, layer["self_attention"], cfg.d_k),
      layer["attention_block"]["norm"],
      cfg.norm,
      eps,
    )
    x = residual(
      x,
      lambda z, layer=layer: feed_forward(z, layer["ffn"]),
      layer["ffn_block"]["norm"],
      cfg.norm,
      eps,
    )
  if cfg.norm == "pre":
    x = layer_norm(x, params["encoder"]["final_norm"], eps)
  return x


def decoder(params, decoder_input_T, memory_SxD, source_S, cfg):
  """One sentence: causal self-attention, cross-attention to `memory`, tied output.

  Returns logits [T, V] = y @ E^T.
  """
  eps = cfg.layer_norm_epsilon
  target_len = len(decoder_input_T)
  causal_TxT = np.tril(np.ones((target_len, target_len), bool))
  source_real_TxS = np.broadcast_to((source_S != 0)[None, :], (target_len, len(source_S)))
  embedding_VxD = params["shared_embedding"]["embedding"]
  y = embed(decoder_input_T, embedding_VxD)
  for i in range(cfg.num_layers):
    layer = params["decoder"][f"layer_{i}"]
    y = residual(
      y,
      lambda z, layer=layer: self_attention(z, causal_TxT, layer["self_attention"], cfg.d_k),
      layer["self_attention_block"]["norm"],
      cfg.norm,
      eps,
    )
    y = residual(
      y,
      lambda z, layer=layer: cross_attention(
        z, memory_SxD, source_real_TxS, layer["cross_attention"], cfg.d_k
      ),
      layer["cross_attention_block"]["norm"],
      cfg.norm,
      eps,
    )
    y = residual(
      y,
      lambda z, layer=layer: feed_forward(z, layer["ffn"]),
      layer["ffn_block"]["norm"],
      cfg.norm,
      eps,
    )
  if cfg.norm == "pre":
    y = layer_norm(y, params["decoder"]["final_norm"], eps)
  return y @ embedding_VxD.T


def transformer(params, source_S, decoder_input_T, cfg):
  return decoder(params, decoder_input_T, encoder(params, source_S, cfg), source_S, cfg)
