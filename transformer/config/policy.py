"""The "auto" choices of model.dtype and model.attention_kernel, per platform."""

from __future__ import annotations

import ml_collections

from transformer.config.schema import AUTO, ConfigError

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
