"""Keeps freed host memory in the process, so XLA:CPU's per-step buffers are not re-faulted.

XLA:CPU allocates a step's temporary buffers (about a gigabyte for the Transformer-base
step of `configs/wmt14.py` at 16 x 64 tokens) with malloc when the step starts and frees
them when it ends. glibc serves blocks that large with mmap and returns them with munmap,
so every step maps fresh pages and the kernel zero-fills each of them on first touch:
hundreds of thousands of page faults per step, and the step slower for the kernel's time
(measured in docs/performance.md, "Freed host memory kept in the process"). Three glibc
settings keep the memory in the process instead, and the next step reuses it:

  M_ARENA_MAX=1      every thread allocates from the main heap. Other threads' arenas
                     cannot grow past 64 MB and fall back to mmap for larger blocks.
  M_MMAP_MAX=0       large blocks come from the heap, not from mmap.
  M_TRIM_THRESHOLD   -1: freed memory at the top of the heap is never returned.

The costs: the process keeps its peak heap for its lifetime, as with tcmalloc or jemalloc
(a higher peak resident memory), and threads contend for the one arena (the input
pipeline is slower, though still far faster than the step consumes; the training loop
and the bare step are faster with the settings: `bench --only train_loop`, recorded in
docs/performance.md).
So it applies only where JAX computes on the CPU, the only backend whose step buffers
are host memory: JAX_PLATFORMS names cpu first, or, with JAX_PLATFORMS unset, no GPU or
TPU plugin is installed. Every command applies it as it starts (`cli.run`, which train.py,
eval.py, the tools and the sweep runner run their main through), before JAX or TensorFlow
start the threads that allocate; importing the package leaves the allocator as it is, so
a notebook or a library user keeps glibc's defaults unless it calls
`retain_freed_memory()` itself. TRANSFORMER_RETAIN_FREED_MEMORY=0 keeps
glibc's defaults, =1 applies them on any backend. Other C libraries and platforms are
left as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import os
import platform

ENV_VAR = "TRANSFORMER_RETAIN_FREED_MEMORY"

# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

# Distributions that give JAX a GPU or TPU backend (name prefixes, lower case).
_ACCELERATOR_PLUGINS = ("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm", "libtpu")

_applied = False


def retained() -> bool:
  """Whether this process keeps freed memory (the settings took effect)."""
  return _applied


def computes_on_cpu() -> bool:
  """Whether JAX will run this process's computations on the CPU, decided without
  starting a backend: JAX_PLATFORMS's first entry, else no accelerator plugin installed."""
  platforms = os.environ.get("JAX_PLATFORMS", "").strip()
  if platforms:
    return platforms.split(",")[0].strip().lower() == "cpu"
  names = (dist.metadata["Name"] or "" for dist in importlib.metadata.distributions())
  return not any(name.lower().startswith(_ACCELERATOR_PLUGINS) for name in names)


def retain_freed_memory() -> bool:
  """Applies the three settings once per process; True if they are in effect.

  A no-op (False) off Linux glibc, where TRANSFORMER_RETAIN_FREED_MEMORY=0, or where JAX
  computes on a GPU or TPU (`computes_on_cpu`) unless TRANSFORMER_RETAIN_FREED_MEMORY=1.
  """
  global _applied
  if _applied:
    return True
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return False
  choice = os.environ.get(ENV_VAR, "")
  if choice == "0" or (choice != "1" and not computes_on_cpu()):
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  # mallopt returns 1 on success. The arena limit goes first: it only steers threads
  # that allocate after it, and the other two matter for the heap they then share.
  _applied = all(
    mallopt(param, value) == 1
    for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))
  )
  return _applied
