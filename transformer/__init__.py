"""The Transformer of "Attention Is All You Need" in JAX/Flax.

One folder per layer; each imports only from the layers listed before it
(tests/test_package_layout.py checks it):

  config/, messages.py     every config key and its checks; one-line messages
  model/                   the Flax modules and decoding (beam, greedy, sampling)
  data/                    tfds and TSV sources, SentencePiece, batching, packing
  training/                state, steps, loop, checkpoints, sharding, multi-host
  evaluation/              translation, BLEU and chrF, attention maps
  sweeps/                  ablation sweeps: `python -m transformer.sweeps`
  tools/                   commands: bench, decoding_speed, input_speed, average_checkpoints
  cli.py                   flag parsing and a quiet terminal for every command
  host_memory.py           keeps freed host memory in the process (XLA:CPU's step buffers)

Importing the package changes nothing in the process: the commands apply their process
settings (host_memory.py) when they start (cli.run).
"""
