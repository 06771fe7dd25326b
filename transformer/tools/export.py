"""Export a trained run to CTranslate2, the inference engine of OpenNMT and Argos.

    python -m transformer.tools.export --workdir RUN --out RUN-ct2 [--quantization int8]
        [--step N] [--average_last K] [--force]

writes a directory that `ctranslate2.Translator(DIR)` loads (`ctranslate2.Generator` for
a decoder-only run): the engine's model.bin, config.json and vocabulary, the run's
SentencePiece model as sentencepiece.model, export.json (where it came from, and the
decoding settings that reproduce the run's own search) and a README.md with the lines
of Python that translate with it. It needs only the `ctranslate2` wheel at run time (the
`export` extra); no other framework's checkpoint format is involved: the engine's model
spec is filled from the run's arrays.

The exported model computes the run's function: post-LN or pre-LN (with its final
LayerNorm), ReLU, GELU (tanh form) or SwiGLU, sqrt(d_model)-scaled embeddings, tied or
untied embeddings and output projection, the paper's interleaved sinusoids (stored as a
table: the engine's built-in sinusoids are laid out differently and start at position
1), learned positions, rope (halves rotated), d_k other than d_model / h, and the run's
LayerNorm epsilon. Token ids are the run's: the vocabulary lists the SentencePiece
pieces by id, sources get EOS appended by the engine (`add_source_eos`), and decoding
starts from BOS. What the engine cannot compute is refused in one line naming the
option. tests/test_tools_export.py checks the engine's greedy output against the
project's token for token, and its scores against the model's log-probabilities.

--quantization float32 (the default) stores the weights as trained; int8 stores the
matrices in 8 bits with a scale per row, about a quarter of the size and faster on
CPUs (docs/decoding.md measures both). The engine can also convert at load time
(`compute_type=`).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

import ctranslate2
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import flags
from ctranslate2.specs import common_spec, transformer_spec

from transformer import cli, inference, storage
from transformer import config as config_lib
from transformer.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, ConfigError
from transformer.inference import checkpoints
from transformer.model import ModelConfig
from transformer.model.primitives import sinusoidal_encoding
from transformer.model.transformer import unstack_layer_params

# Weight storage in the exported model.bin; float32 keeps the trained weights exactly.
QUANTIZATIONS = ("float32", "int8", "float16", "bfloat16", "int8_float16", "int8_bfloat16")

# Rows of the stored sinusoid table, the positions the engine can then read. The model's
# own sinusoids have no limit; a table must have one: 1,024 (2 MB at d_model 512) is the
# engine's own input cut (max_input_length) and 4 times its default output length
# (256), and longer than any sentence a run trains on.
SINUSOID_TABLE_ROWS = 1024

# Our searches never generate these (decoding/search.py NEVER_GENERATED); the engine
# is told so at every call (`suppress_sequences`, see the README written with a model).
NEVER_GENERATED = (PAD_ID, BOS_ID)

SENTENCEPIECE_NAME = "sentencepiece.model"
EXPORT_RECORD_NAME = "export.json"

_ACTIVATIONS = {
  "relu": common_spec.Activation.RELU,
  # flax's nn.gelu defaults to the tanh approximation, which the engine has as GELUTanh.
  "gelu": common_spec.Activation.GELUTanh,
  # SwiGLU: silu(x W_gate) * (x W_up), the engine's GLU form with Swish.
  "swiglu": common_spec.Activation.SWISH,
}


def check_exportable(config) -> None:
  """One-line ConfigError naming the first option the engine cannot compute."""
  if config.draft.num_layers:
    raise ConfigError(
      "config.draft.num_layers: a shallow draft decodes only beside its target run "
      f"({config.draft.target_workdir or 'draft.target_workdir'}); export that run instead"
    )
  m = config.model
  if m.d_k != m.d_v:
    raise ConfigError(
      f"config.model.d_v: CTranslate2 has one head size for queries, keys and values; "
      f"this run has d_k={m.d_k}, d_v={m.d_v}"
    )
  if m.activation not in _ACTIVATIONS:
    raise ConfigError(f"config.model.activation: {m.activation!r} has no CTranslate2 equivalent")


def vocabulary(pieces: list[str], vocab_size: int) -> list[str]:
  """The engine's tokens by id: the SentencePiece pieces, then a placeholder for each
  embedding row past them (SentencePiece may train fewer pieces than vocab_size)."""
  tokens = list(pieces)
  taken = set(tokens)
  for i in range(len(tokens), vocab_size):
    name = f"<unused_{i}>"
    while name in taken:
      name = f"<{name}>"
    tokens.append(name)
    taken.add(name)
  return tokens


def _np(x) -> np.ndarray:
  """A float32 copy of a parameter: the engine's quantization rescales arrays in place."""
  return np.array(jax.device_get(x), np.float32)


