"""Training: the train state, steps, loop, checkpoints and everything distributed.

state.py        TrainState; setup(config): model, optimizer, mesh, state shardings
optimizer.py    the paper's learning-rate schedule and Adam
steps.py        loss, train_step and eval_step, jit-compiled over the mesh
metrics.py      summed step metrics -> per-token loss, perplexity, accuracy
loop.py         train_and_evaluate: restore, loop, logging, evaluation, preemption
checkpoints.py  Orbax checkpoints of state, data iterator and config; averaging
sharding.py     device mesh, logical axis rules, global batches
distributed.py  jax.distributed start-up; one-line errors across processes
prefetch.py     global batches built on a thread ahead of the step
reporting.py    progress line, metrics.jsonl, TensorBoard
goodput.py      where a workdir's wall time went, over its restarts
flops.py        model FLOPs and device peaks, for MFU
describe.py     what --dry_run prints: parameters, FLOPs, mesh
"""
