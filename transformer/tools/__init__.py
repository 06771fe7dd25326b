"""Commands built on the library, each `python -m transformer.tools.NAME`:

bench                the benchmark: compile, step, MFU, memory, beam search, input
decoding_speed       beam search with and without the decoding cache
input_speed          the input pipeline alone: examples/s and tokens/s
average_checkpoints  the mean of a run's last k checkpoints, written as a new run
prepare_data         a config's dataset and vocabulary, built once before a multi-host job
memory               per-device memory of the compiled training step, mesh by mesh
render_docs          `make docs`: README's and docs/' figures, from docs/results/*.jsonl
"""
