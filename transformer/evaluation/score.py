"""Scoring a split: beam-search every sentence once, in order, then BLEU, chrF, perplexity.

`evaluate_split` writes WORKDIR/eval/<split>-<step>[-avg<k>].{src,ref,hyp}.txt (one
sentence per line, in the split's order) and .json (the scores), and returns the scores.
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax

from transformer import config as config_lib
from transformer import data
from transformer import storage
from transformer.evaluation import bleu
from transformer.evaluation.translate import Translator, search_batch
from transformer.training import metrics, steps


def evaluate_split(translator: Translator, split: str) -> dict[str, Any]:
  """Translates `split` once, in order; writes hypotheses and scores; returns scores."""
  config = translator.config
  texts = data.load_raw_pairs(config, split)  # [(source, reference)] in the split's order
  started = time.time()  # sentences/s counts tokenizing and batching too
  batches = data.make_eval_batches(config, translator.tokenizer, split)
  hypotheses, generated_tokens = _translate_batches(translator, batches, len(texts), split)
  elapsed = time.time() - started

  references = [r for _, r in texts]
  results = {"split": split, "step": translator.step, "average_last": translator.average_last,
             **_translation_scores(hypotheses, references, config),
             "num_sentences": len(texts), "sentences_per_sec": len(texts) / elapsed,
             "tokens_per_sec": generated_tokens / elapsed, "beam_size": config.beam_size,
             "alpha": config.length_penalty_alpha}
  # Perplexity with teacher forcing, unsmoothed, on the same batches.
  loss = metrics.evaluate_loss(steps.jit_eval_step(translator.setup), translator.params,
                               batches, translator.mesh, translator.rules)
  results["ppl"], results["ce"] = loss["ppl"], loss["ce"]
  json_path = _output_stem(translator, split) + ".json"
  if jax.process_index() == 0:  # the files are the same on every process: one writer
    _write_outputs(json_path, [s for s, _ in texts], references, hypotheses, results)
  results["path"] = json_path
  if not math.isfinite(results["ppl"]):
    raise RuntimeError(f"perplexity on {split} is {results['ppl']}")
  return results


def _translate_batches(translator: Translator, batches: list[dict], num_sentences: int,
                       split: str) -> tuple[list[str], int]:
  """(hypotheses in the split's order, generated tokens with EOS) of every batch."""
  hypotheses: list[str | None] = [None] * num_sentences
  generated_tokens = 0
  for batch in batches:
    tokens = search_batch(translator.model, translator.params, translator.config,
                          translator.mesh, translator.rules, batch["source"])
    for row, index in enumerate(batch["index"]):
      if index >= 0:
        ids = tokens[row].tolist()
        generated_tokens += (ids.index(config_lib.EOS_ID) + 1
                             if config_lib.EOS_ID in ids else len(ids))
        hypotheses[index] = translator.tokenizer.decode(ids)
  missing = [i for i, h in enumerate(hypotheses) if h is None]
  if missing:
    raise RuntimeError(f"{len(missing)} sentences of {split} were not translated")
  return hypotheses, generated_tokens


def _translation_scores(hypotheses: list[str], references: list[str], config) -> dict:
  """sacreBLEU with its signature, the paper's tokenized BLEU, and chrF."""
  _, target_lang = config_lib.parse_direction(config.direction)
  sacre = bleu.sacre_bleu(hypotheses, references)
  return {"bleu": sacre.score, "bleu_signature": sacre.signature,
          "bleu_tok": bleu.tokenized_bleu(hypotheses, references, target_lang).score,
          "chrf": bleu.chrf(hypotheses, references).score}


def _output_stem(translator: Translator, split: str) -> str:
  """WORKDIR/eval/<split>-<step>[-avg<k>]."""
  averaged = f"-avg{translator.average_last}" if translator.average_last > 1 else ""
  return storage.join(translator.workdir, "eval", f"{split}-{translator.step}{averaged}")


def _write_outputs(json_path: str, sources: list[str], references: list[str],
                   hypotheses: list[str], results: dict) -> None:
  """The .src/.ref/.hyp.txt files, one sentence per line in the split's order, then the
  .json (last, so that its presence means the evaluation is complete)."""
  stem = json_path.removesuffix(".json")
  storage.makedirs(storage.as_path(json_path).parent)
  for suffix, lines in (("src", sources), ("ref", references), ("hyp", hypotheses)):
    storage.write_lines(f"{stem}.{suffix}.txt", lines)
  storage.write_json(json_path, results)
