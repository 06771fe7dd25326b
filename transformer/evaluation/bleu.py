"""Translation metrics: detokenized sacreBLEU, the paper's tokenized BLEU, and chrF.

Every BLEU here is computed by sacrebleu. The paper reports tokenized BLEU with compound
splitting (Tensor2Tensor's get_ende_bleu.sh); it runs about 0.7 to 1.0 above the
detokenized sacreBLEU, so results report both, with sacreBLEU's signature.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import sacrebleu

if TYPE_CHECKING:
  import sacremoses

# get_ende_bleu.sh: perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'. Python's re.sub
# scans like perl's /g (no overlapping matches), so "a-b-c" splits the same way.
_COMPOUND_HYPHEN = re.compile(r"(\S)-(\S)")


class Score(NamedTuple):
  score: float
  signature: str  # sacrebleu's description of how the score was computed


def sacre_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> Score:
  """Corpus BLEU on detokenized text, sacrebleu's defaults (13a tokenization, cased)."""
  metric = sacrebleu.metrics.BLEU()
  result = metric.corpus_score(list(hypotheses), [list(references)])
  return Score(result.score, str(metric.get_signature()))


@functools.cache
def _moses_tokenizer(lang: str) -> sacremoses.MosesTokenizer:
  # Imported here: its import (0.7 s of regular expressions) would otherwise be paid by
  # every process that loads validation, and only the paper's BLEU uses it.
  import sacremoses

  return sacremoses.MosesTokenizer(lang=lang)


def split_compounds(text: str) -> str:
  """'rich-text format' -> 'rich ##AT##-##AT## text format' (GNMT / ConvS2S / T2T)."""
  return _COMPOUND_HYPHEN.sub(r"\1 ##AT##-##AT## \2", text)


def paper_tokenize(text: str, lang: str) -> str:
  """Moses tokenization for `lang` (tokenizer.perl's defaults), then compound splitting."""
  return split_compounds(_moses_tokenizer(lang).tokenize(text, return_str=True))


def tokenized_bleu(hypotheses: Sequence[str], references: Sequence[str], lang: str) -> Score:
  """The paper's BLEU: both sides Moses-tokenized and compound-split, then BLEU on tokens.

  tokenize='none' scores the text as tokenized here; smooth_method='none' matches
  multi-bleu.perl (a corpus with no matching 4-gram scores 0).
  """
  # force: the text is tokenized on purpose, so sacrebleu's warning that it "looks
  # tokenized" is noise here (it does not change the score).
  metric = sacrebleu.metrics.BLEU(tokenize="none", smooth_method="none", force=True)
  result = metric.corpus_score(
    [paper_tokenize(h, lang) for h in hypotheses], [[paper_tokenize(r, lang) for r in references]]
  )
  return Score(result.score, str(metric.get_signature()))


def chrf(hypotheses: Sequence[str], references: Sequence[str]) -> Score:
  """Corpus chrF (character 6-grams, beta 2), sacrebleu's defaults."""
  metric = sacrebleu.metrics.CHRF()
  result = metric.corpus_score(list(hypotheses), [list(references)])
  return Score(result.score, str(metric.get_signature()))
