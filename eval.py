"""Evaluate or use a trained Transformer.

  python eval.py --workdir DIR [--split validation|test] [--average_last K]
                 [--beam_size B] [--alpha A] [--step S]
      Beam-search the whole split once, in order; write DIR/eval/<split>-<step>[-avgK].*
      and print sacreBLEU (detokenized) as the last line.
  python eval.py --workdir DIR --translate "A sentence."   (or --input_file F, - = stdin)
      Print only the translations, one per line.
  python eval.py --workdir DIR --attention_maps "A sentence." --output_dir OUT
      Write PNG heatmaps of every layer's and head's attention for that sentence.

The config comes from DIR/config.json unless --config is given (then it must match
the checkpoint's architecture). DIR may be gs://... On several hosts every process runs
the same command, with the same jax.distributed flags as train.py; each searches its
share of every batch, and process 0 writes the files and prints.
"""

import sys

from absl import flags, logging
from ml_collections import config_flags

from transformer import cli
from transformer.training import distributed

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (default: the run's own WORKDIR/config.json).",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "A training run's directory.")
_SPLIT = flags.DEFINE_enum("split", "test", ["validation", "test"], "Split to evaluate.")
_AVERAGE_LAST = flags.DEFINE_integer("average_last", 1,
                                     "Average the parameters of the last K checkpoints.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
_BEAM_SIZE = flags.DEFINE_integer("beam_size", None, "Beam size (default: config.beam_size).")
_ALPHA = flags.DEFINE_float("alpha", None,
                            "Length penalty alpha (default: config.length_penalty_alpha).")
_TRANSLATE = flags.DEFINE_string("translate", None, "Translate this text and print it.")
_INPUT_FILE = flags.DEFINE_string("input_file", None,
                                  "Translate each line of this file ('-' = stdin).")
_ATTENTION_MAPS = flags.DEFINE_string("attention_maps", None,
                                      "Plot attention maps for this sentence.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None,
                                  "Where --attention_maps writes (default WORKDIR/attention).")
distributed.define_flags()


def main(argv):
  if len(argv) > 1:
    raise cli.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  distributed.initialize_from_flags()
  # Imported after jax.distributed is up: nothing may touch devices before that.
  import jax
  from transformer import config as config_lib
  from transformer import storage
  from transformer.evaluation import score, translate
  from transformer.training import checkpoints

  workdir = _WORKDIR.value
  try:
    if not workdir:
      raise config_lib.ConfigError("--workdir is required")
    if not storage.is_dir(workdir):
      raise config_lib.ConfigError(f"--workdir {workdir} does not exist")
    config = _CONFIG.value
    if config is None:
      config = checkpoints.load_run_config(workdir)
    if _BEAM_SIZE.value is not None:
      config.beam_size = _BEAM_SIZE.value
    if _ALPHA.value is not None:
      config.length_penalty_alpha = _ALPHA.value
    translator = translate.Translator(config, workdir, step=_STEP.value,
                                      average_last=_AVERAGE_LAST.value)

    if _TRANSLATE.value is not None or _INPUT_FILE.value is not None:
      if _TRANSLATE.value is not None:
        lines = [_TRANSLATE.value]
      elif _INPUT_FILE.value == "-":  # bytes that are not UTF-8 become U+FFFD, as below
        lines = sys.stdin.buffer.read().decode("utf-8", errors="replace").splitlines()
      else:
        lines = storage.as_path(_INPUT_FILE.value).read_bytes().decode(
            "utf-8", errors="replace").splitlines()
      translations = translator.translate_lines(lines)  # every process takes part
      if jax.process_index() == 0:
        for translation in translations:
          print(translation)
      return

    if _ATTENTION_MAPS.value is not None:
      if jax.process_count() > 1:
        raise config_lib.ConfigError("--attention_maps runs on one process (it plots one "
                                     "sentence); start eval.py without the cluster flags")
      from transformer.evaluation import attention_maps
      out_dir = _OUTPUT_DIR.value or storage.join(workdir, "attention")
      files = attention_maps.plot_attention_maps(
          translator.model, translator.params, translator.tokenizer, _ATTENTION_MAPS.value,
          out_dir, max_len=config.max_len)
      print(f"wrote {len(files)} attention maps to {out_dir}")
      return

    results = score.evaluate_split(translator, _SPLIT.value)
  except (config_lib.ConfigError, OSError, RuntimeError) as e:
    distributed.exit_with_error(e)
  logging.info("results: %s", results)
  if jax.process_index() != 0:  # the same scores on every process: one prints them
    return
  print(f"{_SPLIT.value} step {results['step']}: chrF {results['chrf']:.2f} | "
        f"tokenized BLEU {results['bleu_tok']:.2f} | ppl {results['ppl']:.2f} | "
        f"{results['sentences_per_sec']:.1f} sentences/s | {results['path']}")
  print(f"sacreBLEU {results['bleu']:.2f}  {results['bleu_signature']}")


if __name__ == "__main__":
  cli.run(main)
