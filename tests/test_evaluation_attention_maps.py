"""Attention heatmaps for a tiny random model and a stand-in tokenizer."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib.image
import numpy as np
import pytest

from transformer.config import BOS_ID, EOS_ID
from transformer.data.tokenizer import with_eos
from transformer.evaluation import attention_maps
from transformer.model import ModelConfig, Transformer, stack_layer_params

LAYERS, HEADS = 2, 2


class WordTokenizer:
  """One id per known word (4 and up), so the pieces are predictable; records lookups."""

  def __init__(self, words):
    self.ids = {w: i + 4 for i, w in enumerate(words)}
    self.pieces_asked = []

  def encode(self, text):
    return [self.ids[w] for w in text.split()]

  def encode_for_model(self, texts, max_len):
    return [with_eos(self.encode(text), max_len) for text in texts]

  def id_to_piece(self, token_id):
    self.pieces_asked.append(token_id)
    return {v: k for k, v in self.ids.items()}.get(token_id, f"<{token_id}>")


@pytest.fixture(scope="module")
def model_and_params():
  model = Transformer(
    ModelConfig(
      vocab_size=10,
      max_position=32,
      num_layers=LAYERS,
      d_model=16,
      d_ff=32,
      num_heads=HEADS,
      d_k=8,
      d_v=8,
    )
  )
  variables = jax.jit(model.init)(
    jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32)
  )
  return model, nn.unbox(variables["params"])


def test_writes_one_png_per_layer_and_kind(model_and_params, tmp_path):
  model, params = model_and_params
  tokenizer = WordTokenizer(["the", "cat", "sat", "on", "mat", "today"])
  paths = attention_maps.plot_attention_maps(
    model,
    params,
    tokenizer,
    "the cat sat on the mat",
    str(tmp_path),
    max_len=5,
    max_decode_extra_len=3,
  )
  assert len(paths) == LAYERS * len(attention_maps.ATTENTION_KINDS) == len(set(paths))
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.split("/")[-1] for p in paths)
  for path in paths:
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and min(image.shape[:2]) > 100 and image.std() > 0
  # Source truncated to max_len - 1 words plus EOS, every one labelled.
  assert set(tokenizer.encode("the cat sat on")) | {EOS_ID, BOS_ID} <= set(tokenizer.pieces_asked)


def test_weights_cover_the_sentence_and_its_translation(model_and_params):
  model, params = model_and_params
  source, target = [4, 5, 6, EOS_ID], [7, 8, EOS_ID]
  weights = attention_maps.attention_weights(model, params, source, target)
  assert len(weights) == LAYERS * 3
  assert weights[("encoder", 1, "self_attention")].shape == (HEADS, 4, 4)
  assert weights[("decoder", 0, "self_attention")].shape == (HEADS, 3, 3)
  assert weights[("decoder", 1, "cross_attention")].shape == (HEADS, 3, 4)
  for w in weights.values():
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
  # Decoder self-attention is causal: nothing above the diagonal.
  assert np.all(np.triu(weights[("decoder", 1, "self_attention")], k=1) == 0)


def test_scanned_model_gives_the_same_maps(model_and_params):
  model, params = model_and_params
  scanned = Transformer(dataclasses.replace(model.config, scan_layers=True))
  stacked = stack_layer_params(params, LAYERS)
  source, target = [4, 5, 6, EOS_ID], [7, 8, EOS_ID]
  looped = attention_maps.attention_weights(model, params, source, target)
  from_scan = attention_maps.attention_weights(scanned, stacked, source, target)
  assert from_scan.keys() == looped.keys()
  for key, weights in looped.items():
    np.testing.assert_allclose(from_scan[key], weights, rtol=1e-5, atol=1e-6)
