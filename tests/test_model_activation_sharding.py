"""Activations sharded by design: the model's `activation_*` constraints on real meshes.

A small model's training step is compiled for the 8 fake CPU devices of
tests/conftest.py (transformer/tools/memory.py lowers it), and XLA's memory analysis
and partitioned HLO are read back. Without the constraints XLA follows the parameters'
shardings: on an fsdp mesh the residual stream is split along d_model, and every device
keeps the whole batch, which the memory and HLO checks here catch.
"""

import functools
import re

import jax
import ml_collections
import numpy as np
import pytest

from transformer import config as config_lib
from transformer.inference import sharding
from transformer.model import decoding
from transformer.tools import memory
from transformer.training import state

ROWS, LENGTH = 32, 32  # the global batch of every compiled step
D, F, V = 64, 256, 512  # d_model, d_ff, vocab_size of the small model


def small_config(**model) -> ml_collections.ConfigDict:
  config = config_lib.base_config()
  config.vocab_size = V
  config.model.update(num_layers=1, d_model=D, d_ff=F, num_heads=8, d_k=8, d_v=8)
  config.model.update(model)
  return config


@functools.cache
def lowered_step(sizes: tuple[int, int, int]):
  """(setup, lowered, compiled) train step of the small model on a data,fsdp,tensor mesh."""
  run, lowered = memory.lower_train_step(small_config(), sizes, ROWS, LENGTH)
  return run, lowered, lowered.compile()


def _bytes(sizes, kind: str) -> int:
  return getattr(lowered_step(sizes)[2].memory_analysis(), f"{kind}_size_in_bytes")


def _matmul_shapes(hlo: str) -> set[str]:
  """The f32 result shapes of a partitioned HLO module's dots (its matmuls), per device:
  an activation's matmul has its rows and positions flattened, e.g. 'f32[128,256]'. Only
  dots: the other instructions a module shows depend on how the backend fuses them."""
  return set(re.findall(r"= (f32\[[\d,]+\])\{[\d,]*\} dot\(", hlo))


@pytest.mark.parametrize("sizes", [(1, 8, 1), (1, 1, 8), (2, 2, 2)])
def test_state_bytes_per_device_fall_as_one_over_fsdp_times_tensor(sizes):
  """Parameters and Adam moments (the step's arguments) split over fsdp x tensor.

  The tolerance covers what stays whole: LayerNorm and bias vectors on a tensor mesh, the
  step counter and the batch.
  """
  _, fsdp, tensor = sizes
  replicated = _bytes((8, 1, 1), "argument")
  split = _bytes(sizes, "argument")
  assert replicated / (fsdp * tensor) <= split <= 1.15 * replicated / (fsdp * tensor)


def test_fsdp_splits_activations_by_rows_as_data_does():
  """At an equal global batch fsdp=8 holds what data=8 holds: 1/8 of the rows.

  Left to propagation (no constraints) the fsdp step follows the weights, whose d_model
  is split over fsdp, keeps every row on every device and needs 2.5x the temporaries.
  """
  assert _bytes((1, 8, 1), "temp") <= 1.1 * _bytes((8, 1, 1), "temp")


def test_temporaries_fall_as_tensor_grows():
  """Rows stay whole on every device of a tensor mesh, as on one device, but heads, d_ff
  and the vocabulary split 8 ways (d_model does not: the residual stream is whole)."""
  assert _bytes((1, 1, 8), "temp") < 0.5 * _bytes((1, 1, 1), "temp")


def test_compiled_activations_carry_the_designed_sharding():
  """Per-device matmuls: rows split over fsdp, d_ff and vocabulary over tensor."""
  tokens = ROWS * LENGTH  # the matmuls' flattened rows x positions
  fsdp = _matmul_shapes(lowered_step((1, 8, 1))[2].as_text())
  assert f"f32[{tokens // 8},{D}]" in fsdp  # projections of the residual stream: 1/8 of rows
  assert f"f32[{tokens // 8},{F}]" in fsdp  # FFN hidden layer
  # What propagation alone does on fsdp: whole rows (d_model split 8 ways) in every matmul.
  assert not [shape for shape in fsdp if shape.startswith(f"f32[{tokens},")], fsdp

  tensor = _matmul_shapes(lowered_step((1, 1, 8))[2].as_text())
  assert {f"f32[{tokens},{F // 8}]", f"f32[{tokens},{V // 8}]"} <= tensor
  assert not {f"f32[{tokens},{F}]", f"f32[{tokens},{V}]"} & tensor, tensor


