"""The environment of every process the suite runs: pytest's own (set by conftest) and
the train.py, eval.py and multi-host jobs that tests start.

Kept free of heavy imports: conftest reads it before JAX is imported.
"""

import os

# XLA's CPU backend without LLVM's optimisations, and with its older fusion emitters
# (LLVM IR written directly, not through MLIR). The suite's programs are tiny, so the time
# is in compiling them, not running them. Measured on tests/test_training_steps.py, the
# first two took 419 s of CPU to 177 s; the emitters then took seven tests of
# test_model_decoding.py and test_training_steps.py from 153 s of CPU to 102 s (see
# docs/development.md), all passing. Every process of the suite compiles with the same
# settings, so numbers compared across processes (a resumed run against an uninterrupted
# one, bit for bit) come from the same compiler. Users' runs keep XLA's defaults:
# nothing outside tests/ sets these.
TEST_XLA_FLAGS = (
  "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
  "--xla_cpu_use_fusion_emitters=false"
)


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a process of the suite with `devices` fake CPU devices."""
  return f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count={devices}"


def subprocess_env(devices: int = 1, **extra: str) -> dict[str, str]:
  """This process's environment for a child with `devices` CPU devices, plus `extra`."""
  env = dict(os.environ)
  env.update(XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu", **extra)
  return env
