"""What a record says about how it was made: the exact versions of the libraries that
decide a run's numbers, and the machine, date and commit (`provenance`).

Two installs a month apart can compute different numbers; requirements/lock.txt pins
them, and every record says which it ran with: a run's config.json (key `versions`),
the JSON lines of bench, the memory tool and the sweeps, and eval.py's scores.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import subprocess

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


def provenance(command: str, machine: str | None = None) -> dict[str, str]:
  """machine, date, commit and command for a record made now, from this checkout; the
  commit ends in -dirty when tracked files differ from it."""

  def git(*args: str) -> str:
    return subprocess.run(
      ["git", *args], cwd=_REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()

  commit = git("rev-parse", "--short", "HEAD")
  if git("status", "--porcelain", "--untracked-files=no"):
    commit += "-dirty"
  return {
    "machine": machine or describe_machine(),
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
    "commit": commit,
    "command": command,
  }


def describe_machine() -> str:
  """e.g. '2-core AMD EPYC CPU' (an accelerator is named by whoever runs on one)."""
  model = "CPU"
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      names = re.findall(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)
    if names:
      model = names[0].strip() + " CPU"
  except OSError:
    pass
  return f"{os.cpu_count()}-core {model}"
