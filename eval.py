"""Evaluate or use a trained Transformer.

  python eval.py --workdir DIR [--split validation|test] [--average_last K]
                 [--beam_size B] [--alpha A] [--step S]
                 [--search beam|greedy|sample] [--temperature T] [--top_k K]
                 [--top_p P] [--seed N] [--draft_workdir DRAFT] [--draft_len k]
      Translate the whole split once, in order; write
      DIR/eval/<split>-<step>[-avgK][-greedy|-sample][-spec].* and print sacreBLEU
      (detokenized) as the last line. --search=beam (the default) is the paper's
      protocol; greedy and sample decode one hypothesis. --draft_workdir: a second run
      with the same vocabulary (byte-identical vocab.model) drafts draft_len tokens per
      target pass (speculative decoding, greedy or sample only): the same output as
      without it, and the JSON adds acceptance_rate and tokens_per_target_call.
      Encoder-decoder and decoder-only runs are evaluated alike (a decoder-only model
      continues BOS + source + EOS; its hypothesis is the continuation up to EOS).
  python eval.py --workdir DIR --translate "A sentence."   (or --input_file F, - = stdin)
      Print only the translations, one per line (honours --search and --draft_workdir).
  python eval.py --workdir DIR --prompt "Some text" [--max_new_tokens N]
      Decoder-only runs: print the model's continuation of the text: greedy, or
      --search=sample, speculative with --draft_workdir.
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
_SEARCH = flags.DEFINE_enum("search", "beam", ["beam", "greedy", "sample"],
                            "How to generate: beam search (the paper's), greedy, or sampling "
                            "(--prompt: greedy unless sample is given).")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature (> 0).")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample from the K most likely tokens (0 = all).")
_TOP_P = flags.DEFINE_float("top_p", 1.0,
                            "Sample from the smallest set of tokens reaching this mass.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_DRAFT_WORKDIR = flags.DEFINE_string(
    "draft_workdir", None, "A second run (same vocabulary) as the draft model of "
    "speculative decoding; with --search=greedy or sample.")
_DRAFT_LEN = flags.DEFINE_integer("draft_len", 4,
                                  "Tokens the draft proposes per target pass.")
_PROMPT = flags.DEFINE_string("prompt", None,
                              "Decoder-only runs: continue this text and print the "
                              "continuation.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64,
                                       "--prompt: the most tokens to generate.")
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
    search_kind = _SEARCH.value
    if _PROMPT.value is not None:
      if not config.model.decoder_only:
        raise config_lib.ConfigError("--prompt continues text with a decoder-only model; "
                                     "this run is an encoder-decoder: use --translate")
      if not flags.FLAGS["search"].present:
        search_kind = "greedy"
      elif search_kind == "beam":
        raise config_lib.ConfigError("--prompt continues greedily or by sampling: "
                                     "--search=greedy|sample")
    if _DRAFT_WORKDIR.value is not None and search_kind == "beam":
      raise config_lib.ConfigError("--draft_workdir: speculative decoding is offered for "
                                   "--search=greedy and --search=sample, not beam search")
    search = translate.Search(search_kind, temperature=_TEMPERATURE.value,
                              top_k=_TOP_K.value, top_p=_TOP_P.value, seed=_SEED.value,
                              draft_len=_DRAFT_LEN.value)
    search.check()  # before anything is restored or compiled
    if _DRAFT_WORKDIR.value is not None:
      if not storage.is_dir(_DRAFT_WORKDIR.value):
        raise config_lib.ConfigError(f"--draft_workdir {_DRAFT_WORKDIR.value} does not exist")
      translate.check_draft_vocabulary(workdir, _DRAFT_WORKDIR.value)
    translator = translate.Translator(config, workdir, step=_STEP.value,
                                      average_last=_AVERAGE_LAST.value, search=search,
                                      draft_workdir=_DRAFT_WORKDIR.value)

    if _PROMPT.value is not None:
      continuation, = translator.continue_text([_PROMPT.value], _MAX_NEW_TOKENS.value)
      if jax.process_index() == 0:
        print(continuation)
      return

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
  if "acceptance_rate" in results:
    print(f"speculative: acceptance rate {results['acceptance_rate']:.3f} | "
          f"{results['tokens_per_target_call']:.2f} tokens per target call")
  print(f"sacreBLEU {results['bleu']:.2f}  {results['bleu_signature']}")


if __name__ == "__main__":
  cli.run(main)
