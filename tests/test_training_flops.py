"""Model FLOPs against hand counts and the traced program, and device peaks."""

import json
import math
import socket
import time
import types
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer import config as config_lib
from transformer.data import batching
from transformer.model import ModelConfig, Transformer
from transformer.training import describe, flops

# Sizes all different, so a swapped pair in a formula changes the count.
V, D, F, H, K, E, N = 40, 12, 20, 3, 4, 5, 2
S, T = 7, 9  # source and target lengths


def tiny(**overrides) -> ModelConfig:
  fields = dict(
    vocab_size=V, max_position=16, num_layers=N, d_model=D, d_ff=F, num_heads=H, d_k=K, d_v=E
  )
  return ModelConfig(**{**fields, **overrides})


def matmul(m, n, k):
  """FLOPs of an [m, k] @ [k, n] product: one multiply and one add per term."""
  return 2 * m * n * k


def hand_count(decoder_only=False, ffn_matrices=2):
  """The forward pass of one sentence pair, matmul by matmul, as the paper describes it."""

  def self_attention(length):
    return (
      matmul(length, H * K, D) * 2
      + matmul(length, H * E, D)  # W_Q, W_K, W_V
      + H * matmul(length, length, K)  # Q K^T per head
      + H * matmul(length, E, length)  # softmax(.) V per head
      + matmul(length, D, H * E)
    )  # W_O

  def ffn(length):
    return ffn_matrices * matmul(length, F, D)  # W_1 (and the SwiGLU gate), W_2 alike

  cross_attention = (
    matmul(T, H * K, D)  # queries from the decoder
    + matmul(S, H * K, D)
    + matmul(S, H * E, D)  # keys, values: encoder output
    + H * matmul(T, S, K)
    + H * matmul(T, E, S)
    + matmul(T, D, H * E)
  )
  encoder_layer = self_attention(S) + ffn(S)
  decoder_layer = self_attention(T) + ffn(T) + (0 if decoder_only else cross_attention)
  output_projection = matmul(T, V, D)
  return (0 if decoder_only else N * encoder_layer) + N * decoder_layer + output_projection


def traced_matmul_flops(cfg: ModelConfig, attention_maps: bool = False) -> int:
  """2 x multiply-adds of every dot_general in the model's forward program (batch 1);
  with `attention_maps`, of the program that also returns them (which forms the
  attention weights, as the model's arithmetic has them)."""
  model = Transformer(cfg)
  source = None if cfg.decoder_only else jnp.ones((1, S), jnp.int32)
  decoder_input = jnp.ones((1, T), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), source, decoder_input))
  mutable = ["intermediates"] if attention_maps else False
  jaxpr = jax.make_jaxpr(lambda p: model.apply(p, source, decoder_input, mutable=mutable))(
    params
  ).jaxpr
  return _count_dots(jaxpr)


def ones_column_flops(cfg: ModelConfig) -> int:
  """What V's column of ones adds per attention (attention_kernels.
  softmax_attention_with_ones): one more projected feature per head over the keys'
  length, and one more column of the P V matmul."""
  layers, heads, d_model = cfg.num_layers, cfg.num_heads, cfg.d_model

  def attention(queries, keys):
    return matmul(keys, heads, d_model) + heads * matmul(queries, 1, keys)

  decoder = attention(T, T) + (0 if cfg.decoder_only else attention(T, S))
  return layers * (decoder + (0 if cfg.decoder_only else attention(S, S)))


