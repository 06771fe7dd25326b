"""Every configuration key and its default; the fixed token ids; a config's derived sizes.

Config files under `configs/` start from `base_config()` and change what they need, so
the full list of keys lives here, once.
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
DTYPES = ("float32", "bfloat16")
# "auto": the choice measured fastest on the platform the run finds (resolve_auto).
AUTO = "auto"
BATCHING_KINDS = ("tokens", "packed")
VOCAB_TYPES = ("bpe", "unigram")
RNG_IMPLS = ("threefry2x32", "philox4x32", "rbg", "unsafe_rbg")
MESH_AXES = ("data", "fsdp", "tensor")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
ATTENTION_KERNELS = ("einsum", "xla", "cudnn", "tpu_flash")
LM_LOSS_KINDS = ("target", "sequence")


class ConfigError(ValueError):
  """A configuration value that cannot work; the message names the key."""


def model_config() -> ml_collections.ConfigDict:
  """The architecture: Transformer-base's values (the paper's Table 3, row "base")."""
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
  m.norm = (
    "post"  # post: LayerNorm(x + Dropout(F(x))), the paper; pre: x + Dropout(F(LayerNorm(x)))
  )
  m.activation = "relu"  # relu (paper) | gelu | swiglu
  m.tie_embeddings = True  # one matrix: source, target embedding and output projection
  m.decoder_only = False  # GPT-style LM: no encoder, no cross-attention
  # Compute dtype: float32, bfloat16 for mixed precision, or auto: bfloat16 on a GPU,
  # float32 on TPU and CPU (resolve_auto says why).
  m.dtype = "float32"
  m.param_dtype = "float32"  # parameters and optimizer state
  m.layer_norm_epsilon = 1e-6
  # Compile the N layers of each stack as one nn.scan over stacked parameters: compile
  # time stays nearly flat as N grows. Checkpoints of scanned and unscanned runs differ.
  m.scan_layers = False
  # Rematerialization per layer: none | full (recompute everything in the backward pass) |
  # dots (keep matmul outputs) | dots_no_batch (keep those without batch dimensions).
  m.remat = "none"
  # einsum: explicit softmax weights (attention dropout, attention maps, any d_k/d_v);
  # xla or cudnn: jax.nn.dot_product_attention with that implementation (cudnn is flash
  # attention on NVIDIA GPUs in bf16/fp16); tpu_flash: the Pallas FlashAttention kernel
  # for TPU. All but einsum need d_k == d_v and no attention dropout
  # (transformer/model/attention_kernels.py). auto: cudnn on an NVIDIA GPU where it can
  # run there, else einsum (resolve_auto lists the conditions).
  m.attention_kernel = "einsum"
  return m


def draft_config() -> ml_collections.ConfigDict:
  """A shallow draft for speculative decoding (transformer/model/draft.py): with
  num_layers > 0 the run trains only a decoder of that many layers, on the frozen
  encoder and embedding of the trained run in target_workdir (config.model must be that
  run's), and reads that run's vocabulary (vocab_from defaults to it)."""
  d = ml_collections.ConfigDict()
  d.target_workdir = ""
  d.num_layers = 0  # 0 = a plain run, not a shallow draft
  d.d_ff = 0  # the draft decoder's feed-forward width; 0 = model.d_ff
  # Decoding scores only the shortlist_size target-side ids most frequent in the
  # training data (0 = the whole vocabulary); `shortlist` holds them, most frequent
  # first, and is filled when training starts.
  d.shortlist_size = 0
  d.shortlist = []
  return d


def mesh_config() -> ml_collections.ConfigDict:
  """The device mesh's axis sizes (transformer/inference/sharding.py); -1 fills with the
  devices left over."""
  m = ml_collections.ConfigDict()
  m.data = -1
  m.fsdp = 1
  m.tensor = 1
  # Across-slice (DCN) factors for multi-slice TPU pods; the in-slice sizes are above.
  m.dcn_data = 1
  m.dcn_fsdp = 1
  m.dcn_tensor = 1
  return m


def logical_axis_rules() -> list[tuple[str, str | tuple[str, ...] | None]]:
  """The default `logical_axis_rules`, as (logical axis, mesh axes) pairs."""
  # Model logical axis -> mesh axes (None: replicated). The model names logical axes
  # only; this maps them. Parameters: `embed` over fsdp (ZeRO-3 style), heads, mlp and
  # vocab over tensor (Megatron style). Activations have their own `activation_*` names,
  # since their rows already take fsdp and an array can use a mesh axis once: rows over
  # data and fsdp, heads, mlp and vocab over tensor, d_model and lengths whole.
  # `batch` places the input batches (transformer/inference/sharding.py).
  return [
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv", None),
    ("length", None),
    ("layers", None),
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv", None),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
  ]


def base_config() -> ml_collections.ConfigDict:
  """All keys with paper-faithful defaults; config files override from here."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  # PRNG behind dropout masks: threefry2x32 (jax's default, the same bits on every
  # backend) | philox4x32 | rbg | unsafe_rbg (XLA's RngBitGenerator, the usual choice on
  # TPU). On a CPU they measured the same (docs/performance.md).
  c.dropout_rng_impl = "threefry2x32"
  _add_data_keys(c)
  _add_optimization_keys(c)
  _add_loop_keys(c)

  # Decoding (transformer/model/decoding/).
  c.beam_size = 4
  c.length_penalty_alpha = 0.6
  c.max_decode_extra_len = 50  # decode at most source length + this many tokens

  c.draft = draft_config()
  c.mesh = mesh_config()
  c.logical_axis_rules = logical_axis_rules()

  c.model = model_config()
  return c


def _add_data_keys(c: ml_collections.ConfigDict) -> None:
  """The dataset, its vocabulary and its batches (transformer/data/)."""
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
  # A trained run's workdir (may be gs://): use its vocab.model instead of the cached or
  # newly trained vocabulary, e.g. for a speculative-decoding draft, whose token ids must
  # be the target's. It is copied into the new workdir as usual.
  c.vocab_from = ""
  c.max_len = 64  # longest source or target, in subword tokens including EOS
  c.drop_long_examples = True  # False clips instead of dropping
  c.batching = "tokens"  # tokens (length buckets) | packed (segment ids)
  c.tokens_per_batch = 4096  # global real (non-pad) tokens per side per step, before accumulation
  c.eval_batch_size = 64  # sentences per evaluation / decoding batch (global)
  c.shuffle_buffer_size = 100_000
  # Decoder-only models read source + EOS + target + EOS as one sequence. target: the
  # loss is on the target side only (a prefix LM, the translation objective); sequence:
  # on the source side too (a plain LM over both, more training signal per pair).
  # Validation loss stays on the target side either way, comparable across both.
  c.lm_loss = "target"


def _add_optimization_keys(c: ml_collections.ConfigDict) -> None:
  """The schedule, Adam, clipping, accumulation and the loss
  (transformer/training/optimizer.py)."""
  # lr = scale * d_model^-0.5 * min(s^-0.5, s * warmup^-1.5), s counting updates.
  # num_train_steps and warmup_steps count optimizer updates; every other step of a run
  # (its checkpoints, metrics, --print_step, eval.py --step, the *_every_steps below)
  # counts batches, grad_accum_steps of them an update: `final_step(config)`.
  c.num_train_steps = 100_000
  c.warmup_steps = 4000
  c.learning_rate_scale = 1.0
  c.adam_b1 = 0.9
  c.adam_b2 = 0.98
  c.adam_eps = 1e-9
  c.weight_decay = 0.0
  c.grad_clip_norm = 0.0  # 0 = no clipping
  c.grad_accum_steps = 1
  # True: the optimizer's state (Adam's moments, and the accumulated gradient with
  # grad_accum_steps > 1) is also split over the mesh's data axis, and so is the
  # update: each data-parallel device updates 1/data of every parameter and the new
  # parameters are gathered (ZeRO stage 1). The same arithmetic; less memory, and no
  # device repeats another's update. On an all data-parallel mesh with scan_layers, each
  # layer's gradient is also split as it leaves the layer loop, a reduce-scatter per
  # layer instead of an all-reduce (ModelConfig.split_layer_grads, set from this key).
  # False: replicated as the parameters are.
  c.shard_optimizer_state = False
  c.label_smoothing = 0.1
  # > 0: training's projection and loss fused, this many target positions at a time
  # (model/loss.py: fused_cross_entropy_sums); 0: the whole f32 logits [B, T, V].
  c.loss_chunk_len = 0


def _add_loop_keys(c: ml_collections.ConfigDict) -> None:
  """The training loop: logging, evaluation, checkpoints, storage deadlines, MFU."""
  c.log_every_steps = 100
  c.eval_every_steps = 1000
  c.num_eval_batches = 0  # validation batches per evaluation, spread over all lengths; 0 = all
  c.eval_bleu_sentences = 500  # beam-search BLEU on this many validation sentences; 0 = off
  c.checkpoint_every_steps = 1000
  c.checkpoint_every_minutes = 10.0  # the paper averaged checkpoints written every 10 minutes
  c.keep_checkpoints = 20
  # Seconds one write to storage may take during training (a metrics or TensorBoard
  # upload, a checkpoint's save as a whole), and one read (a checkpoint's restore, the
  # vocabulary; the training data may go this long without reading a chunk), before the
  # run stops with an error naming it, instead of hanging on a stalled bucket. Raise it
  # for checkpoints that take longer to upload or load. Clients retry failed requests
  # (429, 503, resets) within it.
  c.storage_timeout_s = 600.0
  # Dense peak FLOP/s of one device (each fake CPU device too), for MFU. 0 = the datasheet
  # figure of a kind listed in training/flops.py, or on CPU the machine's, measured once
  # (about 2 s) and kept in ~/.cache/transformer/cpu_peak.json.
  c.peak_flops_per_device = 0.0


def final_step(config: ml_collections.ConfigDict) -> int:
  """The run's last step, in the steps its checkpoints, metrics, `train.py --print_step`
  and `eval.py --step` count: batches (micro-steps), grad_accum_steps of them to each of
  num_train_steps updates. A run is finished when its newest checkpoint is this step."""
  return config.num_train_steps * config.grad_accum_steps


def flatten(config: ml_collections.ConfigDict, prefix: str = "") -> dict:
  """{'model.d_model': 512, ...}: every leaf under its dotted key."""
  flat = {}
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      flat.update(flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def parse_direction(direction: str) -> tuple[str, str]:
  """'en-de' -> ('en', 'de'): the source and the target language codes."""
  codes = direction.split("-")
  if len(codes) != 2 or not all(codes) or codes[0] == codes[1]:
    raise ConfigError(f"config.direction: {direction!r} must look like 'en-de' (source-target)")
  return codes[0], codes[1]


def position_table_size(config: ml_collections.ConfigDict) -> int:
  """Rows of the learned position table (model.positional='learned'): one per position a
  run may look up. jnp.take returns NaN for a row past the table, and the NaN spreads
  through attention to the whole sequence.

  A training or evaluation row holds max_len tokens, or for a decoder-only model source
  + target (2 max_len), padded up to a multiple of 8. Generation feeds BOS, the prompt
  (decoder-only: the source, up to max_len) and all but the last of up to max_len +
  max_decode_extra_len outputs; one row of slack on top.
  """
  sides = 2 if config.model.decoder_only else 1
  longest_row = -(-sides * config.max_len // ROW_LENGTH_MULTIPLE) * ROW_LENGTH_MULTIPLE
  longest_generation = sides * config.max_len + config.max_decode_extra_len + 1
  return max(longest_row, longest_generation)


# Training and evaluation rows are padded to a multiple of this (data/batching.py).
ROW_LENGTH_MULTIPLE = 8
