"""host_memory: freed blocks stay in the process, so reusing them faults no new pages;
the commands apply it, an import of the package does not."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.tiny_run import REPO

# Allocates, touches and frees 256 MB twice from a fresh thread (XLA:CPU's step buffers
# come from its worker threads) and prints the page faults of the second time.
_TOUCH_TWICE = """
import ctypes, resource, threading
from transformer import host_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 256 << 20
def touch():
  block = libc.malloc(SIZE)
  ctypes.memset(block, 1, SIZE)
  libc.free(block)
faults = []
def worker():
  touch()
  before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
  touch()
  faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
thread = threading.Thread(target=worker)
thread.start(); thread.join()
print(host_memory.retained(), faults[0])
"""
_REFAULTS = (
  "from transformer import host_memory\nhost_memory.retain_freed_memory()\n" + _TOUCH_TWICE
)


def _second_touch(retain: str, platforms: str = "cpu") -> tuple[str, int]:
  env = dict(os.environ, TRANSFORMER_RETAIN_FREED_MEMORY=retain, JAX_PLATFORMS=platforms)
  out = subprocess.run(
    [sys.executable, "-c", _REFAULTS], cwd=REPO, env=env, capture_output=True, text=True, check=True
  ).stdout.split()
  return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator only")
def test_a_freed_block_is_reused_without_new_page_faults():
  applied, faults = _second_touch("1")
  assert applied == "True"
  # 256 MB is 65,536 pages of 4 KB: reused memory faults in (almost) none of them.
  assert faults < 1_000, faults
  # glibc's defaults return the block to the kernel, so every page faults in again
  # (or every 2 MB page, where the kernel backs it with huge pages).
  default_applied, default_faults = _second_touch("0")
  assert default_applied == "False"
  assert default_faults >= 100, default_faults


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator only")
def test_only_a_cpu_process_keeps_freed_memory_unless_asked():
  """On a GPU or TPU the step's buffers live on the device: glibc's defaults stay, so
  the input pipeline's threads keep their own arenas. TRANSFORMER_RETAIN_FREED_MEMORY=1
  applies the settings anyway."""
  assert _second_touch("", platforms="cpu")[0] == "True"
  applied, faults = _second_touch("", platforms="cuda,cpu")
  assert applied == "False" and faults >= 100, faults
  applied, faults = _second_touch("1", platforms="tpu")
  assert applied == "True" and faults < 1_000, faults


# Imports the model as a notebook or a sweep file would, then reports what changed: the
# environment, whether the allocator settings were applied, how often the installed
# distributions were listed, and the page faults of reusing a freed 256 MB block.
_IMPORT_ONLY = (
  """
import importlib.metadata, json, os, sys
listed = []  # by the package's own modules (JAX lists them too, as it is imported)
_distributions = importlib.metadata.distributions
def distributions(*args, **kwargs):
  caller = os.path.abspath(sys._getframe(1).f_code.co_filename)
  if caller.startswith(os.path.join(os.getcwd(), "transformer", "")):
    listed.append(caller)
  return _distributions(*args, **kwargs)
importlib.metadata.distributions = distributions
environment = dict(os.environ)
import transformer.model
from transformer import host_memory
changed = sorted(k for k in set(environment) | set(os.environ)
                 if environment.get(k) != os.environ.get(k))
print(json.dumps({"changed": changed, "retained": host_memory.retained(),
                  "distributions_listed": listed}))
"""
  + _TOUCH_TWICE
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator only")
def test_importing_the_model_leaves_the_process_as_it_was():
  """On the CPU, where a command would apply the settings: the import applies none,
  lists no installed distributions and sets no environment variable."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("TRANSFORMER_RETAIN_FREED_MEMORY", None)
  lines = subprocess.run(
    [sys.executable, "-c", _IMPORT_ONLY],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    check=True,
  ).stdout.splitlines()
  report = json.loads(lines[0])
  assert report == {"changed": [], "retained": False, "distributions_listed": []}, report
  applied, faults = lines[1].split()
  assert applied == "False" and int(faults) >= 100, lines


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator only")
def test_a_command_applies_the_settings_before_its_main():
  """cli.run, which every command's main goes through, applies them on the CPU."""
  command = (
    "from transformer import cli, host_memory\n"
    "cli.run(lambda argv: print('retained', host_memory.retained()))\n"
  )
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("TRANSFORMER_RETAIN_FREED_MEMORY", None)
  out = subprocess.run(
    [sys.executable, "-c", command], cwd=REPO, env=env, capture_output=True, text=True, check=True
  ).stdout
  assert out.split() == ["retained", "True"], out