def _linear(spec, weight_OUTxIN: np.ndarray, bias_OUT: np.ndarray | None = None) -> None:
  spec.weight = np.array(weight_OUTxIN, np.float32, order="C")
  if bias_OUT is not None:
    spec.bias = _np(bias_OUT)


def _heads_to_rows(kernel_DxHxK: np.ndarray) -> np.ndarray:
  """A [D, H, K] projection as the engine's [H*K, D] weight (rows head by head)."""
  d_model = kernel_DxHxK.shape[0]
  return kernel_DxHxK.reshape(d_model, -1).T


def _layer_norm(spec, params: dict[str, Any]) -> None:
  spec.gamma = _np(params["scale"])
  spec.beta = _np(params["bias"])


def _ffn(spec, params: dict[str, Any], activation: str) -> None:
  if activation == "swiglu":
    _linear(spec.linear_0, _np(params["wi_gate"]["kernel"]).T)
    _linear(spec.linear_0_noact, _np(params["wi_up"]["kernel"]).T)
    _linear(spec.linear_1, _np(params["wo"]["kernel"]).T)
    return
  _linear(spec.linear_0, _np(params["wi"]["kernel"]).T, params["wi"]["bias"])
  _linear(spec.linear_1, _np(params["wo"]["kernel"]).T, params["wo"]["bias"])


def _self_attention(spec, params: dict[str, Any], d_k: int) -> None:
  """Our fused [D, H, 3K] kernel (q, k, v per head) as the engine's [3 H K, D]: all
  query rows, then all key rows, then all value rows."""
  qkv_DxHx3K = _np(params["qkv"]["kernel"])
  q, k, v = (qkv_DxHx3K[:, :, i * d_k : (i + 1) * d_k] for i in range(3))
  _linear(spec.linear[0], np.concatenate([_heads_to_rows(x) for x in (q, k, v)], axis=0))
  _out(spec.linear[1], params["out"]["kernel"])


def _cross_attention(spec, params: dict[str, Any], d_k: int) -> None:
  _linear(spec.linear[0], _heads_to_rows(_np(params["query"]["kernel"])))
  kv_DxHx2K = _np(params["kv"]["kernel"])
  k, v = kv_DxHx2K[:, :, :d_k], kv_DxHx2K[:, :, d_k:]
  _linear(spec.linear[1], np.concatenate([_heads_to_rows(k), _heads_to_rows(v)], axis=0))
  _out(spec.linear[2], params["out"]["kernel"])


def _out(spec, kernel_HxExD) -> None:
  kernel = _np(kernel_HxExD)
  _linear(spec, kernel.reshape(-1, kernel.shape[-1]).T)


def _position_table(cfg: ModelConfig, stack_params: dict[str, Any]) -> np.ndarray | None:
  """The rows the engine adds to the scaled embeddings at positions 0, 1, ...; None for
  rope, which the engine applies inside attention."""
  if cfg.positional == "learned":
    return _np(stack_params["input"]["position_embedding"])
  if cfg.positional == "sinusoidal":
    positions_1xP = jnp.arange(SINUSOID_TABLE_ROWS, dtype=jnp.int32)[None]
    return _np(sinusoidal_encoding(positions_1xP, cfg.d_model)[0])
  return None


def _stack_options(cfg: ModelConfig) -> dict[str, Any]:
  """What the engine's encoder and decoder specs share for this model."""
  options: dict[str, Any] = dict(
    pre_norm=cfg.norm == "pre",
    activation=_ACTIVATIONS[cfg.activation],
    ffn_glu=cfg.activation == "swiglu",
  )
  if cfg.d_k * cfg.num_heads != cfg.d_model:
    options["head_dim"] = cfg.d_k  # else the engine takes d_model / h
  if cfg.positional == "rope":
    # Every channel of a head rotated, its two halves paired (not interleaved pairs).
    options.update(rotary_dim=0, rotary_interleave=False, rotary_base=10000)
  return options


