"""A model and its parameters on a mesh of processes, below training: what serving a
trained run needs, and what training builds on.

- `model_setup.setup(config)`: the model, mesh, sharding rules and the parameters' shapes
  and shardings (`ModelSetup`); training's set-up adds the optimizer on top of it.
- `restore(workdir, step, average_last)`: a trained run's parameters (only: a partial
  restore of the checkpoint, never the optimizer's moments), vocabulary and step.
- `checkpoints`: the read side of a run's checkpoints (steps, config, parameters), and
  the one write a served run needs (an averaged run's checkpoint).
- `sharding`: the mesh, the logical axis rules, and placing batches on the mesh.
- `scoring`: the sharded eval step; `metrics`: its sums -> loss, perplexity, accuracy,
  and the validation loss training runs.
- `distributed`: starting the processes (jax.distributed), one-line errors across them,
  and stopping between batches on a preemption notice.
"""

from transformer.inference.model_setup import ModelSetup, setup
from transformer.inference.restore import Restored, restore

__all__ = ["ModelSetup", "Restored", "restore", "setup"]
