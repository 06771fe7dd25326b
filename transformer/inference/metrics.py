"""Step metrics -> the numbers people read: summed on the host, averaged per token.

Steps return sums over real (non-padding) target tokens (model/loss.py: cross_entropy_sums), so
metrics of many batches, or of several microbatches, combine exactly by adding them
before dividing by the total token count. `ValidationLoss` is the loss and perplexity
of a model's parameters on the validation split: what training runs every
eval_every_steps, below training so that evaluation can add to it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from transformer import data
from transformer.inference import scoring, sharding
from transformer.inference.model_setup import ModelSetup


def sum_metrics(pending: list[dict]) -> dict[str, float]:
  """Fetches step metrics from the devices and adds them key by key ({} for none)."""
  fetched = jax.device_get(pending)
  return {k: float(np.sum([m[k] for m in fetched])) for k in (fetched[0] if fetched else ())}


def token_averages(sums: dict[str, float]) -> dict[str, float]:
  """Per-token loss (smoothed), cross-entropy, perplexity and accuracy from summed metrics.

  `ce` is the unsmoothed cross-entropy in nats; its exponential is the perplexity the
  paper reports (capped at exp(50) so a diverged run still prints a number). No tokens
  (an empty split) gives zeros and perplexity 1, not an error.
  """
  sums = {"loss_sum": 0.0, "ce_sum": 0.0, "correct_sum": 0.0, "num_tokens": 0.0, **sums}
  tokens = max(sums["num_tokens"], 1.0)
  ce = sums["ce_sum"] / tokens
  return {
    "loss": sums["loss_sum"] / tokens,
    "ce": ce,
    "ppl": math.exp(min(ce, 50.0)),
    "accuracy": sums["correct_sum"] / tokens,
    "num_tokens": sums["num_tokens"],
  }


def evaluate_loss(
  p_eval_step, params: Any, eval_batches: Iterable[dict], mesh, rules
) -> dict[str, float]:
  """Unsmoothed cross-entropy and perplexity over `eval_batches`: whole batches, the same
  on every process (data.make_eval_batches)."""
  pending = []
  for batch in eval_batches:
    batch = {k: v for k, v in batch.items() if k != "index"}
    pending.append(p_eval_step(params, sharding.global_batch_from_whole(batch, mesh, rules)))
  return token_averages(sum_metrics(pending))


class ValidationLoss:
  """Loss and perplexity on the validation split, or on num_eval_batches of its batches
  spread over all sentence lengths (the same ones at every evaluation).

  Training's loop builds it as `ValidationLoss(config, model_setup, tokenizer)` and calls
  it with the parameters every eval_every_steps; evaluation.validation.ValidationWithBleu
  adds the BLEU of a beam-searched subset (what train.py runs).
  """

  def __init__(self, config, setup: ModelSetup, tokenizer):
    self.config, self.setup, self.tokenizer = config, setup, tokenizer
    self._eval_step = scoring.jit_eval_step(setup)
    self._batches = data.make_eval_batches(
      config, tokenizer, "validation", max_batches=config.num_eval_batches
    )

  def __call__(self, params) -> dict[str, Any]:
    return evaluate_loss(self._eval_step, params, self._batches, self.setup.mesh, self.setup.rules)
