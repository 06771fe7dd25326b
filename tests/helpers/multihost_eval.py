"""eval.py's split evaluation in one of several processes, optionally on a mesh whose device
order interleaves the processes (as a TPU pod's physical order can).

  python tests/multihost_eval.py WORKDIR SPLIT PROCESS_ID NUM_PROCESSES PORT ORDER

ORDER: `process` (each process's devices side by side, the order jax.devices() gives) or
`interleaved` (device i of every process, then device i+1 of every process, ...). With
the batch split over the first mesh axes, `interleaved` hands each process every other
block of rows. The checkpoint's parameters are replaced by random ones, which give every
sentence its own translation. Process 0 prints the scores as one JSON line.
"""

import json
import sys

import jax


def main(workdir, split, process_id, num_processes, port, order):
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"localhost:{port}",
    num_processes=int(num_processes),
    process_id=int(process_id),
  )
  from transformer.evaluation import score, translate
  from transformer.inference import sharding
  from transformer.training import checkpoints

  if order == "interleaved":
    create_mesh = sharding.create_mesh

    def interleaved_mesh(config, devices=None):
      devices = sorted(
        jax.devices(),
        key=lambda d: (
          [x.id for x in jax.devices() if x.process_index == d.process_index].index(d.id),
          d.process_index,
        ),
      )
      return create_mesh(config, devices)

    sharding.create_mesh = interleaved_mesh

  config = checkpoints.load_run_config(workdir)
  # Greedy search: the gather under test is every search's (one evaluation path gathers
  # decoding.decode's rows), and greedy compiles in a fraction of beam search's time.
  translator = translate.Translator(
    config, workdir, settings=translate.SearchSettings(kind="greedy")
  )
  # A run trained for a few steps says EOS to everything, and then a mix-up of sentences
  # would go unseen: random weights (the same on every process), scaled up 3x, translate
  # each sentence differently (at their initial scale greedy search repeats one token,
  # as long as the source: 26 distinct translations of 143 test sentences; 132 at 3x).
  params = translator.setup.init_params(jax.random.key(7))
  translator.params = jax.tree.map(lambda x: 3 * x, params)
  owners = [d.process_index for d in translator.mesh.devices.flat]
  results = score.evaluate_split(translator, split)
  if jax.process_index() == 0:
    print(json.dumps({"device_owners": owners, **results}), flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