def _count_dots(jaxpr) -> int:
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (lhs_contract, _), _ = eqn.params["dimension_numbers"]
      lhs_shape = eqn.invars[0].aval.shape
      total += (
        2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs_shape[i] for i in lhs_contract)
      )
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          total += _count_dots(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          total += _count_dots(sub)
  return total


def test_forward_flops_equal_the_hand_count():
  assert flops.forward_flops(tiny(), S, T) == hand_count()


@pytest.mark.parametrize(
  "overrides",
  [
    {},
    {"decoder_only": True},
    {"activation": "swiglu"},
    {"tie_embeddings": False},
    {"positional": "rope", "norm": "pre"},
    {"num_layers": 1, "d_k": 6, "d_v": 2},
  ],
  ids=["paper", "decoder_only", "swiglu", "untied", "rope-pre", "one-layer"],
)
def test_forward_flops_equal_the_matmuls_of_the_traced_model(overrides):
  """Every dot_general XLA is given, counted from the program itself: the model's as
  it forms the attention weights, and, without them, those plus V's ones column, which
  sums the softmax in the P V matmul (hardware work the model's FLOPs leave out)."""
  cfg = tiny(**overrides)
  assert flops.forward_flops(cfg, S, T) == traced_matmul_flops(cfg, attention_maps=True)
  assert traced_matmul_flops(cfg) == flops.forward_flops(cfg, S, T) + ones_column_flops(cfg)


def test_decoder_only_drops_the_encoder_and_cross_attention():
  full, decoder_only = tiny(), tiny(decoder_only=True)
  assert flops.forward_flops(decoder_only, S, T) == hand_count(decoder_only=True)
  # What goes: N encoder layers over S tokens, and N cross-attentions.
  encoder = N * (
    4 * S * D * H * K
    + 2 * S * D * H * E
    + 2 * S * S * H * (K + E)
    + 2 * S * H * E * D
    + 4 * S * D * F
  )
  cross = N * (
    2 * T * D * H * K + 2 * S * D * H * (K + E) + 2 * T * S * H * (K + E) + 2 * T * H * E * D
  )
  assert flops.forward_flops(full, S, T) - flops.forward_flops(decoder_only, S, T) == (
    encoder + cross
  )
  # The source length no longer matters.
  assert flops.forward_flops(decoder_only, 1, T) == flops.forward_flops(decoder_only, 50, T)


def test_swiglu_has_three_ffn_matrices():
  relu, swiglu = tiny(), tiny(activation="swiglu")
  assert flops.forward_flops(swiglu, S, T) == hand_count(ffn_matrices=3)
  # One more D x F matrix per FFN: in N encoder layers over S and N decoder layers over T.
  assert flops.forward_flops(swiglu, S, T) - flops.forward_flops(relu, S, T) == (
    N * (S + T) * 2 * D * F
  )
  assert flops.forward_flops(tiny(activation="gelu"), S, T) == flops.forward_flops(relu, S, T)


def test_training_is_three_forward_passes_per_sentence_pair():
  cfg = tiny()
  forward = flops.forward_flops(cfg, S, T)
  assert flops.training_flops(cfg, 1, S, T) == 3 * forward
  assert flops.training_flops(cfg, 5, S, T) == 3 * 5 * forward
  per_token = flops.training_flops_per_target_token(cfg, T)
  assert per_token == pytest.approx(3 * flops.forward_flops(cfg, T, T) / T)


def test_flops_match_the_papers_estimate():
  """6 x (non-embedding params + output projection) + 12 L d (S + 2T) per token pair."""
  config = config_lib.load_config("configs/wmt14.py:base")
  cfg = ModelConfig.from_config(config)
  seq = 256
  embedding = config.vocab_size * cfg.d_model
  non_embedding = describe.count_params(config) - embedding
  estimate = 6 * (non_embedding + embedding) + 12 * cfg.num_layers * cfg.d_model * 3 * seq
  exact = flops.training_flops_per_target_token(cfg, seq)
  assert abs(exact / estimate - 1) < 0.01


@pytest.fixture(autouse=True)
def own_cpu_peak_file(monkeypatch, tmp_path):
  """Each test keeps its CPU peak in a file of its own, never the user's."""
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  monkeypatch.setattr(flops, "_measured_cpu_peak", None)


def test_the_cpu_peak_is_measured_once_per_machine_and_kept(monkeypatch):
  """A peak measured at every start moves with the machine's load, and MFU with it."""
  monkeypatch.setattr(flops, "measure_matmul_peak", lambda: 7.0)
  assert flops.device_peak_flops() == 7.0
  with open(flops.cpu_peak_file()) as f:
    kept = json.load(f)
  assert [entry["flops_per_s"] for entry in kept.values()] == [7.0]
  # A new process (nothing in memory) reads the kept figure rather than measuring.
  monkeypatch.setattr(flops, "_measured_cpu_peak", None)
  monkeypatch.setattr(flops, "measure_matmul_peak", lambda: pytest.fail("measured again"))
  assert flops.device_peak_flops() == 7.0
  assert flops.peak_source() == (
    f"f32 matmul measured on this machine, kept in {flops.cpu_peak_file()}"
  )


def test_a_utilisation_above_the_peak_is_never_printed_as_a_percentage():
  assert flops.utilisation_text("MFU", 0.381) == "MFU 38.1%"
  assert flops.utilisation_text("MFU", None) == "MFU n/a"
  assert flops.utilisation_text("MFU", 1.22) == (
    "MFU n/a (above the peak: set config.peak_flops_per_device)"
  )


def test_device_peak_on_cpu_is_measured_once_and_positive():
  """The number is a measurement, so only its sign and its caching are pinned."""
  device = jax.devices()[0]
  assert device.platform == "cpu"
  peak = flops.device_peak_flops(device)
  assert math.isfinite(peak) and peak > 0
  assert flops.device_peak_flops() == peak  # measured once, then remembered
  # Fake CPU devices share the cores: the whole job's peak is the one measured peak.
  assert jax.device_count() == 8
  assert flops.total_peak_flops() == peak


@pytest.mark.parametrize(
  "hostnames,machines",
  [(["a", "b", "c", "d"], 4), (["a", "a", "b", "b"], 2), (["a", "a", "a", "a"], 1)],
)
def test_cpu_peak_counts_every_machine_of_the_job(monkeypatch, hostnames, machines):
  """Processes on separate machines each have their own cores; on one machine they share
  them. The FLOPs counted are the whole job's, so the peak is per machine times machines."""
  monkeypatch.setattr(flops, "_measured_cpu_peak", 3.0)
  monkeypatch.setattr(flops, "_host_count", None)
  monkeypatch.setattr(jax, "process_count", lambda: len(hostnames))
  gathered = []

  def allgather(local):  # what every process would contribute: its host name's hash
    gathered.append(int(local))
    return np.array([zlib.crc32(name.encode()) for name in hostnames], np.int64)

  monkeypatch.setattr(flops.multihost_utils, "process_allgather", allgather)
  assert flops.total_peak_flops() == 3.0 * machines
  assert flops.total_peak_flops() == 3.0 * machines  # gathered once, then kept
  assert gathered == [zlib.crc32(socket.gethostname().encode())]


def test_measure_matmul_peak_keeps_measuring_for_its_minimum_time():
  # The first runs of a process read slow; the best of runs over min_seconds does not.
  began = time.perf_counter()
  peak = flops.measure_matmul_peak(size=64, min_repeats=2, min_seconds=0.3)
  assert time.perf_counter() - began >= 0.3
  assert peak > 0


def test_remeasuring_the_cpu_peak_keeps_the_higher_reading(monkeypatch):
  monkeypatch.setattr(flops, "measure_matmul_peak", lambda: 5.0)
  monkeypatch.setattr(flops, "_measured_cpu_peak", 2.0)  # a reading taken at a slow moment
  assert flops.total_peak_flops() == 2.0  # measured once per process ...
  assert flops.total_peak_flops(remeasure=True) == 5.0  # ... unless asked again
  assert flops.device_peak_flops() == 5.0
  monkeypatch.setattr(flops, "_measured_cpu_peak", 9.0)
  assert flops.total_peak_flops(remeasure=True) == 9.0 and flops.device_peak_flops() == 9.0


@pytest.mark.parametrize(
  "kind,peak",
  [
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v6 lite", 918e12),
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA A100-SXM4-40GB", 312e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
  ],
)
def test_accelerator_peaks_come_from_the_table(kind, peak):
  device = types.SimpleNamespace(device_kind=kind, platform="tpu" if "TPU" in kind else "gpu")
  assert flops.device_peak_flops(device) == peak


@pytest.mark.parametrize(
  "kind,peak",
  [
    ("NVIDIA L4", 121e12),
    ("NVIDIA L40", 181e12),
    ("NVIDIA L40S", 362e12),
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12),
  ],
)
def test_peaks_match_the_whole_device_kind(kind, peak):
  """Substrings once judged an L40S as an L4 (3x the MFU) and a PCIe H100 as an SXM one."""
  device = types.SimpleNamespace(device_kind=kind, platform="gpu")
  assert flops.device_peak_flops(device) == peak


