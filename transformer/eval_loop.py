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
import numpy as np

from transformer import checkpoints, data, decoding, evaluation, sharding, trainer
from transformer import config as config_lib
from transformer.train_loop import evaluate_loss


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
    self.tokenizer = data.load_tokenizer(workdir)
    self.model = trainer.build_model(config)
    self.params, self.step = checkpoints.restore_params(
        workdir, config, self.mesh, step=step, average_last=average_last)
    self.average_last = average_last

  def search(self, source_BxS: np.ndarray) -> np.ndarray:
    """Beam search on a padded batch of source ids -> token ids [B, C]."""
    c = self.config
    source = sharding.global_batch({"source": source_BxS}, self.mesh, self.rules)["source"]
    tokens, _ = decoding.beam_search(
        self.model, self.params, source, beam_size=c.beam_size,
        alpha=c.length_penalty_alpha, max_decode_extra_len=c.max_decode_extra_len)
    return np.asarray(jax.device_get(tokens))

  def translate_lines(self, lines: Iterable[str]) -> list[str]:
    """Detokenized translations of raw sentences, in order (an empty line stays empty)."""
    lines = list(lines)
    outputs = [""] * len(lines)
    batch_size = self.config.eval_batch_size
    ids = [self.encode_source(line) for line in lines]
    todo = [i for i, line in enumerate(lines) if line.strip()]
    for start in range(0, len(todo), batch_size):
      chunk = todo[start:start + batch_size]
      source = data.pad_batch([ids[i] for i in chunk], rows=batch_size)
      tokens = self.search(source)
      for row, i in enumerate(chunk):
        outputs[i] = self.tokenizer.decode(tokens[row].tolist())
    return outputs

  def encode_source(self, text: str) -> list[int]:
    """Subword ids + EOS, clipped to max_len so an over-long input still translates."""
    ids = self.tokenizer.encode(text)[: self.config.max_len - 1]
    return ids + [config_lib.EOS_ID]


def evaluate_split(translator: Translator, split: str) -> dict[str, Any]:
  """Translates `split` once, in order; writes hypotheses and scores; returns scores."""
  config, workdir = translator.config, translator.workdir
  texts = data.eval_texts(config, split)  # [(source, reference)] in the split's order
  hypotheses: list[str | None] = [None] * len(texts)
  started = time.time()
  generated_tokens = 0
  for batch in data.make_eval_batches(config, translator.tokenizer, split):
    tokens = translator.search(batch["source"])
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
  loss = evaluate_loss(p_eval_step, translator.params,
                       data.make_eval_batches(config, translator.tokenizer, split),
                       translator.mesh, translator.rules)
  results["ppl"] = loss["ppl"]
  results["ce"] = loss["ce"]

  out_dir = os.path.join(workdir, "eval")
  os.makedirs(out_dir, exist_ok=True)
  stem = os.path.join(out_dir, f"{split}-{translator.step}")
  for suffix, lines in (("src", sources), ("ref", references), ("hyp", hypotheses)):
    with open(f"{stem}.{suffix}.txt", "w") as f:
      f.writelines(line.replace("\n", " ") + "\n" for line in lines)
  with open(f"{stem}.json", "w") as f:
    json.dump(results, f, indent=2)
  results["path"] = f"{stem}.json"
  if not math.isfinite(results["ppl"]):
    raise RuntimeError(f"perplexity on {split} is {results['ppl']}")
  return results
