"""Config files and dotted-key overrides: `--config FILE[:ARG]` and `--config.KEY=VALUE`,
as train.py, the sweeps, the tools and the tests build a config."""

from __future__ import annotations

import importlib.util
import os
import re

import ml_collections

from transformer.config.schema import ConfigError, flatten
from transformer.messages import did_you_mean

# The repository checkout: config files named relative to it work from any directory.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CONFIG = os.path.join(REPO_ROOT, "configs", "default.py")


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
