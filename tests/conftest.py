"""Test-wide setup: eight fake CPU devices, so meshes and sharding are exercised here, and
the compiler flags of tests/helpers/processes.py.

Set before JAX is imported anywhere. Tests that need a real process boundary (kill,
preemption, several hosts) start subprocesses with their own environment.
"""

import os
import shutil
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
  sys.path.insert(0, REPO_ROOT)

from tests.helpers import processes  # noqa: E402  (no JAX in it)

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's CPU compiler flags and fake devices are for CPU runs (all of CI's): a run
# on a GPU (bench/gpu.sh: JAX_PLATFORMS=cuda,cpu) compiles with XLA's own flags, which
# those, CPU-only and version-bound, could make it refuse.
_ON_CPU = os.environ["JAX_PLATFORMS"] == "cpu"
_FLAGS_SET = processes.TEST_XLA_FLAGS in os.environ.get("XLA_FLAGS", "")  # xdist's workers inherit
if _ON_CPU and not _FLAGS_SET:
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " " + processes.xla_flags(devices=8)
  ).strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# One persistent compilation cache for the whole run, made by the first process that
# loads this file (pytest, or xdist's controller) and inherited through the environment
# by the workers and every process they start (train.py, eval.py, the multi-host jobs):
# the suite compiles the same small programs in dozens of processes, and a hit skips
# XLA's compile. JAX reads the variable itself; the directory goes at the session's end.
_OWN_COMPILATION_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _OWN_COMPILATION_CACHE = tempfile.mkdtemp(prefix="transformer-tests-jax-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_COMPILATION_CACHE

import pytest  # noqa: E402  (after the environment is set)

from tests.helpers import durations  # noqa: E402


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
  """(tsv path, vocabulary cache dir) shared by the end-to-end tests."""
  from tests.helpers import tiny_run

  path = tiny_run.write_small_corpus(str(tmp_path_factory.mktemp("corpus")))
  return path, str(tmp_path_factory.mktemp("vocab"))


@pytest.fixture(scope="session")
def trained_run(small_corpus, tmp_path_factory):
  """(config, workdir) of a tiny run with checkpoints at tiny_run.TRAINED_RUN_STEPS, shared
  by the tests that evaluate, translate or average a run and leave it as it is."""
  from tests.helpers import tiny_run
  from transformer.training import loop

  workdir = str(tmp_path_factory.mktemp("run"))
  first, last = tiny_run.TRAINED_RUN_STEPS
  config = tiny_run.make_config(
    small_corpus, num_train_steps=last, checkpoint_every_steps=first, max_decode_extra_len=5
  )
  loop.train_and_evaluate(config, workdir)
  return config, workdir


def pytest_addoption(parser):
  durations.addoption(parser)


def pytest_configure(config):
  # Files run longest first, and tests measured as slow carry the `slow` marker
  # (`make test-fast` leaves them out): from tests/durations.json and durations_fast.json.
  durations.register(config)


def pytest_sessionfinish(session, exitstatus):
  if _OWN_COMPILATION_CACHE is not None:
    shutil.rmtree(_OWN_COMPILATION_CACHE, ignore_errors=True)


# The local GCS fake's fixtures, for every test file that asks for a bucket.
from tests.helpers.gcs_fake import gcs, gcs_server  # noqa: E402, F401