@pytest.mark.parametrize(
  "kind", ["Mystery Accelerator 9000", "NVIDIA L4 Super", "nvidia l4", "NVIDIA H100"]
)
def test_unknown_device_kind_has_no_peak_and_says_so_once(kind, monkeypatch):
  notes = []
  monkeypatch.setattr(flops.logging, "warning", lambda *args: notes.append(args[0] % args[1:]))
  monkeypatch.setattr(flops, "_noted_unknown", set())
  device = types.SimpleNamespace(device_kind=kind, platform="gpu")
  assert flops.device_peak_flops(device) is None
  assert flops.device_peak_flops(device) is None
  assert len(notes) == 1 and repr(kind) in notes[0] and "_KNOWN_PEAKS" in notes[0]


def test_a_configured_peak_replaces_the_table_and_the_measurement(monkeypatch):
  """config.peak_flops_per_device: for a kind the table lacks, and instead of the CPU's
  measurement, which is then never taken. It is one device's, as its help says, so the
  job's total counts devices, on CPU too (fake devices included)."""
  monkeypatch.setattr(flops, "_measured_cpu_peak", None)
  monkeypatch.setattr(flops, "measure_matmul_peak", lambda: pytest.fail("measured"))
  for kind, platform in (("Mystery Accelerator 9000", "gpu"), ("TPU v4", "tpu"), ("cpu", "cpu")):
    device = types.SimpleNamespace(device_kind=kind, platform=platform)
    assert flops.device_peak_flops(device, configured=7e12) == 7e12
  assert flops.total_peak_flops(configured=7e12) == 7e12 * jax.device_count()
  assert flops.total_peak_flops(remeasure=True, configured=7e12) == 7e12 * jax.device_count()


