"""Score a trained Transformer: BLEU, chrF and perplexity.

  python eval.py --workdir DIR [--split validation|test] [--average_last K] [--step S]
                 [--beam_size B] [--alpha A] [--search beam|greedy|sample]
                 [--temperature T] [--top_k K] [--top_p P] [--seed N]
                 [--draft_workdir DRAFT] [--draft_len k]
      Translate the whole split once, in order; write
      DIR/eval/<split>-<step>[-avgK][-greedy|-sample][-spec].* and print sacreBLEU
      (detokenized) as the last line. --search=beam (the default) is the paper's
      protocol; greedy and sample decode one hypothesis. --draft_workdir: a second run
      with the same vocabulary (byte-identical vocab.model) drafts draft_len tokens per
      target pass (speculative decoding, greedy or sample only): the same output as
      without it, and the JSON adds acceptance_rate and tokens_per_target_call.
      Encoder-decoder and decoder-only runs are evaluated alike (a decoder-only model
      continues BOS + source + EOS; its hypothesis is the continuation up to EOS).
  python eval.py --workdir DIR --source_file SRC --reference_file REF [search flags]
      The same for a file of source sentences and its references, line for line;
      writes DIR/eval/<SRC's name>-<step>....

Generation for people (translating text, a file or stdin, continuing a prompt,
attention maps) is generate.py's job.

The config comes from DIR/config.json unless --config is given (then it must match
the checkpoint's architecture). DIR may be gs://... On several hosts every process runs
the same command, with the same jax.distributed flags as train.py; each searches its
share of every batch, and process 0 writes the files and prints.
"""

import sys
from collections.abc import Callable

from absl import flags
from ml_collections import config_flags

from transformer import cli
from transformer.inference import distributed
from transformer.model.decoding import offered

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Config file (default: the run's own WORKDIR/config.json).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "A training run's directory.")
_SPLIT = flags.DEFINE_enum("split", "test", ["validation", "test"], "Split to evaluate.")
_SOURCE_FILE = flags.DEFINE_string(
  "source_file", None, "Score this file's sentences instead of a split."
)
_REFERENCE_FILE = flags.DEFINE_string(
  "reference_file", None, "--source_file's references, line for line."
)
_AVERAGE_LAST = flags.DEFINE_integer(
  "average_last", 1, "Average the parameters of the last K checkpoints."
)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
_SEARCH = flags.DEFINE_enum(
  "search",
  "beam",
  list(offered.SEARCHES),
  "How to generate: "
  + "; ".join(f"{name}, {kind.help}" for name, kind in offered.SEARCHES.items()),
)
_DEFINE_BY_TYPE: dict[type, Callable[..., flags.FlagHolder]] = {
  int: flags.DEFINE_integer,
  float: flags.DEFINE_float,
  str: flags.DEFINE_string,
}
# Every search's options (model/decoding/offered.py), each flag defined once.
_SEARCH_OPTIONS = {
  option.name: _DEFINE_BY_TYPE[option.type](option.name, option.default, option.help)
  for option in offered.all_options()
}
distributed.define_flags()

# Flags of generation, which generate.py took over: each names its new home.
MOVED_FLAGS = {
  "translate": 'python generate.py translate --workdir DIR "TEXT"',
  "input_file": "python generate.py translate --workdir DIR --input_file FILE",
  "prompt": 'python generate.py continue --workdir DIR "TEXT"',
  "max_new_tokens": "python generate.py continue --max_new_tokens N",
  "attention_maps": 'python generate.py attention --workdir DIR "SENTENCE"',
  "output_dir": "python generate.py attention --output_dir OUT",
}


def check_moved_flags(argv: list[str]) -> None:
  """Exits with one line pointing to generate.py for a flag eval.py no longer has."""
  for arg in argv[1:]:
    name = arg.lstrip("-").split("=", 1)[0]
    if arg.startswith("--") and name in MOVED_FLAGS:
      sys.exit(f"error: eval.py only scores; --{name} moved to generate.py: {MOVED_FLAGS[name]}")


def main(argv):
  if len(argv) > 1:
    raise cli.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  distributed.initialize_from_flags()
  # Imported after jax.distributed is up: nothing may touch devices before that.
  import jax

  from transformer import config as config_lib
  from transformer import storage
  from transformer.evaluation import score, translate

  # A SIGTERM ends the run between two batches, on every process alike, in one line;
  # the output files are written only once every sentence is translated.
  try:
    with distributed.stop_between_batches() as stop:
      if (_SOURCE_FILE.value is None) != (_REFERENCE_FILE.value is None):
        raise config_lib.ConfigError("--source_file and --reference_file go together")
      kind = _SEARCH.value
      settings = translate.SearchSettings(
        kind,
        **{o.name: _SEARCH_OPTIONS[o.name].value for o in offered.all_options([kind])},
      )
      translator = load_translator(settings)
      translator.after_batch = stop.after_batch
      if _SOURCE_FILE.value is not None:
        results = score.evaluate_files(translator, _SOURCE_FILE.value, _REFERENCE_FILE.value)
      else:
        results = score.evaluate_split(translator, _SPLIT.value)
  except (config_lib.ConfigError, OSError, RuntimeError) as e:
    # After a stalled read its thread is still blocked in the storage client (Orbax's
    # reader threads are joined at a normal exit, however long the storage stalls).
    distributed.exit_with_error(e, force=isinstance(e, storage.StorageTimeout))
  # No log line of the whole dict: it is in the printed lines below and in eval/*.json.
  if jax.process_index() != 0:  # the same scores on every process: one prints them
    return
  print(
    f"{results['split']} step {results['step']}: chrF {results['chrf']:.2f} | "
    f"tokenized BLEU {results['bleu_tok']:.2f} | ppl {results['ppl']:.2f} | "
    f"{results['sentences_per_sec']:.1f} sentences/s | {results['path']}"
  )
  if "acceptance_rate" in results:
    print(
      f"speculative: acceptance rate {results['acceptance_rate']:.3f} | "
      f"{results['tokens_per_target_call']:.2f} tokens per target call"
    )
  print(f"sacreBLEU {results['bleu']:.2f}  {results['bleu_signature']}")


def load_translator(settings):
  """The run of --workdir (its config, or --config), restored with the search settings
  (and their draft run, if any); every check runs before anything is restored."""
  from transformer import config as config_lib
  from transformer import storage
  from transformer.evaluation import translate
  from transformer.inference import checkpoints

  workdir = _WORKDIR.value
  if not workdir:
    raise config_lib.ConfigError("--workdir is required")
  if not storage.is_dir(workdir):
    raise config_lib.ConfigError(f"--workdir {workdir} does not exist")
  config = _CONFIG.value
  if config is None:
    config = checkpoints.load_run_config(workdir)
  return translate.Translator(
    config,
    workdir,
    step=_STEP.value,
    average_last=_AVERAGE_LAST.value,
    settings=settings,
    draft_workdir=settings.values["draft_workdir"],
  )


if __name__ == "__main__":
  check_moved_flags(sys.argv)
  cli.run(main)
