"""Every configuration key, its default, and the checks run before anything compiles.

Config files under `configs/` start from `base_config()` and change what they need, so
the full list of keys lives here, once. `validate()` turns a bad value into one line
naming the key (a `ConfigError`), which `train.py` prints before building anything.
`load_config("FILE[:ARG]", {dotted key: value})` builds a config as `--config` does.
"""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Any

import ml_collections

from transformer.messages import did_you_mean

# The repository checkout: config files named relative to it work from any directory.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO_ROOT, "configs", "default.py")

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
  """The device mesh's axis sizes (transformer/run/sharding.py); -1 fills with the
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
  # `batch` places the input batches (transformer/run/sharding.py).
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

  # Optimization (transformer/training/optimizer.py).
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
  # (run/scoring.py: fused_cross_entropy_sums); 0: the whole f32 logits [B, T, V].
  c.loss_chunk_len = 0

  # Loop, logging, checkpoints.
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

  # Decoding (transformer/model/decoding/).
  c.beam_size = 4
  c.length_penalty_alpha = 0.6
  c.max_decode_extra_len = 50  # decode at most source length + this many tokens

  c.draft = draft_config()
  c.mesh = mesh_config()
  c.logical_axis_rules = logical_axis_rules()

  c.model = model_config()
  return c


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


# ----------------------------------------------------------------------------------
# Loading config files and applying overrides (sweeps, tests, tools).


def resolve_config_file(path: str) -> str:
  """A config file's absolute path: as given (relative to the working directory), else
  relative to the repository, so commands run from any directory."""
  for candidate in (path, os.path.join(REPO_ROOT, path)):
    if os.path.isfile(candidate):
      return os.path.abspath(candidate)
  raise ConfigError(
    f"config file {path} not found (relative paths are tried from the "
    f"working directory and from {REPO_ROOT})"
  )


def import_file(path: str, prefix: str = "config"):
  """Imports a Python file by path (config and sweep files are not packages)."""
  name = prefix + "_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
  module_spec = importlib.util.spec_from_file_location(name, path)
  assert module_spec is not None and module_spec.loader is not None, path  # a .py path
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


def load_config(spec: str, overrides: dict | None = None) -> ml_collections.ConfigDict:
  """`FILE[:ARG]` as `--config` takes it, with dotted-key `overrides` applied; not validated."""
  path, _, arg = spec.partition(":")
  module = import_file(resolve_config_file(path))
  config = module.get_config(arg) if arg else module.get_config()
  apply_overrides(config, overrides or {})
  return config


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict) -> None:
  """Sets dotted keys ('model.num_heads': 16) in place; ConfigError naming a bad key."""
  known = list(flatten(config))
  for key, value in overrides.items():
    if key not in known:
      raise ConfigError(f"config.{key}: unknown key{did_you_mean(key, known, 'config.')}")
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
      node = node[part]
    try:
      node[leaf] = value
    except (TypeError, ValueError) as e:
      raise ConfigError(f"config.{key}: {e}") from None


# ----------------------------------------------------------------------------------
# Validation: cheap, before anything is built or compiled.


def _check(condition: bool, key: str, message: str) -> None:
  if not condition:
    raise ConfigError(f"config.{key}: {message}")


def _check_choice(flat: dict, key: str, choices) -> None:
  _check(flat[key] in choices, key, f"{flat[key]!r} is not one of {', '.join(choices)}")


# Platforms as resolve_auto names them: jax.default_backend()'s, with a GPU told apart by
# its maker (cuDNN is NVIDIA's).
PLATFORMS = ("cpu", "tpu", "cuda", "rocm")


def resolve_auto(model: ml_collections.ConfigDict, platform: str) -> dict[str, str]:
  """{"dtype": ..., "attention_kernel": ...}: model.dtype and model.attention_kernel, an
  "auto" among them replaced by the choice measured fastest on `platform` (PLATFORMS):

  - dtype: bfloat16 on a GPU, where the tensor cores run it at twice TF32's rate and
    Transformer-big's step took 128 ms against 234 in float32 on an H200
    (docs/performance.md, "GPU"); float32 on TPU, where the per-op profile put bf16's
    step 7% above float32's (the matmuls already multiply in bf16 at the default
    precision), and on CPU, which has no bf16 units;
  - attention_kernel: cudnn (flash attention) on an NVIDIA GPU when it can run there: a
    16-bit dtype, d_k == d_v, a head dimension cuDNN takes on every GPU it supports (a
    multiple of 8, at most 128; Hopper takes 256) and no attention dropout (110 against
    128 ms for big); einsum everywhere else (on TPU XLA's kernel compiles to the same
    program, and the Pallas kernel is slower at the paper's lengths). cuDNN's backward
    pass also needs even lengths, which batches padded to multiples of 8 always have.

  Parameters and checkpoints do not depend on either, so a run trained on one platform
  resumes, evaluates and decodes on another.
  """
  if platform not in PLATFORMS:
    raise ConfigError(f"platform {platform!r} is not one of {', '.join(PLATFORMS)}")
  dtype = model.dtype
  if dtype == AUTO:
    dtype = "bfloat16" if platform in ("cuda", "rocm") else "float32"
  kernel = model.attention_kernel
  if kernel == AUTO:
    fused_ok = (
      platform == "cuda"
      and dtype == "bfloat16"
      and model.d_k == model.d_v
      and model.d_k % 8 == 0
      and model.d_k <= 128
      and model.attention_dropout_rate == 0
    )
    kernel = "cudnn" if fused_ok else "einsum"
  return {"dtype": dtype, "attention_kernel": kernel}


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError naming the first bad key; cheap, runs before any compile."""
  flat = flatten(config)
  _check_keys_and_types(flat)
  _check_model(config.model, flat)
  _check_data(config, flat)
  _check_optimization(config, flat)
  _check_loop_and_decoding(config)
  _check_draft(config)
  _check_mesh(config, flat)


def _check_keys_and_types(flat: dict) -> None:
  reference = flatten(base_config())
  for key, value in flat.items():
    if key not in reference:
      raise ConfigError(f"config.{key}: unknown key{did_you_mean(key, reference, 'config.')}")
    expected = type(reference[key])
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
      continue
    if reference[key] is not None and not isinstance(value, expected):
      raise ConfigError(
        f"config.{key}: expected {expected.__name__}, got {type(value).__name__} {value!r}"
      )
  for key in reference:
    _check(key in flat, key, "missing (start config files from base_config())")


def _check_model(m: ml_collections.ConfigDict, flat: dict) -> None:
  for key in ("num_layers", "d_model", "d_ff", "num_heads", "d_k", "d_v"):
    _check(m[key] > 0, f"model.{key}", f"must be positive, got {m[key]}")
  for key in ("dropout_rate", "attention_dropout_rate"):
    _check(0.0 <= m[key] < 1.0, f"model.{key}", f"must be in [0, 1), got {m[key]}")
  _check_choice(flat, "model.positional", POSITIONAL_KINDS)
  _check_choice(flat, "model.norm", NORM_KINDS)
  _check_choice(flat, "model.activation", ACTIVATIONS)
  for key in ("model.dtype", "model.param_dtype"):
    # float16's narrow range needs dynamic loss scaling, which training does not do.
    _check(
      flat[key] != "float16",
      key,
      "float16 is not supported (no dynamic loss scaling); use bfloat16",
    )
    _check_choice(flat, key, (*DTYPES, AUTO) if key == "model.dtype" else DTYPES)
  _check_choice(flat, "model.remat", REMAT_POLICIES)
  _check_choice(flat, "model.attention_kernel", (*ATTENTION_KERNELS, AUTO))
  # Whether the kernel can serve this model (d_k != d_v, attention dropout, dtype) is
  # asked of its record when the model is built (model/attention_kernels.py, kernel_for).
  _check(
    m.d_model % 2 == 0 or m.positional != "sinusoidal",
    "model.d_model",
    f"sinusoidal positions pair sin/cos channels: d_model must be even, got {m.d_model}",
  )
  _check(
    m.d_k % 2 == 0 or m.positional != "rope",
    "model.d_k",
    f"rope rotates pairs of channels: d_k must be even, got {m.d_k}",
  )


def _check_data(config: ml_collections.ConfigDict, flat: dict) -> None:
  parse_direction(config.direction)
  _check(bool(config.dataset), "dataset", "is empty")
  _check_choice(flat, "vocab_type", VOCAB_TYPES)
  _check_choice(flat, "batching", BATCHING_KINDS)
  _check(config.vocab_size > UNK_ID + 1, "vocab_size", f"too small: {config.vocab_size}")
  _check(config.max_len >= 2, "max_len", f"must be at least 2, got {config.max_len}")
  _check(
    config.tokens_per_batch >= config.max_len,
    "tokens_per_batch",
    f"{config.tokens_per_batch} is below max_len={config.max_len}: "
    "not even one sentence fits in a batch",
  )
  _check(config.eval_batch_size > 0, "eval_batch_size", "must be positive")
  _check_choice(flat, "lm_loss", LM_LOSS_KINDS)
  _check(
    config.lm_loss == "target" or config.model.decoder_only,
    "lm_loss",
    f"{config.lm_loss!r} needs model.decoder_only=True (an encoder-decoder model's "
    "loss is on the target only)",
  )


def _check_optimization(config: ml_collections.ConfigDict, flat: dict) -> None:
  _check_choice(flat, "dropout_rng_impl", RNG_IMPLS)
  _check(config.num_train_steps > 0, "num_train_steps", "must be positive")
  _check(config.warmup_steps > 0, "warmup_steps", "must be positive (the schedule divides by it)")
  _check(config.learning_rate_scale > 0, "learning_rate_scale", "must be positive")
  _check(config.grad_accum_steps >= 1, "grad_accum_steps", "must be at least 1")
  _check(0.0 <= config.label_smoothing < 1.0, "label_smoothing", "must be in [0, 1)")
  _check(config.loss_chunk_len >= 0, "loss_chunk_len", "must be >= 0 (0 = unfused)")
  _check(config.grad_clip_norm >= 0, "grad_clip_norm", "must be >= 0 (0 = off)")
  _check(config.weight_decay >= 0, "weight_decay", "must be >= 0")


def _check_loop_and_decoding(config: ml_collections.ConfigDict) -> None:
  _check(config.log_every_steps > 0, "log_every_steps", "must be positive")
  _check(config.eval_every_steps >= 0, "eval_every_steps", "must be >= 0 (0 = off)")
  _check(config.eval_bleu_sentences >= 0, "eval_bleu_sentences", "must be >= 0 (0 = off)")
  _check(config.checkpoint_every_steps >= 0, "checkpoint_every_steps", "must be >= 0 (0 = off)")
  _check(config.checkpoint_every_minutes >= 0, "checkpoint_every_minutes", "must be >= 0")
  _check(config.keep_checkpoints >= 1, "keep_checkpoints", "must be at least 1")
  _check(
    config.storage_timeout_s > 0,
    "storage_timeout_s",
    f"must be positive (seconds), got {config.storage_timeout_s}",
  )
  _check(
    config.peak_flops_per_device >= 0,
    "peak_flops_per_device",
    "must be >= 0 (FLOP/s; 0 = automatic)",
  )
  _check(config.beam_size >= 1, "beam_size", "must be at least 1")
  _check(config.max_decode_extra_len >= 1, "max_decode_extra_len", "must be at least 1")


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


def _check_draft(config: ml_collections.ConfigDict) -> None:
  d = config.draft
  _check(d.num_layers >= 0, "draft.num_layers", f"must be >= 0 (0 = off), got {d.num_layers}")
  _check(d.d_ff >= 0, "draft.d_ff", f"must be >= 0 (0 = model.d_ff), got {d.d_ff}")
  _check(
    0 <= d.shortlist_size <= config.vocab_size,
    "draft.shortlist_size",
    f"must be in [0, vocab_size={config.vocab_size}], got {d.shortlist_size}",
  )
  _check(
    all(0 <= i < config.vocab_size for i in d.shortlist),
    "draft.shortlist",
    f"holds ids outside [0, vocab_size={config.vocab_size})",
  )
  if d.num_layers == 0:
    _check(
      not (d.target_workdir or d.shortlist or d.shortlist_size or d.d_ff),
      "draft.num_layers",
      "is 0 but other draft keys are set: set num_layers to train a shallow draft",
    )
    return
  _check(
    bool(d.target_workdir),
    "draft.target_workdir",
    "is empty: name the trained target run whose encoder the draft reads",
  )
  _check(
    not config.model.decoder_only,
    "draft.num_layers",
    "a shallow draft reads the target's encoder: model.decoder_only must be False",
  )
  _check(
    config.model.tie_embeddings,
    "draft.num_layers",
    "a shallow draft reads the target's tied embedding: model.tie_embeddings must be True",
  )
  _check(
    config.weight_decay == 0,
    "weight_decay",
    "must be 0 for a shallow draft: decay would move the frozen encoder and embedding",
  )
  _check(
    config.vocab_from in ("", d.target_workdir),
    "vocab_from",
    "a shallow draft reads draft.target_workdir's vocabulary; leave it empty",
  )


def _check_mesh(config: ml_collections.ConfigDict, flat: dict) -> None:
  for axis in MESH_AXES:
    for key in (f"mesh.{axis}", f"mesh.dcn_{axis}"):
      _check(flat[key] == -1 or flat[key] >= 1, key, f"must be -1 or positive, got {flat[key]}")
  _check(
    sum(flat[f"mesh.{a}"] == -1 for a in MESH_AXES) <= 1,
    "mesh",
    "at most one axis may be -1 (fill with the remaining devices)",
  )
  for rule in config.logical_axis_rules:
    _check(len(rule) == 2, "logical_axis_rules", f"each rule is (logical, mesh axes): {rule!r}")
    physical = rule[1]
    axes = (physical,) if isinstance(physical, str) else tuple(physical or ())
    unknown = [a for a in axes if a not in MESH_AXES]
    _check(
      not unknown,
      "logical_axis_rules",
      f"{rule[0]!r} names {', '.join(map(repr, unknown))}, not a mesh axis "
      f"({', '.join(MESH_AXES)})",
    )
    _check(
      len(set(axes)) == len(axes),
      "logical_axis_rules",
      f"{rule[0]!r} names a mesh axis twice: {physical!r}",
    )
  # Axis sizes known without the device count; create_mesh checks again once -1 is resolved.
  check_fits_mesh(
    config,
    {
      a: flat[f"mesh.{a}"] * flat[f"mesh.dcn_{a}"]
      if -1 not in (flat[f"mesh.{a}"], flat[f"mesh.dcn_{a}"])
      else -1
      for a in MESH_AXES
    },
  )


# Sizes of parameter and activation dimensions and the logical axis each is named by in
# the model. Activations would split unevenly rather than fail (XLA pads), so they are
# held to the same rule. Batch rows and lengths vary by batch: sharding.py checks rows.
_SHARDED_SIZES = (
  ("model.num_heads", "heads"),
  ("model.d_model", "embed"),
  ("model.d_ff", "mlp"),
  ("vocab_size", "vocab"),
  ("model.d_k", "kv"),
  ("model.d_v", "kv"),
  ("model.num_heads", "activation_heads"),
  ("model.d_model", "activation_embed"),
  ("model.d_ff", "activation_mlp"),
  ("vocab_size", "activation_vocab"),
  ("model.d_k", "activation_kv"),
  ("model.d_v", "activation_kv"),
)


def check_fits_mesh(config: ml_collections.ConfigDict, mesh_sizes: dict[str, int]) -> None:
  """ConfigError naming the model size that does not split evenly over its mesh axes.

  `mesh_sizes`: devices per mesh axis (-1 = not known yet, skipped). JAX would otherwise
  stop much later, while placing parameters, with an IndivisibleError.
  """
  rules: dict[str, Any] = {}
  for logical, physical in config.logical_axis_rules:
    rules.setdefault(logical, physical)  # flax uses the first rule for a logical axis
  flat = flatten(config)
  for key, logical in _SHARDED_SIZES:
    physical = rules.get(logical) or ()
    axes = (physical,) if isinstance(physical, str) else tuple(physical)
    sizes = [mesh_sizes.get(a, 1) for a in axes]
    if -1 in sizes:
      continue
    devices = 1
    for size in sizes:
      devices *= size
    where = " x ".join(f"mesh.{a}={n}" for a, n in zip(axes, sizes))
    _check(
      flat[key] % devices == 0,
      key,
      f"{flat[key]} does not split evenly over {where} (logical axis '{logical}')",
    )
