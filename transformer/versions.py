"""The exact versions of the libraries that decide a run's numbers, for its records.

Two installs a month apart can compute different numbers; requirements/lock.txt pins
them, and every record says which it ran with: a run's config.json (key `versions`),
the JSON lines of bench, the memory tool and the sweeps, and eval.py's scores.
"""

from __future__ import annotations

import importlib.metadata
import platform

# Record key -> the distributions that provide it, the first one installed wins:
# TensorFlow installs as tensorflow-cpu on CPU-only machines.
DISTRIBUTIONS = {
  "jax": ("jax",),
  "jaxlib": ("jaxlib",),
  "flax": ("flax",),
  "optax": ("optax",),
  "orbax-checkpoint": ("orbax-checkpoint",),
  "tensorflow": ("tensorflow", "tensorflow-cpu"),
}


def library_versions() -> dict[str, str | None]:
  """{"python": "3.11.7", "jax": "0.10.2", ...}; None for a library not installed.

  Read from the installed distributions' metadata: nothing is imported."""
  found: dict[str, str | None] = {"python": platform.python_version()}
  for key, names in DISTRIBUTIONS.items():
    found[key] = None
    for name in names:
      try:
        found[key] = importlib.metadata.version(name)
        break
      except importlib.metadata.PackageNotFoundError:
        continue
  return found
