"""Validation during training with BLEU: the loop's loss and perplexity, plus the sacreBLEU
of the first config.eval_bleu_sentences validation sentences, beam-searched (a decoder-only
model continues BOS + source + EOS, see translate.py).

train.py hands `ValidationWithBleu` to `training.loop.train_and_evaluate`, which builds it
with the model set-up: neither layer imports the other (the loss part is
`inference.metrics.ValidationLoss`).
"""

from __future__ import annotations

from typing import Any

from transformer import data
from transformer.evaluation import bleu, translate
from transformer.inference.metrics import ValidationLoss


class ValidationWithBleu(ValidationLoss):
  def __init__(self, config, run_setup, tokenizer):
    super().__init__(config, run_setup, tokenizer)
    self._bleu_pairs = []
    # Either kind of model: a decoder-only one continues BOS + source + EOS (translate.py).
    if config.eval_bleu_sentences:
      self._bleu_pairs = data.load_raw_pairs(config, "validation")[: config.eval_bleu_sentences]

  def __call__(self, params) -> dict[str, Any]:
    result = super().__call__(params)
    if self._bleu_pairs:  # the paper's beam search, with the parameters trained so far
      generator = translate.Generator(self.setup, params, self.tokenizer)
      hypotheses = generator.translate_lines([x for x, _ in self._bleu_pairs])
      result["bleu"] = bleu.sacre_bleu(hypotheses, [r for _, r in self._bleu_pairs]).score
    return result
