"""Training: the train state, steps, loop and checkpoints, over transformer.inference (the
model set-up, mesh, eval step and process start-up it shares with serving).

state.py        TrainState; setup(config): model, optimizer, mesh, state shardings
optimizer.py    the paper's learning-rate schedule and Adam
steps.py        loss and train_step, jit-compiled over the mesh
loop.py         train_and_evaluate: restore, loop, logging, evaluation, preemption
checkpoints.py  Orbax checkpoints of state, data iterator and config: the writer, on
                the read side below (transformer/inference/checkpoints.py)
prefetch.py     global batches built on a thread ahead of the step
reporting.py    progress line, metrics.jsonl, TensorBoard
goodput.py      where a workdir's wall time went, over its restarts
flops.py        model FLOPs and device peaks, for MFU
describe.py     what --dry_run prints: parameters, FLOPs, mesh
"""
