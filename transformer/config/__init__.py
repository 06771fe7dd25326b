"""Every configuration key, its default, and the checks run before anything compiles.

schema.py      every key and its default (`base_config()`), the fixed token ids, final_step
loading.py     `load_config("FILE[:ARG]", {dotted key: value})`, as `--config` builds a config
policy.py      what "auto" picks for model.dtype and model.attention_kernel on each platform
validation.py  `validate()`: a bad value as one line naming the key (a `ConfigError`)

Callers import the package (`from transformer import config as config_lib`); the names
below are its interface.
"""

from transformer.config.loading import (
  DEFAULT_CONFIG,
  REPO_ROOT,
  apply_overrides,
  import_file,
  load_config,
  resolve_config_file,
)
from transformer.config.policy import PLATFORMS, resolve_auto
from transformer.config.schema import (
  ACTIVATIONS,
  ATTENTION_KERNELS,
  AUTO,
  BATCHING_KINDS,
  BOS_ID,
  DTYPES,
  EOS_ID,
  LM_LOSS_KINDS,
  MESH_AXES,
  NORM_KINDS,
  PAD_ID,
  POSITIONAL_KINDS,
  REMAT_POLICIES,
  RNG_IMPLS,
  ROW_LENGTH_MULTIPLE,
  UNK_ID,
  VOCAB_TYPES,
  ConfigError,
  base_config,
  draft_config,
  final_step,
  flatten,
  logical_axis_rules,
  mesh_config,
  model_config,
  parse_direction,
  position_table_size,
)
from transformer.config.validation import check_fits_mesh, validate

__all__ = [
  "ACTIVATIONS",
  "ATTENTION_KERNELS",
  "AUTO",
  "BATCHING_KINDS",
  "BOS_ID",
  "DEFAULT_CONFIG",
  "DTYPES",
  "EOS_ID",
  "LM_LOSS_KINDS",
  "MESH_AXES",
  "NORM_KINDS",
  "PAD_ID",
  "PLATFORMS",
  "POSITIONAL_KINDS",
  "REMAT_POLICIES",
  "REPO_ROOT",
  "RNG_IMPLS",
  "ROW_LENGTH_MULTIPLE",
  "UNK_ID",
  "VOCAB_TYPES",
  "ConfigError",
  "apply_overrides",
  "base_config",
  "check_fits_mesh",
  "draft_config",
  "final_step",
  "flatten",
  "import_file",
  "load_config",
  "logical_axis_rules",
  "mesh_config",
  "model_config",
  "parse_direction",
  "position_table_size",
  "resolve_auto",
  "resolve_config_file",
  "validate",
]