def _constraints(text: str) -> list[str]:
  """The sharding constraints of a lowered (StableHLO + Shardy) module."""
  return re.findall(r"sdy\.sharding_constraint %\S+ <@mesh, (\[.*?\])>", text)


def test_constraints_name_the_rules_mesh_axes_and_vanish_outside_them():
  """Under the rules: rows over (data, fsdp) and the FFN hidden layer's d_ff over tensor;
  the embedding table as the lookup reads it, vocab over tensor and d_model whole.

  Traced with no rules in context (unit tests, or a caller that never enters
  `activation_sharding`), the same model carries no constraint at all.
  """
  run, lowered, _ = lowered_step((2, 2, 2))
  constraints = _constraints(lowered.as_text())
  assert constraints
  table = '[{"tensor"}, {}]'
  assert table in constraints
  assert all(c.startswith('[{"data", "fsdp"}') for c in constraints if c != table)
  assert '[{"data", "fsdp"}, {}, {"tensor"}]' in constraints  # [B, L, F] and [B, L, V]

  step = jax.jit(
    lambda params, batch: run.model.apply(
      {"params": params}, batch["source"], batch["decoder_input"]
    )
  )
  batch = memory.abstract_batch(
    run.config, ROWS, LENGTH, sharding.batch_sharding(run.mesh, run.rules)
  )
  assert not _constraints(step.lower(run.restore_target().params, batch).as_text())


@pytest.mark.parametrize(
  "model",
  [
    dict(scan_layers=True, remat="full"),
    dict(num_layers=2, remat="dots"),
    dict(decoder_only=True, tie_embeddings=False),
    dict(
      norm="pre", activation="swiglu", positional="rope", attention_kernel="xla", scan_layers=True
    ),
  ],
  ids=["scan-remat", "loop-remat", "decoder_only-untied", "pre-swiglu-rope-xla"],
)
def test_every_variant_traces_under_the_rules(model):
  """Scanned or looped layers, remat, decoder-only, untied, pre-LN, SwiGLU, RoPE, fused
  attention: the constraints trace on a 2x2x2 mesh (lowering; compiling is slow)."""
  _, lowered = memory.lower_train_step(small_config(**model), (2, 2, 2), ROWS, LENGTH)
  assert '[{"data", "fsdp"}, {}, {"tensor"}]' in _constraints(lowered.as_text())


@pytest.mark.parametrize("sizes", [(2, 1, 4), (1, 2, 4)])
def test_rbg_dropout_compiles_where_the_tensor_axis_holds_whole_activations(sizes):
  """rbg dropout masks are drawn a part per device (primitives.keep_mask) by a device's
  index. The residual stream is whole on the tensor axis: were that axis left to XLA,
  the partitioner would refuse the index (PartitionId) once the step has six layers."""
  config = small_config(num_layers=6)
  config.dropout_rng_impl = "rbg"
  _, lowered = memory.lower_train_step(config, sizes, ROWS, LENGTH)
  memory_use = lowered.compile().memory_analysis()
  assert memory_use.temp_size_in_bytes > 0


def test_beam_search_under_the_rules_finds_the_same_translations():
  """batch * beam rows through the cache (self-attention K/V buffers, cross K/V, one token
  per step; scanned, so with a leading layer axis) on a 2x2x2 mesh: constrained, the
  search returns what it returns unconstrained."""
  config = memory.mesh_config(small_config(scan_layers=True), (2, 2, 2))
  run = state.setup(config)
  params = run.init_state(jax.random.key(0)).params
  source = np.random.default_rng(0).integers(4, V, (4, 7), dtype=np.int32)
  source[:, -1] = config_lib.EOS_ID
  source = sharding.global_batch({"source": source}, run.mesh, run.rules)["source"]
  prompts = decoding.translation_prompts(source, 4, False)
  search = decoding.BeamSearch(beam_size=2, alpha=0.6)

  with sharding.activation_sharding(run.mesh, run.rules):
    lowered = decoding.lower_decode(run.model, params, prompts, search)
    assert _constraints(lowered.as_text())
    constrained = decoding.decode(run.model, params, prompts, search)
  unconstrained = decoding.decode(run.model, params, prompts, search)
  np.testing.assert_array_equal(constrained.tokens_BxO, unconstrained.tokens_BxO)
  np.testing.assert_allclose(constrained.scores_B, unconstrained.scores_B, rtol=1e-5)