def test_unknown_device_has_no_total_peak_and_no_utilisation(monkeypatch):
  device = types.SimpleNamespace(device_kind="Mystery Accelerator 9000", platform="gpu")
  monkeypatch.setattr(flops.jax, "devices", lambda: [device])
  monkeypatch.setattr(flops.jax, "device_count", lambda: 4)
  assert flops.total_peak_flops() is None
  assert flops.utilisation(1e12, 1.0, None) is None
  known = types.SimpleNamespace(device_kind="NVIDIA L4", platform="gpu")
  monkeypatch.setattr(flops.jax, "devices", lambda: [known])
  assert flops.total_peak_flops() == 4 * 121e12


# --- Real tokens (MFU) against padded shapes (HFU).


def padded(lengths, width):
  """Rows of real tokens (ids >= 4) then padding, one row per length."""
  rows = np.zeros((len(lengths), width), np.int32)
  for row, n in enumerate(lengths):
    rows[row, :n] = 7
  return rows


def test_count_tokens_of_length_bucketed_rows():
  """One sentence pair per row: its real tokens, whatever the padded width."""
  src, tgt = [7, 3, 1], [4, 9, 2]
  counts = jax.device_get(flops.count_tokens({"source": padded(src, 8), "target": padded(tgt, 10)}))
  assert counts == {
    "source_tokens": 11,
    "target_tokens": 15,
    "source_sq": 49 + 9 + 1,
    "target_sq": 16 + 81 + 4,
    "source_target": 28 + 27 + 2,
    "source_slots": 24,
    "target_slots": 30,
  }


def test_count_tokens_of_packed_rows_pairs_segments_by_id():
  """Row 0 packs pairs (s, t) = (2, 3) and (3, 1); row 1 holds (1, 2) and padding."""
  source_segments = np.array([[1, 1, 2, 2, 2, 0], [1, 0, 0, 0, 0, 0]], np.int32)
  target_segments = np.array([[1, 1, 1, 2, 0], [1, 1, 0, 0, 0]], np.int32)
  batch = {
    "source": np.where(source_segments > 0, 9, 0).astype(np.int32),
    "target": np.where(target_segments > 0, 9, 0).astype(np.int32),
    "source_segment_ids": source_segments,
    "target_segment_ids": target_segments,
  }
  counts = jax.device_get(jax.jit(flops.count_tokens)(batch))
  assert counts == {
    "source_tokens": 6,
    "target_tokens": 6,
    "source_sq": 4 + 9 + 1,
    "target_sq": 9 + 1 + 4,
    "source_target": 6 + 3 + 2,
    "source_slots": 12,
    "target_slots": 10,
  }


def test_a_decoder_only_row_counts_its_prompt_as_decoder_tokens():
  """lm_loss=target zeroes the prompt in 'target'; the decoder still runs over it."""
  sequence = np.array([[5, 6, 7, 1, 8, 9, 1, 0, 0]], np.int32)  # source EOS target EOS pad
  loss_mask = np.array([[0, 0, 0, 0, 1, 1, 1, 0, 0]], np.int32)
  batch = batching.finalize({"target": sequence, "loss_mask": loss_mask})
  assert int(np.sum(batch["target"] != 0)) == 3  # only the target part has a loss
  counts = jax.device_get(flops.count_tokens(batch))
  assert counts["target_tokens"] == 7 and counts["target_sq"] == 49
  assert counts["source_tokens"] == 0 and counts["target_slots"] == 9


@pytest.mark.parametrize("decoder_only", [False, True])
def test_real_flops_are_the_sum_over_sentence_pairs(decoder_only):
  cfg = tiny(decoder_only=decoder_only)
  src, tgt = [5, 2, 6], [3, 8, 1]
  batch = {"target": padded(tgt, 8)}
  if not decoder_only:
    batch["source"] = padded(src, 7)
  real = flops.real_training_flops(cfg, jax.device_get(flops.count_tokens(batch)))
  # Each pair as if it were a batch of one at its own lengths: hand-checked above.
  assert real == sum(flops.training_flops(cfg, 1, s, t) for s, t in zip(src, tgt))
  assert real < flops.training_flops(cfg, 3, 7, 8)


def test_full_rows_need_what_the_padded_shape_computes():
  """No padding: MFU and HFU count the same FLOPs (the benchmark's case)."""
  cfg = tiny()
  counts = jax.device_get(
    flops.count_tokens({"source": padded([S] * 4, S), "target": padded([T] * 4, T)})
  )
  assert flops.real_training_flops(cfg, counts) == flops.training_flops(cfg, 4, S, T)
