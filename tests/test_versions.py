"""versions.py: the exact library versions each record carries, and the records that do."""

import importlib.metadata
import json
import os
import platform

from transformer import versions
from transformer.evaluation import score, translate
from transformer.training import checkpoints


def test_library_versions_are_the_installed_ones():
  found = versions.library_versions()
  assert list(found) == [
    "python",
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "tensorflow",
  ]
  assert found["python"] == platform.python_version()
  for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint"):
    assert found[name] == importlib.metadata.version(name)
  # TensorFlow's CPU-only wheel is another distribution of the same package.
  import tensorflow as tf

  assert found["tensorflow"] == tf.__version__


def test_a_missing_library_is_none(monkeypatch):
  monkeypatch.setitem(versions.DISTRIBUTIONS, "tensorflow", ("no-such-distribution",))
  assert versions.library_versions()["tensorflow"] is None


def test_a_run_and_its_evaluation_record_the_versions(trained_run):
  """config.json holds them beside the config; reading the run's config leaves them out,
  and eval's scores (the .json beside the hypotheses) hold them too."""
  _, workdir = trained_run
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    assert json.load(f)["versions"] == versions.library_versions()
  config = checkpoints.load_run_config(workdir)
  assert "versions" not in config
  translator = translate.Translator(config, workdir)
  results = score.evaluate_split(translator, "validation")
  with open(results["path"], encoding="utf-8") as f:
    assert json.load(f)["versions"] == versions.library_versions()
