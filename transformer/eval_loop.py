"""Evaluation of a trained workdir: beam search over a split, BLEU, and translation.

`evaluate_split` translates every sentence of a split exactly once, in order, and
writes WORKDIR/eval/<split>-<step>.{src,ref,hyp}.txt and .json. `translate_lines` is
the same search for a user's own sentences.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Iterable

import jax
import ml_collections
from jax.experimental import multihost_utils
import numpy as np

from transformer import checkpoints, data, decoding, evaluation, sharding, trainer
from transformer import config as config_lib


def sum_metrics(pending: list[dict]) -> dict[str, float]:
  fetched = jax.device_get(pending)
  return {k: float(np.sum([m[k] for m in fetched])) for k in fetched[0]}


def evaluate_loss(p_eval_step, params, eval_batches, mesh, rules,
                  max_batches: int = 0) -> dict[str, float]:
  """Unsmoothed cross-entropy and perplexity over a split (or its first batches)."""
  pending = []
  for i, batch in enumerate(eval_batches):
    if max_batches and i >= max_batches:
      break
    batch = {k: v for k, v in batch.items() if k != "index"}
    pending.append(p_eval_step(params, sharding.global_batch(batch, mesh, rules)))
  sums = sum_metrics(pending)
  tokens = max(sums["num_tokens"], 1.0)
  ce = sums["ce_sum"] / tokens
  return {"loss": sums["loss_sum"] / tokens, "ce": ce, "ppl": math.exp(min(ce, 50.0)),
          "accuracy": sums["correct_sum"] / tokens, "num_tokens": sums["num_tokens"]}


def search_batch(model, params, config: ml_collections.ConfigDict, mesh, rules,
                 source_BxS: np.ndarray) -> np.ndarray:
  """Beam search (config's beam size and alpha) on padded source ids -> tokens [B, C]."""
  rows = source_BxS.shape[0] // jax.process_count()  # every process holds the whole batch
  local = source_BxS[jax.process_index() * rows:(jax.process_index() + 1) * rows]
  source = sharding.global_batch({"source": local}, mesh, rules)["source"]
  tokens, _ = decoding.beam_search(
      model, params, source, beam_size=config.beam_size, alpha=config.length_penalty_alpha,
      max_decode_extra_len=config.max_decode_extra_len)
  if jax.process_count() > 1:
    return np.asarray(multihost_utils.process_allgather(tokens, tiled=True))
  return np.asarray(jax.device_get(tokens))


def beam_translate(model, params, tokenizer, config: ml_collections.ConfigDict, mesh,
                   rules, lines: list[str]) -> list[str]:
  """Beam-search translations of raw sentences, in order; an empty line stays empty.

  Inputs longer than max_len are clipped to it (the model never saw longer ones).
  """
  outputs = [""] * len(lines)
  batch_size = config.eval_batch_size
  todo = [i for i, line in enumerate(lines) if line.strip()]
  for start in range(0, len(todo), batch_size):
    chunk = todo[start:start + batch_size]
    ids = [tokenizer.encode(lines[i])[: config.max_len - 1] + [config_lib.EOS_ID]
           for i in chunk]
    tokens = search_batch(model, params, config, mesh, rules,
                          data.pad_batch(ids, rows=batch_size))
    for row, i in enumerate(chunk):
      outputs[i] = tokenizer.decode(tokens[row].tolist())
  return outputs


class Translator:
  """Restored parameters + tokenizer + the jitted beam search, on the run's mesh."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, *,
               step: int | None = None, average_last: int = 1):
    config_lib.validate(config)
    if config.model.decoder_only:
      raise config_lib.ConfigError("config.model.decoder_only: translation needs the "
                                   "encoder-decoder model")
    self.config = config
    self.workdir = workdir
    self.mesh = sharding.create_mesh(config)
    self.rules = sharding.axis_rules(config)
    self.tokenizer = data.load_workdir_tokenizer(workdir)
    self.model = trainer.build_model(config)
    self.params, self.step = checkpoints.restore_params(
        workdir, config, self.mesh, step=step, average_last=average_last)
    self.average_last = average_last

  def translate_lines(self, lines: Iterable[str]) -> list[str]:
    """Detokenized translations of raw sentences, in order (an empty line stays empty)."""
    return beam_translate(self.model, self.params, self.tokenizer, self.config, self.mesh,
                          self.rules, list(lines))


def evaluate_split(translator: Translator, split: str) -> dict[str, Any]:
  """Translates `split` once, in order; writes hypotheses and scores; returns scores.

  Files: WORKDIR/eval/<split>-<step>[-avg<k>].{src,ref,hyp}.txt and .json.
  """
  config, workdir = translator.config, translator.workdir
  texts = data.load_raw_pairs(config, split)  # [(source, reference)] in the split's order
  hypotheses: list[str | None] = [None] * len(texts)
  started = time.time()
  generated_tokens = 0
  batches = data.make_eval_batches(config, translator.tokenizer, split)
  for batch in batches:
    tokens = search_batch(translator.model, translator.params, config, translator.mesh,
                          translator.rules, batch["source"])
    for row, index in enumerate(batch["index"]):
      if index >= 0:
        ids = tokens[row].tolist()
        generated_tokens += (ids.index(config_lib.EOS_ID) + 1
                             if config_lib.EOS_ID in ids else len(ids))
        hypotheses[index] = translator.tokenizer.decode(ids)
  elapsed = time.time() - started
  missing = [i for i, h in enumerate(hypotheses) if h is None]
  if missing:
    raise RuntimeError(f"{len(missing)} sentences of {split} were not translated")

  sources = [s for s, _ in texts]
  references = [r for _, r in texts]
  target_lang = config.direction.split("-")[1]
  bleu = evaluation.sacre_bleu(hypotheses, references)
  results = {
      "split": split,
      "step": translator.step,
      "average_last": translator.average_last,
      "bleu": bleu.score,
      "bleu_signature": bleu.signature,
      "bleu_tok": evaluation.tokenized_bleu(hypotheses, references, target_lang).score,
      "chrf": evaluation.chrf(hypotheses, references).score,
      "num_sentences": len(texts),
      "sentences_per_sec": len(texts) / elapsed,
      "tokens_per_sec": generated_tokens / elapsed,
      "beam_size": config.beam_size,
      "alpha": config.length_penalty_alpha,
  }
  # Perplexity with teacher forcing, unsmoothed, on the same split.
  p_eval_step = trainer.jit_eval_step(translator.model, config,
                                      jax.tree.map(lambda x: x.sharding, translator.params),
                                      translator.mesh)
  loss = evaluate_loss(p_eval_step, translator.params, batches, translator.mesh,
                       translator.rules)
  results["ppl"] = loss["ppl"]
  results["ce"] = loss["ce"]

  out_dir = os.path.join(workdir, "eval")
  os.makedirs(out_dir, exist_ok=True)
  averaged = f"-avg{translator.average_last}" if translator.average_last > 1 else ""
  stem = os.path.join(out_dir, f"{split}-{translator.step}{averaged}")
  for suffix, lines in (("src", sources), ("ref", references), ("hyp", hypotheses)):
    with open(f"{stem}.{suffix}.txt", "w", encoding="utf-8") as f:
      f.writelines(line.replace("\n", " ") + "\n" for line in lines)
  with open(f"{stem}.json", "w") as f:
    json.dump(results, f, indent=2)
  results["path"] = f"{stem}.json"
  if not math.isfinite(results["ppl"]):
    raise RuntimeError(f"perplexity on {split} is {results['ppl']}")
  return results
