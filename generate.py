"""Generate with a trained Transformer: one job per subcommand, each with its own --help.

  python generate.py translate --workdir DIR "A sentence."    (or --input_file F, - = stdin)
      Print the translations, one per line: beam search, or --search=greedy|sample,
      speculative with --draft_workdir.
  python generate.py continue --workdir DIR "Some text" [--max_new_tokens N]
      Decoder-only runs: print the model's continuation of the text: greedy, or
      --search=sample, speculative with --draft_workdir.
  python generate.py attention --workdir DIR "A sentence." [--output_dir OUT]
      Write PNG heatmaps of every layer's and head's attention for that sentence.

Scoring (BLEU, chrF, perplexity of a split or of a file with references) is eval.py's
job. The run's config is DIR/config.json. On several hosts every process runs the same
command with the cluster flags of train.py before the subcommand (translate and
continue); process 0 prints.
"""

import argparse
import sys

from absl import app
from absl.flags import argparse_flags

from transformer import cli
from transformer.inference import distributed
from transformer.model.decoding import offered

distributed.define_flags()


def _common(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--workdir", required=True, help="A training run's directory.")
  parser.add_argument(
    "--step", type=int, default=None, help="Checkpoint step (default: the newest)."
  )
  parser.add_argument(
    "--average_last", type=int, default=1, help="Average the parameters of the last K checkpoints."
  )


def _search(parser: argparse.ArgumentParser, kinds: list[str]) -> None:
  """--search over `kinds` (the first the default) and their options, as declared in
  model/decoding/offered.py."""
  described = "; ".join(f"{name}, {offered.SEARCHES[name].help}" for name in kinds)
  parser.add_argument(
    "--search", choices=kinds, default=kinds[0], help=f"How to generate: {described}."
  )
  for option in offered.all_options(kinds):
    parser.add_argument(
      f"--{option.name}", type=option.type, default=option.default, help=option.help
    )


def parse(argv: list[str]) -> argparse.Namespace:
  parser = argparse_flags.ArgumentParser(
    description=__doc__.splitlines()[0], epilog="Each job's flags: python generate.py JOB --help"
  )
  jobs = parser.add_subparsers(dest="job", required=True, metavar="JOB")
  translate = jobs.add_parser(
    "translate", inherited_absl_flags=None, help="Translate text, a file or stdin."
  )
  _common(translate)
  translate.add_argument("text", nargs="?", help="The text to translate.")
  translate.add_argument("--input_file", help="Translate each line of this file (- = stdin).")
  _search(translate, list(offered.SEARCHES))
  continuation = jobs.add_parser(
    "continue", inherited_absl_flags=None, help="Continue text with a decoder-only run."
  )
  _common(continuation)
  continuation.add_argument("text", help="The text to continue.")
  continuation.add_argument(
    "--max_new_tokens", type=int, default=64, help="The most tokens to generate."
  )
  _search(continuation, offered.continuing())
  attention = jobs.add_parser(
    "attention", inherited_absl_flags=None, help="Plot attention maps for one sentence."
  )
  _common(attention)
  attention.add_argument("text", help="The sentence to translate and plot.")
  attention.add_argument("--output_dir", help="Where to write (default WORKDIR/attention).")
  args = parser.parse_args(argv[1:])
  if args.job == "translate" and (args.text is None) == (args.input_file is None):
    parser.exit(2, "error: translate takes a text or --input_file, one of the two\n")
  return args


def main(args: argparse.Namespace) -> None:
  distributed.initialize_from_flags()
  # Imported after jax.distributed is up: nothing may touch devices before that.
  import jax

  from transformer import config as config_lib
  from transformer import storage

  # A SIGTERM ends the job between two batches, on every process alike, in one line;
  # the outputs are printed (or written) only once all are generated.
  try:
    with distributed.stop_between_batches() as stop:
      if args.job == "attention" and jax.process_count() > 1:
        raise config_lib.ConfigError(
          "attention runs on one process (it plots one sentence); "
          "start generate.py without the cluster flags"
        )
      translator = _translator(args)
      translator.after_batch = stop.after_batch
      if args.job == "translate":
        outputs = translator.translate_lines(_lines(args))  # every process takes part
      elif args.job == "continue":
        outputs = translator.continue_text([args.text], args.max_new_tokens)
      else:
        outputs = [_attention_maps(translator, args)]
  except (config_lib.ConfigError, OSError, RuntimeError) as e:
    # After a stalled read its thread is still blocked in the storage client (Orbax's
    # reader threads are joined at a normal exit, however long the storage stalls).
    distributed.exit_with_error(e, force=isinstance(e, storage.StorageTimeout))
  if jax.process_index() == 0:
    for output in outputs:
      print(output)


def _translator(args: argparse.Namespace):
  """The run restored with the job's search; every check before anything is restored."""
  from transformer import config as config_lib
  from transformer import storage
  from transformer.evaluation import translate
  from transformer.inference import checkpoints

  if not storage.is_dir(args.workdir):
    raise config_lib.ConfigError(f"--workdir {args.workdir} does not exist")
  config = checkpoints.load_run_config(args.workdir)
  if args.job == "continue" and not config.model.decoder_only:
    raise config_lib.ConfigError(
      "continue extends text with a decoder-only model; this run "
      "is an encoder-decoder: use generate.py translate"
    )
  settings = translate.BEAM
  if args.job != "attention":
    options = offered.all_options([args.search])
    settings = translate.SearchSettings(
      args.search, **{o.name: getattr(args, o.name) for o in options}
    )
  return translate.Translator(
    config,
    args.workdir,
    step=args.step,
    average_last=args.average_last,
    settings=settings,
    draft_workdir=settings.values["draft_workdir"],
  )


def _lines(args: argparse.Namespace) -> list[str]:
  """The text, or the file's (stdin's) lines; bytes that are not UTF-8 become U+FFFD."""
  from transformer import storage

  if args.text is not None:
    return [args.text]
  if args.input_file == "-":
    return sys.stdin.buffer.read().decode("utf-8", errors="replace").splitlines()
  return (
    storage.as_path(args.input_file).read_bytes().decode("utf-8", errors="replace").splitlines()
  )


def _attention_maps(translator, args: argparse.Namespace) -> str:
  from transformer import storage
  from transformer.evaluation import attention_maps

  out_dir = args.output_dir or storage.join(args.workdir, "attention")
  files = attention_maps.plot_attention_maps(
    translator.model,
    translator.params,
    translator.tokenizer,
    args.text,
    out_dir,
    max_len=translator.config.max_len,
  )
  return f"wrote {len(files)} attention maps to {out_dir}"


def _quiet_main(args: argparse.Namespace) -> None:
  cli.quiet_library_logs()
  main(args)


if __name__ == "__main__":
  app.run(_quiet_main, flags_parser=parse)
