"""The checks run before anything compiles: `validate()` turns a bad value into one line
naming the key (a `ConfigError`), which train.py prints before building anything."""

from __future__ import annotations

from typing import Any

import ml_collections

from transformer.config.schema import (
  ACTIVATIONS,
  ATTENTION_KERNELS,
  AUTO,
  BATCHING_KINDS,
  DTYPES,
  LM_LOSS_KINDS,
  MESH_AXES,
  NORM_KINDS,
  POSITIONAL_KINDS,
  REMAT_POLICIES,
  RNG_IMPLS,
  UNK_ID,
  VOCAB_TYPES,
  ConfigError,
  base_config,
  flatten,
  parse_direction,
)
from transformer.messages import did_you_mean


def _check(condition: bool, key: str, message: str) -> None:
  if not condition:
    raise ConfigError(f"config.{key}: {message}")


def _check_choice(flat: dict, key: str, choices) -> None:
  _check(flat[key] in choices, key, f"{flat[key]!r} is not one of {', '.join(choices)}")


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