def _fill_stack(spec, cfg: ModelConfig, stack_params: dict[str, Any], embedding_VxD) -> None:
  embeddings = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings
  embeddings.weight = _np(embedding_VxD)
  spec.scale_embeddings = True  # x sqrt(d_model), the paper's
  table = _position_table(cfg, stack_params)
  if table is not None:
    spec.position_encodings.encodings = table
  if cfg.norm == "pre":
    _layer_norm(spec.layer_norm, stack_params["final_norm"])


def _layers(stack_params: dict[str, Any], num_layers: int) -> list[dict[str, Any]]:
  return [stack_params[f"layer_{i}"] for i in range(num_layers)]


def model_spec(cfg: ModelConfig, params: dict[str, Any], tokens: list[str]):
  """The engine's spec of a model with these parameters, its vocabulary `tokens` (one
  string per id, `vocabulary()`), not yet validated or quantized.

  An encoder-decoder model becomes a TransformerSpec (for ctranslate2.Translator), a
  decoder-only one a TransformerDecoderModelSpec (for ctranslate2.Generator).
  """
  if cfg.d_k != cfg.d_v:
    raise ConfigError(f"config.model.d_v: must equal d_k ({cfg.d_k}) for CTranslate2")
  if len(tokens) != cfg.vocab_size:
    raise ValueError(f"{len(tokens)} tokens for a vocabulary of {cfg.vocab_size}")
  if cfg.scan_layers:
    params = unstack_layer_params(params, cfg.num_layers)
  if cfg.tie_embeddings:
    source_VxD = target_VxD = params["shared_embedding"]["embedding"]
  else:
    source_VxD = params.get("source_embedding", {}).get("embedding")
    target_VxD = params["target_embedding"]["embedding"]
  options = _stack_options(cfg)
  decoder_spec = transformer_spec.TransformerDecoderSpec(
    cfg.num_layers, cfg.num_heads, with_encoder_attention=not cfg.decoder_only, **options
  )
  _fill_stack(decoder_spec, cfg, params["decoder"], target_VxD)
  for layer_spec, layer in zip(decoder_spec.layer, _layers(params["decoder"], cfg.num_layers)):
    _self_attention(layer_spec.self_attention, layer["self_attention"], cfg.d_k)
    _layer_norm(layer_spec.self_attention.layer_norm, layer["self_attention_block"]["norm"])
    if not cfg.decoder_only:
      _cross_attention(layer_spec.attention, layer["cross_attention"], cfg.d_k)
      _layer_norm(layer_spec.attention.layer_norm, layer["cross_attention_block"]["norm"])
    _ffn(layer_spec.ffn, layer["ffn"], cfg.activation)
    _layer_norm(layer_spec.ffn.layer_norm, layer["ffn_block"]["norm"])
  if cfg.tie_embeddings:
    # Logits x E^T, unscaled: the same array, which the spec stores once (an alias).
    _linear(decoder_spec.projection, _np(target_VxD))
  else:
    _linear(decoder_spec.projection, _np(params["decoder"]["output_projection"]["kernel"]).T)

  special: dict[str, Any] = dict(
    unk_token=tokens[UNK_ID], bos_token=tokens[BOS_ID], eos_token=tokens[EOS_ID]
  )
  if cfg.decoder_only:
    spec = transformer_spec.TransformerDecoderModelSpec(decoder_spec)
    spec.register_vocabulary(tokens)
  else:
    encoder_spec = transformer_spec.TransformerEncoderSpec(cfg.num_layers, cfg.num_heads, **options)
    _fill_stack(encoder_spec, cfg, params["encoder"], source_VxD)
    for layer_spec, layer in zip(encoder_spec.layer, _layers(params["encoder"], cfg.num_layers)):
      _self_attention(layer_spec.self_attention, layer["self_attention"], cfg.d_k)
      _layer_norm(layer_spec.self_attention.layer_norm, layer["attention_block"]["norm"])
      _ffn(layer_spec.ffn, layer["ffn"], cfg.activation)
      _layer_norm(layer_spec.ffn.layer_norm, layer["ffn_block"]["norm"])
    spec = transformer_spec.TransformerSpec(encoder_spec, decoder_spec)
    spec.register_source_vocabulary(tokens)
    spec.register_target_vocabulary(tokens)
    # Sources are ids + EOS (data/tokenizer.py with_eos); decoding starts from BOS.
    special.update(decoder_start_token=tokens[BOS_ID], add_source_eos=True)
  for key, value in dict(special, layer_norm_epsilon=cfg.layer_norm_epsilon).items():
    setattr(spec.config, key, value)
  return spec


