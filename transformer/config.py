"""Every configuration key, its default, and the checks run before anything compiles.

Config files under `configs/` start from `base_config()` and change what they need, so
the full list of keys lives here, once. `validate()` turns a bad value into one line
naming the key (a `ConfigError`), which `train.py` prints before building anything.
"""

from __future__ import annotations

import ml_collections

# Fixed token ids, shared by the tokenizer, the input pipeline, the model and decoding.
PAD_ID = 0  # masks come from `ids != PAD_ID`
EOS_ID = 1  # appended to every source and target sentence
BOS_ID = 2  # the first decoder input: targets are shifted right behind it
UNK_ID = 3

POSITIONAL_KINDS = ("sinusoidal", "learned", "rope")
NORM_KINDS = ("post", "pre")
ACTIVATIONS = ("relu", "gelu", "swiglu")
DTYPES = ("float32", "bfloat16", "float16")
BATCHING_KINDS = ("tokens", "packed")
VOCAB_TYPES = ("bpe", "unigram")
MESH_AXES = ("data", "fsdp", "tensor")


class ConfigError(ValueError):
  """A configuration value that cannot work; the message names the key."""


def model_config() -> ml_collections.ConfigDict:
  """The architecture: Transformer-base's values (PAPER.md, "base")."""
  m = ml_collections.ConfigDict()
  m.num_layers = 6  # N, for the encoder and the decoder alike
  m.d_model = 512
  m.d_ff = 2048
  m.num_heads = 8  # h
  m.d_k = 64  # per-head query/key size
  m.d_v = 64  # per-head value size
  m.dropout_rate = 0.1  # P_drop: sublayer outputs and embeddings + positions
  m.attention_dropout_rate = 0.0  # the paper has none
  m.positional = "sinusoidal"  # sinusoidal | learned (Table 3 row E) | rope
  m.norm = "post"  # post: LayerNorm(x + Dropout(F(x))), the paper; pre: x + Dropout(F(LayerNorm(x)))
  m.activation = "relu"  # relu (paper) | gelu | swiglu
  m.tie_embeddings = True  # one matrix: source, target embedding and output projection
  m.decoder_only = False  # GPT-style LM: no encoder, no cross-attention
  m.dtype = "float32"  # compute dtype; bfloat16 for mixed precision
  m.param_dtype = "float32"  # parameters and optimizer state
  m.layer_norm_epsilon = 1e-6
  return m


def base_config() -> ml_collections.ConfigDict:
  """All keys with paper-faithful defaults; config files override from here."""
  c = ml_collections.ConfigDict()
  c.seed = 0

  # Data (transformer/data/).
  c.dataset = "tatoeba_en_es"  # a tfds name, e.g. wmt14_translate/de-en, or tsv:PATH
  c.direction = "en-es"  # source-target language codes, e.g. en-de reverses (de, en)
  c.data_dir = ""  # tfds data_dir; "" = tfds's default
  c.manual_dir = ""  # tfds manual_dir for datasets that need manual downloads
  c.validation_file = ""  # with dataset=tsv:PATH: a separate validation TSV
  c.test_file = ""  # with dataset=tsv:PATH: a separate test TSV
  c.vocab_type = "bpe"  # bpe | unigram (SentencePiece model type)
  c.vocab_size = 8000
  c.vocab_cache_dir = ""  # "" = <data_dir or ~/.cache>/transformer_vocab
  c.vocab_max_sentences = 2_000_000  # sentences per side used to train SentencePiece
  c.max_len = 64  # longest source or target, in subword tokens including EOS
  c.drop_long_examples = True  # False clips instead of dropping
  c.batching = "tokens"  # tokens (length buckets) | packed (segment ids)
  c.tokens_per_batch = 4096  # global tokens per side per step (before accumulation)
  c.eval_batch_size = 64  # sentences per evaluation / decoding batch (global)
  c.shuffle_buffer_size = 100_000

  # Optimization (transformer/trainer.py). lr = scale * d_model^-0.5 * min(s^-0.5, s * warmup^-1.5)
  c.num_train_steps = 100_000
  c.warmup_steps = 4000
  c.learning_rate_scale = 1.0
  c.adam_b1 = 0.9
  c.adam_b2 = 0.98
  c.adam_eps = 1e-9
  c.weight_decay = 0.0
  c.grad_clip_norm = 0.0  # 0 = no clipping
  c.grad_accum_steps = 1
  c.label_smoothing = 0.1

  # Loop, logging, checkpoints.
  c.log_every_steps = 100
  c.eval_every_steps = 1000
  c.num_eval_batches = 0  # validation batches per evaluation; 0 = the whole split
  c.checkpoint_every_steps = 1000
  c.checkpoint_every_minutes = 10.0  # the paper averaged checkpoints written every 10 minutes
  c.keep_checkpoints = 20

  # Decoding (transformer/decoding.py).
  c.beam_size = 4
  c.length_penalty_alpha = 0.6
  c.max_decode_extra_len = 50  # decode at most source length + this many tokens

  # Device mesh (transformer/sharding.py). -1 fills with the devices left over.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  # Across-slice (DCN) factors for multi-slice TPU pods; the in-slice sizes are above.
  c.mesh.dcn_data = 1
  c.mesh.dcn_fsdp = 1
  c.mesh.dcn_tensor = 1
  # Model logical axis -> mesh axes. Parameters name logical axes only; this maps them.
  c.logical_axis_rules = [
      ("batch", ("data", "fsdp")),
      ("vocab", "tensor"),
      ("embed", "fsdp"),
      ("mlp", "tensor"),
      ("heads", "tensor"),
      ("kv", None),
      ("length", None),
      ("layers", None),
  ]

  c.model = model_config()
  return c
