"""Ablation sweeps (`python -m transformer.sweeps`): Table 3 as rows of config overrides.

  spec.py     the sweep file format: Row, Sweep, loading, each row's validated config
  runner.py   running rows here one after another; what a row's workdir holds
  launch.py   SLURM and TPU-pod scripts for the rows
  report.py   sizes before training (--dry_run), results after (--collect)
  __main__.py the command line

Sweep files import `Row` from here: `from transformer.sweeps import Row`.
"""

from transformer.sweeps.spec import Row

__all__ = ["Row"]