@dataclasses.dataclass(frozen=True)
class Exported:
  """What `export_run` wrote."""

  out: str
  step: int
  average_last: int
  quantization: str
  decoder_only: bool


def _which(exported: Exported) -> str:
  if exported.average_last == 1:
    return f"the checkpoint of step {exported.step}"
  return f"the mean of the {exported.average_last} checkpoints up to step {exported.step}"


def _readme(config, exported: Exported, tokens: list[str]) -> str:
  suppress = [[tokens[i]] for i in NEVER_GENERATED]
  extra = config.max_decode_extra_len
  if exported.decoder_only:
    code = f"""\
import ctranslate2, sentencepiece as spm
sp = spm.SentencePieceProcessor(model_file="{SENTENCEPIECE_NAME}")
lm = ctranslate2.Generator(".", device="cpu", compute_type="auto")
prompts = [["{tokens[BOS_ID]}", *sp.encode(s, out_type=str), "{tokens[EOS_ID]}"]
           for s in ["How are you?"]]
results = lm.generate_batch(prompts, beam_size=1, include_prompt_in_result=False,
                            max_length=max(map(len, prompts)) - 1 + {extra},
                            end_token="{tokens[EOS_ID]}", suppress_sequences={suppress})
print([sp.decode(r.sequences[0]) for r in results])
"""
  else:
    code = f"""\
import ctranslate2, sentencepiece as spm
sp = spm.SentencePieceProcessor(model_file="{SENTENCEPIECE_NAME}")
translator = ctranslate2.Translator(".", device="cpu", compute_type="auto")
sources = [sp.encode(s, out_type=str) for s in ["How are you?"]]
results = translator.translate_batch(sources, beam_size={config.beam_size},
                                     length_penalty={config.length_penalty_alpha},
                                     max_decoding_length=max(map(len, sources)) + 1 + {extra},
                                     min_decoding_length=0, suppress_sequences={suppress})
print([sp.decode(r.hypotheses[0]) for r in results])
"""
  kind = "A decoder-only language model" if exported.decoder_only else "A translation model"
  return f"""\
# {kind} for CTranslate2

Exported from a run on {config.dataset} ({config.direction}): {_which(exported)}, weights
stored as {exported.quantization}. Run from this directory (`pip install ctranslate2
sentencepiece`):

```python
{code}```

The run never generates `{tokens[PAD_ID]}` or `{tokens[BOS_ID]}`, and may generate nothing but
EOS: pass the options as above.
Greedy decoding (beam_size=1) gives the run's own greedy output. The engine's
length_penalty divides by length^alpha, not the paper's ((5 + length) / 6)^alpha, so
beam search can rank hypotheses slightly differently. Sources longer than
{config.max_len - 1} pieces were never seen in training (the run clipped them there).
export.json records where this model came from.
"""


def export_run(
  workdir: str,
  out: str,
  *,
  step: int | None = None,
  average_last: int = 1,
  quantization: str = "float32",
  force: bool = False,
) -> Exported:
  """Writes the run's checkpoint `step` (default: newest), or the mean of the last
  `average_last`, as a CTranslate2 model directory `out` (local or gs://)."""
  config = _exportable_config(workdir, out, average_last, quantization, force)
  # One row per process is all the restore needs: the export reads whole arrays.
  config.eval_batch_size = jax.device_count()
  restored = inference.restore(workdir, step, average_last, config=config)
  tokenizer, newest = restored.tokenizer, restored.step
  params = jax.device_get(restored.params)
  cfg = ModelConfig.from_config(config)
  pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
  tokens = vocabulary(pieces, cfg.vocab_size)
  spec = model_spec(cfg, params, tokens)
  spec.validate()
  spec.optimize(quantization=quantization)
  exported = Exported(out, newest, average_last, quantization, bool(cfg.decoder_only))
  with tempfile.TemporaryDirectory(prefix="ct2-export-") as local:
    spec.save(local)
    with open(os.path.join(local, SENTENCEPIECE_NAME), "wb") as f:
      f.write(tokenizer.model_proto)
    with open(os.path.join(local, "README.md"), "w", encoding="utf-8") as f:
      f.write(_readme(config, exported, tokens))
    storage.makedirs(out)
    for name in sorted(os.listdir(local)):
      storage.copy(os.path.join(local, name), storage.join(out, name))
  storage.write_json(
    storage.join(out, EXPORT_RECORD_NAME), _export_record(config, workdir, exported, tokens)
  )
  return exported


