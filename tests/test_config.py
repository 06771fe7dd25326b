"""Config files load and validate; bad values fail in one line naming the key."""

import dataclasses
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import pytest

from transformer import cli
from transformer import config as config_lib
from transformer.model import ModelConfig, Transformer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(path, arg=None):
  return config_lib.load_config(f"{path}:{arg}" if arg is not None else path)


@pytest.mark.parametrize(
  "path,arg",
  [
    ("configs/default.py", None),
    ("configs/wmt14.py", "base"),
    ("configs/wmt14.py", "big"),
    ("configs/wmt14.py", "base,en-fr"),
    ("configs/wmt14.py", "big,en-fr"),
  ],
)
def test_shipped_configs_validate(path, arg):
  config_lib.validate(load_config(path, arg))


def test_wmt14_has_the_papers_hyperparameters():
  base, big = load_config("configs/wmt14.py", "base"), load_config("configs/wmt14.py", "big")
  assert (
    base.model.num_layers,
    base.model.d_model,
    base.model.d_ff,
    base.model.num_heads,
    base.model.d_k,
    base.model.d_v,
  ) == (6, 512, 2048, 8, 64, 64)
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


@pytest.mark.parametrize(
  "key,value,expected",
  [
    ("model.positional", "absolute", "config.model.positional"),
    ("model.norm", "sandwich", "config.model.norm"),
    ("model.dropout_rate", 1.5, "config.model.dropout_rate"),
    ("model.d_model", 0, "config.model.d_model"),
    ("tokens_per_batch", 16, "config.tokens_per_batch"),
    ("batching", "sentences", "config.batching"),
    ("direction", "english", "config.direction"),
    ("warmup_steps", 0, "config.warmup_steps"),
    ("storage_timeout_s", 0.0, "config.storage_timeout_s: must be positive"),
    ("peak_flops_per_device", -1.0, "config.peak_flops_per_device: must be >= 0"),
    ("mesh.tensor", 3, "config.model.num_heads"),
  ],
)
def test_inconsistent_values_are_named(key, value, expected):
  def mutate(c):
    *parents, leaf = key.split(".")
    node = c
    for p in parents:
      node = node[p]
    node[leaf] = value

  assert _bad(mutate).startswith(expected)


@pytest.mark.parametrize("key", ["dtype", "param_dtype"])
def test_float16_is_rejected_for_lack_of_loss_scaling(key):
  message = _bad(lambda c: setattr(c.model, key, "float16"))
  assert message.startswith(f"config.model.{key}: float16")
  assert "use bfloat16" in message and "loss scaling" in message


def _auto_model(**overrides) -> ml_collections.ConfigDict:
  model = load_config("configs/wmt14.py", "base").model
  model.update(overrides)
  return model


@pytest.mark.parametrize(
  "platform, dtype, kernel",
  [
    ("cuda", "bfloat16", "cudnn"),
    ("rocm", "bfloat16", "einsum"),  # cuDNN is NVIDIA's
    ("tpu", "float32", "einsum"),
    ("cpu", "float32", "einsum"),
  ],
)
def test_auto_resolves_to_each_platforms_measured_choice(platform, dtype, kernel):
  model = _auto_model()
  assert (model.dtype, model.attention_kernel) == ("auto", "auto")  # the WMT configs'
  resolved = config_lib.resolve_auto(model, platform)
  assert resolved == {"dtype": dtype, "attention_kernel": kernel}


@pytest.mark.parametrize(
  "overrides",
  [
    {"dtype": "float32"},  # cuDNN's flash attention takes 16-bit inputs only
    {"attention_dropout_rate": 0.1},
    {"d_v": 32},
    {"d_k": 12, "d_v": 12},
    {"d_k": 512, "d_v": 512},  # Table 3 (A)'s one head
  ],
  ids=["float32", "attention_dropout", "d_k_not_d_v", "d_k_not_a_multiple_of_8", "d_k_512"],
)
def test_auto_attention_falls_back_to_einsum_where_cudnn_cannot_run(overrides):
  resolved = config_lib.resolve_auto(_auto_model(**overrides), "cuda")
  assert resolved["attention_kernel"] == "einsum"


def test_auto_leaves_explicit_choices_alone_and_rejects_unknown_platforms():
  explicit = _auto_model(dtype="float32", attention_kernel="xla")
  assert config_lib.resolve_auto(explicit, "cuda") == {
    "dtype": "float32",
    "attention_kernel": "xla",
  }
  with pytest.raises(config_lib.ConfigError, match="platform 'gpu'"):
    config_lib.resolve_auto(_auto_model(), "gpu")


def test_model_config_resolves_auto_for_this_process_or_a_named_platform():
  config = load_config("configs/wmt14.py", "base")
  here = ModelConfig.from_config(config)  # the tests run on CPU
  assert (here.dtype, here.attention_kernel) == (jnp.float32, "einsum")
  gpu = ModelConfig.from_config(config, platform="cuda")
  assert (gpu.dtype, gpu.attention_kernel) == (jnp.bfloat16, "cudnn")
  assert gpu.param_dtype == jnp.float32  # mixed precision: parameters stay float32


