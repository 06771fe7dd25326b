"""What a config builds, without building it: parameters, FLOPs, mesh (`--dry_run`)."""

from __future__ import annotations

import jax
import ml_collections

from transformer.config import MESH_AXES
from transformer.inference import model_setup, sharding
from transformer.model import ModelConfig
from transformer.training import flops


def count_params(config: ml_collections.ConfigDict) -> int:
  """Parameters of the model (a tied embedding counted once), from shapes alone."""
  model = model_setup.build_model(config)
  inputs = model_setup.dummy_inputs(config)
  shapes = jax.eval_shape(
    lambda: model.init(jax.random.key(0), inputs["source"], inputs["decoder_input"])
  )
  return sum(x.size for x in jax.tree.leaves(shapes["params"]))


def describe(config: ml_collections.ConfigDict) -> dict:
  model_config = ModelConfig.from_config(config)
  ici, dcn = sharding.mesh_shape(config, jax.device_count())
  m = config.model
  return {
    "num_params": count_params(config),
    "flops_per_token": flops.training_flops_per_target_token(model_config, config.max_len),
    "flops_seq_len": config.max_len,
    "dataset": config.dataset,
    "direction": config.direction,
    "vocab_size": config.vocab_size,
    "num_layers": m.num_layers,
    "d_model": m.d_model,
    "d_ff": m.d_ff,
    "num_heads": m.num_heads,
    "d_k": m.d_k,
    "d_v": m.d_v,
    "positional": m.positional,
    "norm": m.norm,
    "decoder_only": m.decoder_only,
    # As this process runs them: an "auto" of the config resolved for its platform.
    "dtype": model_config.dtype.name,
    "attention_kernel": model_config.attention_kernel,
    "mesh": {axis: ici[i] * dcn[i] for i, axis in enumerate(MESH_AXES)},
    "num_devices": jax.device_count(),
  }
