"""Commands built on the library, each `python -m transformer.tools.NAME`:

bench                the benchmark: compile, step, MFU, memory, beam search, input
decoding_speed       beam search with and without the decoding cache
input_speed          the input pipeline alone: examples/s and tokens/s
average_checkpoints  the mean of a run's last k checkpoints, written as a new run
prepare_data         a config's dataset and vocabulary, built once before a multi-host job
export               a trained run as a CTranslate2 model (float32 or int8), for serving
compare_ctranslate2  the run's decoding beside its CTranslate2 export: outputs, BLEU, speed
compile_check        the training and decoding steps compiled for a named TPU slice, on a CPU
                     (op_profile.py, a module of it: the compiler's per-op estimates summed)
memory               per-device memory of the compiled training step, mesh by mesh
restore_memory       host memory and time of restoring averaged parameters, alone or with
                     the whole train state
"""

from transformer import cli

# Each tool runs as `python -m transformer.tools.NAME`, which imports this package before
# the tool's own imports load TensorFlow (the input pipeline, tfds): its start-up lines
# are silenced here, as cli.run does for train.py, eval.py and generate.py.
cli.quiet_tensorflow_start()
