"""Scoring a split: translate every sentence once, in order, then BLEU, chrF, perplexity.

`evaluate_split` writes WORKDIR/eval/<split>-<step>[-avg<k>][-<search>][-spec].{src,ref,
hyp}.txt (one sentence per line, in the split's order) and .json (the scores), and
returns the scores. The search is the translator's (translate.SearchSettings): beam
search by default, whose files carry no search suffix; greedy and sample runs add
theirs, and speculative ones (a draft model) '-spec' too, so that no run overwrites
another's files. `evaluate_files` scores a source file against its references the same
way, named after the source file. Both kinds of model are scored the same way.
"""

from __future__ import annotations

import math
import time
from typing import Any, cast

import jax

from transformer import config as config_lib
from transformer import data, storage, versions
from transformer.data import sources
from transformer.evaluation import bleu
from transformer.evaluation.translate import SearchStats, Translator
from transformer.inference import metrics, scoring


class _FilePairs(sources.TsvSource):
  """A source file and its references as the one split "files" of a pair source (the
  TSV source's reading of a split, without its files)."""

  def __init__(self, source_path: str, reference_path: str):
    source_lines = storage.read_text(source_path).splitlines()
    references = storage.read_text(reference_path).splitlines()
    if len(source_lines) != len(references):
      raise config_lib.ConfigError(
        f"reference_file: {reference_path} has {len(references)} lines, "
        f"{source_path} has {len(source_lines)}"
      )
    self.name = f"files:{source_path}"
    self._pairs = {"files": list(zip(source_lines, references))}


def evaluate_files(translator: Translator, source_path: str, reference_path: str) -> dict[str, Any]:
  """`evaluate_split` on a source file (one sentence per line) and its references, line
  for line; the outputs are named after the source file."""
  pairs = _FilePairs(source_path, reference_path)
  name = storage.as_path(source_path).name.removesuffix(".txt")
  return evaluate_split(translator, "files", pairs=pairs, name=name)


def evaluate_split(
  translator: Translator, split: str, *, pairs=None, name: str | None = None
) -> dict[str, Any]:
  """Translates `split` once, in order; writes hypotheses and scores; returns scores.

  pairs: the pair source to read the split from (default the config's dataset); name:
  the output files' first part (default the split).
  """
  config = translator.config
  # [(source, reference)] in the split's order.
  texts = data.load_raw_pairs(config, split, source=pairs)
  translator.stats = SearchStats()  # the JSON's speculative stats cover this split only
  started = time.time()  # sentences/s counts tokenizing and batching too
  batches = data.make_eval_batches(config, translator.tokenizer, split, source=pairs)
  hypotheses, generated_tokens = _translate_batches(translator, batches, len(texts), split)
  elapsed = time.time() - started

  references = [r for _, r in texts]
  results = {
    "split": split,
    "step": translator.step,
    "average_last": translator.average_last,
    **_translation_scores(hypotheses, references, config),
    "num_sentences": len(texts),
    "sentences_per_sec": len(texts) / elapsed,
    "tokens_per_sec": generated_tokens / elapsed,
    **_search_settings(translator),
    "versions": versions.library_versions(),
  }
  # Perplexity with teacher forcing, unsmoothed, on the same batches.
  loss = metrics.evaluate_loss(
    scoring.jit_eval_step(translator.setup),
    translator.params,
    batches,
    translator.mesh,
    translator.rules,
  )
  results["ppl"], results["ce"] = loss["ppl"], loss["ce"]
  json_path = output_stem(translator, name or split) + ".json"
  if jax.process_index() == 0:  # the files are the same on every process: one writer
    _write_outputs(json_path, [s for s, _ in texts], references, hypotheses, results)
  results["path"] = json_path
  if not math.isfinite(results["ppl"]):
    raise RuntimeError(f"perplexity on {split} is {results['ppl']}")
  return results


def _translate_batches(
  translator: Translator, batches: list[dict], num_sentences: int, split: str
) -> tuple[list[str], int]:
  """(hypotheses in the split's order, generated tokens with EOS) of every batch."""
  hypotheses: list[str | None] = [None] * num_sentences
  generated_tokens = 0
  searched = translator.translate_batches(batch["source"] for batch in batches)
  for batch, tokens in zip(batches, searched):
    for row, index in enumerate(batch["index"]):
      if index >= 0:
        ids = tokens[row].tolist()
        generated_tokens += (
          ids.index(config_lib.EOS_ID) + 1 if config_lib.EOS_ID in ids else len(ids)
        )
        hypotheses[index] = translator.tokenizer.decode(ids)
  missing = [i for i, h in enumerate(hypotheses) if h is None]
  if missing:
    raise RuntimeError(f"{len(missing)} sentences of {split} were not translated")
  return cast(list[str], hypotheses), generated_tokens  # none is None: checked above


def _translation_scores(hypotheses: list[str], references: list[str], config) -> dict:
  """sacreBLEU with its signature, the paper's tokenized BLEU, and chrF."""
  _, target_lang = config_lib.parse_direction(config.direction)
  sacre = bleu.sacre_bleu(hypotheses, references)
  return {
    "bleu": sacre.score,
    "bleu_signature": sacre.signature,
    "bleu_tok": bleu.tokenized_bleu(hypotheses, references, target_lang).score,
    "chrf": bleu.chrf(hypotheses, references).score,
  }


def _search_settings(translator: Translator) -> dict[str, Any]:
  """The JSON's record of how the hypotheses were generated (and, speculative, of what
  the draft saved over the whole split: see translate.SearchStats)."""
  config, search = translator.config, translator.settings
  settings: dict[str, Any] = {
    "search": search.kind,
    "decoder_only": bool(config.model.decoder_only),
  }
  settings.update(search.record(config))
  if translator.draft is not None:
    settings.update(
      draft_workdir=translator.draft.workdir,
      draft_len=search.draft_len,
      **translator.stats.summary(),
    )
  return settings


def output_stem(translator: Translator, split: str) -> str:
  """WORKDIR/eval/<split>-<step>[-avg<k>][-greedy|-sample][-spec]: beam search (the
  paper's protocol) keeps the plain name."""
  averaged = f"-avg{translator.average_last}" if translator.average_last > 1 else ""
  kind = translator.settings.kind
  search = "" if kind == "beam" else f"-{kind}"
  speculative = "-spec" if translator.draft is not None else ""
  return storage.join(
    translator.workdir, "eval", f"{split}-{translator.step}{averaged}{search}{speculative}"
  )


def _write_outputs(
  json_path: str, sources: list[str], references: list[str], hypotheses: list[str], results: dict
) -> None:
  """The .src/.ref/.hyp.txt files, one sentence per line in the split's order, then the
  .json (last, so that its presence means the evaluation is complete)."""
  stem = json_path.removesuffix(".json")
  storage.makedirs(storage.as_path(json_path).parent)
  for suffix, lines in (("src", sources), ("ref", references), ("hyp", hypotheses)):
    storage.write_lines(f"{stem}.{suffix}.txt", lines)
  storage.write_json(json_path, results)
