"""Config files load and validate; bad values fail in one line naming the key."""

import importlib.util
import os

import pytest

from transformer import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(path, arg=None):
  spec = importlib.util.spec_from_file_location("config_module", os.path.join(REPO, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg is not None else module.get_config()


@pytest.mark.parametrize("path,arg", [
    ("configs/default.py", None), ("configs/wmt14.py", "base"), ("configs/wmt14.py", "big"),
    ("configs/wmt14.py", "base,en-fr"), ("configs/wmt14.py", "big,en-fr")])
def test_shipped_configs_validate(path, arg):
  config_lib.validate(load_config(path, arg))


def test_wmt14_has_the_papers_hyperparameters():
  base, big = load_config("configs/wmt14.py", "base"), load_config("configs/wmt14.py", "big")
  assert (base.model.num_layers, base.model.d_model, base.model.d_ff, base.model.num_heads,
          base.model.d_k, base.model.d_v) == (6, 512, 2048, 8, 64, 64)
  assert (big.model.d_model, big.model.d_ff, big.model.num_heads) == (1024, 4096, 16)
  assert big.model.dropout_rate == 0.3
  assert load_config("configs/wmt14.py", "big,en-fr").model.dropout_rate == 0.1
  assert (base.adam_b1, base.adam_b2, base.adam_eps) == (0.9, 0.98, 1e-9)
  assert base.warmup_steps == 4000 and base.label_smoothing == 0.1
  assert (base.beam_size, base.length_penalty_alpha, base.max_decode_extra_len) == (4, 0.6, 50)
  assert base.dataset == "wmt14_translate/de-en" and base.direction == "en-de"
  assert load_config("configs/wmt14.py", "base,en-fr").dataset == "wmt14_translate/fr-en"


def test_wmt14_rejects_unknown_argument():
  with pytest.raises(ValueError, match="base\\|big"):
    load_config("configs/wmt14.py", "huge")


def _bad(mutate):
  config = config_lib.base_config()
  mutate(config)
  with pytest.raises(config_lib.ConfigError) as error:
    config_lib.validate(config)
  message = str(error.value)
  assert "\n" not in message
  return message


def test_unknown_key_is_named_with_a_suggestion():
  message = _bad(lambda c: setattr(c.model, "num_heds", 3))
  assert message.startswith("config.model.num_heds: unknown key")
  assert "config.model.num_heads" in message


def test_wrong_type_is_named():
  def mutate(c):
    c.unlock()
    del c["max_len"]
    c.max_len = "64"
  assert _bad(mutate).startswith("config.max_len: expected int")


@pytest.mark.parametrize("key,value,expected", [
    ("model.positional", "absolute", "config.model.positional"),
    ("model.norm", "sandwich", "config.model.norm"),
    ("model.dropout_rate", 1.5, "config.model.dropout_rate"),
    ("model.d_model", 0, "config.model.d_model"),
    ("tokens_per_batch", 16, "config.tokens_per_batch"),
    ("batching", "sentences", "config.batching"),
    ("direction", "english", "config.direction"),
    ("warmup_steps", 0, "config.warmup_steps"),
    ("mesh.tensor", 3, "config.model.num_heads"),
])
def test_inconsistent_values_are_named(key, value, expected):
  def mutate(c):
    *parents, leaf = key.split(".")
    node = c
    for p in parents:
      node = node[p]
    node[leaf] = value
  assert _bad(mutate).startswith(expected)


def test_odd_d_model_fails_only_for_sinusoids():
  assert "d_model must be even" in _bad(lambda c: setattr(c.model, "d_model", 511))
  config = config_lib.base_config()
  config.model.d_model, config.model.positional = 511, "learned"
  config_lib.validate(config)


def test_every_key_is_read_by_the_package():
  """No dead options: each leaf key name appears in the package's code."""
  sources = ""
  for root, _, files in os.walk(os.path.join(REPO, "transformer")):
    for name in files:
      if name.endswith(".py") and name != "config.py":
        with open(os.path.join(root, name)) as f:
          sources += f.read()
  flat = config_lib.flatten(config_lib.base_config())
  unread = [k for k in flat if k.split(".")[-1] not in sources]
  assert not unread, f"config keys never read: {unread}"