def _exportable_config(
  workdir: str, out: str, average_last: int, quantization: str, force: bool
) -> ml_collections.ConfigDict:
  """The run's config, once everything that would stop the export is checked (one line)."""
  if quantization not in QUANTIZATIONS:
    raise ConfigError(f"--quantization: {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
  if average_last < 1:
    raise ConfigError(f"--average_last: must be at least 1, got {average_last}")
  if not storage.is_dir(workdir):
    raise ConfigError(f"--workdir {workdir} does not exist")
  config = checkpoints.load_run_config(workdir)
  config_lib.validate(config)
  check_exportable(config)
  if storage.exists(storage.join(out, "model.bin")) and not force:
    raise ConfigError(f"--out {out} already holds a model.bin; pass --force to replace it")
  if not checkpoints.steps_on_disk(workdir):
    raise ConfigError(f"{checkpoints.checkpoint_dir(workdir)} holds no checkpoint")
  return config


def _export_record(
  config: ml_collections.ConfigDict, workdir: str, exported: Exported, tokens: list[str]
) -> dict[str, Any]:
  """EXPORT_RECORD_NAME's contents: where the model came from and how it should be run."""
  return {
    "workdir": storage.join(workdir),
    "step": exported.step,
    "average_last": exported.average_last,
    "quantization": exported.quantization,
    "ctranslate2": ctranslate2.__version__,
    "decoder_only": exported.decoder_only,
    # What the run's own search uses (config/schema.py); the README passes them to the engine.
    "never_generated": [tokens[i] for i in NEVER_GENERATED],
    "max_len": config.max_len,
    "max_decode_extra_len": config.max_decode_extra_len,
    "beam_size": config.beam_size,
    "length_penalty_alpha": config.length_penalty_alpha,
  }


_FLAG_VALUES = cli.program_flags(__name__)  # absl's only when run as a program
_WORKDIR = flags.DEFINE_string("workdir", None, "The trained run.", flag_values=_FLAG_VALUES)
_OUT = flags.DEFINE_string(
  "out", None, "The CTranslate2 model directory to write.", flag_values=_FLAG_VALUES
)
_STEP = flags.DEFINE_integer(
  "step", None, "Checkpoint step (default: the newest).", flag_values=_FLAG_VALUES
)
_AVERAGE_LAST = flags.DEFINE_integer(
  "average_last",
  1,
  "Export the mean of the last K checkpoints (up to --step).",
  flag_values=_FLAG_VALUES,
)
_QUANTIZATION = flags.DEFINE_string(
  "quantization",
  "float32",
  f"How the weights are stored: {', '.join(QUANTIZATIONS)}.",
  flag_values=_FLAG_VALUES,
)
_FORCE = flags.DEFINE_bool(
  "force", False, "Replace a model already in --out.", flag_values=_FLAG_VALUES
)


def main(argv):
  del argv
  try:
    if not _WORKDIR.value or not _OUT.value:
      raise ConfigError("--workdir and --out are required")
    exported = export_run(
      _WORKDIR.value,
      _OUT.value,
      step=_STEP.value,
      average_last=_AVERAGE_LAST.value,
      quantization=_QUANTIZATION.value,
      force=_FORCE.value,
    )
  except (ConfigError, OSError, checkpoints.CheckpointError, storage.StorageTimeout) as e:
    cli.exit_with_error(e)  # at once after a stalled read: its thread is still blocked
  engine = "Generator" if exported.decoder_only else "Translator"
  print(
    f"wrote {_which(exported)} of {_WORKDIR.value} as a {exported.quantization} CTranslate2 "
    f"model to {exported.out}: ctranslate2.{engine}({exported.out!r}); its README.md shows "
    "how to translate with it"
  )


if __name__ == "__main__":
  cli.run(main)