def test_odd_d_model_fails_only_for_sinusoids():
  assert "d_model must be even" in _bad(lambda c: setattr(c.model, "d_model", 511))
  config = config_lib.base_config()
  config.model.d_model, config.model.positional = 511, "learned"
  config_lib.validate(config)


class RecordingConfig(ml_collections.ConfigDict):
  """A ConfigDict that records which keys the package reads, with their dotted names.

  A read counts when a module of the package outside transformer/config/ (whose
  validation reads every key) takes the value by attribute or by item, or when the
  config's final_step does (what the loop asks for its last step); bulk conversions inside
  ml_collections (to_json, items) do not count.
  """

  reads: set = set()

  def __getitem__(self, key):
    value = super().__getitem__(key)
    caller = sys._getframe(1)
    if caller.f_code.co_name == "__getattr__" and "ml_collections" in caller.f_code.co_filename:
      caller = caller.f_back
    path = os.path.abspath(caller.f_code.co_filename)
    in_config = os.path.dirname(path) == os.path.dirname(os.path.abspath(config_lib.__file__))
    if cli.is_project_file(path) and (
      not in_config or caller.f_code.co_name == config_lib.final_step.__name__
    ):
      RecordingConfig.reads.add(self._prefix() + key)
    return value

  def _prefix(self) -> str:
    return RecordingConfig._prefixes.get(id(self), "")

  _prefixes: dict = {}


def _recording(config: ml_collections.ConfigDict, prefix: str = "") -> RecordingConfig:
  out = RecordingConfig()
  RecordingConfig._prefixes[id(out)] = prefix
  for key, value in config.items():
    out[key] = (
      _recording(value, f"{prefix}{key}.")
      if isinstance(value, ml_collections.ConfigDict)
      else value
    )
  return out


@dataclasses.dataclass(frozen=True)
class RecordingModelConfig(ModelConfig):
  """ModelConfig that records which fields the model's modules read."""

  def __getattribute__(self, name):
    if name in ModelConfig.__dataclass_fields__:
      path = os.path.abspath(sys._getframe(1).f_code.co_filename)
      if cli.is_project_file(path):
        model_fields_read.add(name)
    return super().__getattribute__(name)


model_fields_read: set = set()


def test_every_key_is_read_by_the_package(small_corpus, tmp_path):
  """No dead options: a real run (train, validate with BLEU, checkpoint) reads every key,
  and the model's modules read every ModelConfig field."""
  from tests.helpers.tiny_run import make_config
  from transformer.evaluation.validation import ValidationWithBleu
  from transformer.inference import model_setup
  from transformer.training import loop, state

  config = make_config(
    small_corpus,
    num_train_steps=4,
    eval_every_steps=2,
    eval_bleu_sentences=4,
    num_eval_batches=1,
    checkpoint_every_steps=3,
    checkpoint_every_minutes=60.0,
    log_every_steps=2,
  )
  RecordingConfig.reads = set()
  loop.train_and_evaluate(_recording(config), str(tmp_path / "run"), validation=ValidationWithBleu)
  unread = sorted(set(config_lib.flatten(config_lib.base_config())) - RecordingConfig.reads)
  assert not unread, f"config keys never read: {unread}"

  # The model keys reach the modules through ModelConfig: each of its fields must be read
  # there (a learned position table reads max_position; beam search runs the cache path).
  from transformer.model import decoding

  model_fields_read.clear()
  for positional in ("sinusoidal", "learned"):
    fields = dataclasses.asdict(ModelConfig.from_config(config))
    run = state.setup(config)
    model = Transformer(RecordingModelConfig(**{**fields, "positional": positional}))
    params = model.init(jax.random.key(0), **model_setup.dummy_inputs(config))["params"]
    source = jnp.array([[5, 6, config_lib.EOS_ID]], jnp.int32)
    decoding.decode(
      model,
      nn.unbox(params),
      decoding.translation_prompts(source, 2, False),
      decoding.BeamSearch(beam_size=2, alpha=0.6),
    )
    del run
  unread = sorted(set(ModelConfig.__dataclass_fields__) - model_fields_read)
  assert not unread, f"ModelConfig fields never read by the model: {unread}"


def test_load_config_applies_overrides_and_finds_files_from_any_directory(tmp_path, monkeypatch):
  """FILE:ARG with dotted overrides, the path relative to the repository when the working
  directory has no such file; a bad key is a one-line error with a suggestion."""
  monkeypatch.chdir(tmp_path)
  config = config_lib.load_config(
    "configs/wmt14.py:big", {"model.num_heads": 4, "tokens_per_batch": 1000}
  )
  assert (config.model.d_model, config.model.num_heads, config.tokens_per_batch) == (1024, 4, 1000)
  with pytest.raises(
    config_lib.ConfigError,
    match=r"config.model.num_heds: unknown key \(did you mean config.model.num_heads\?\)",
  ):
    config_lib.load_config("configs/default.py", {"model.num_heds": 4})
  with pytest.raises(config_lib.ConfigError, match="config file configs/nope.py not found"):
    config_lib.load_config("configs/nope.py")
