"""Metrics agree with sacrebleu and apply the paper's tokenization."""

import logging

import pytest
import sacrebleu
import sacremoses

from transformer.evaluation import bleu

HYPOTHESES = [
  "The cat sat on the mat.",
  "A well-known rule applies here.",
  "He isn't coming today, sadly.",
]
REFERENCES = [
  "The cat sat on a mat.",
  "A well-known rule applies.",
  "He is not coming today, sadly.",
]


def test_sacre_bleu_equals_sacrebleu_and_reports_its_signature():
  score = bleu.sacre_bleu(HYPOTHESES, REFERENCES)
  expected = sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES]).score
  assert 0 < score.score < 100
  assert score.score == pytest.approx(expected)
  assert "tok:13a" in score.signature and "version:" in score.signature


def test_chrf_equals_sacrebleu():
  score = bleu.chrf(HYPOTHESES, REFERENCES)
  assert 0 < score.score < 100
  assert score.score == pytest.approx(sacrebleu.corpus_chrf(HYPOTHESES, [REFERENCES]).score)
  assert "nc:6" in score.signature


def test_paper_tokenization_splits_compounds_on_both_sides():
  assert bleu.split_compounds("rich-text format") == "rich ##AT##-##AT## text format"
  assert bleu.split_compounds("a - b") == "a - b"  # a free-standing dash stays
  assert bleu.paper_tokenize("A well-known rule.", "en") == "A well ##AT##-##AT## known rule ."


def test_tokenized_bleu_scores_the_compound_split_moses_tokens():
  # Split, the compound is three tokens of which two match; whole, it is one wrong token:
  # the two protocols give different n-gram counts, and the score must be the split one.
  hyp, ref = ["the well-known rule applies here."], ["the well-liked rule applies here."]
  split_hyp, split_ref = (
    ["the well ##AT##-##AT## known rule applies here ."],
    ["the well ##AT##-##AT## liked rule applies here ."],
  )
  score = bleu.tokenized_bleu(hyp, ref, "en")
  assert score.score == pytest.approx(
    sacrebleu.corpus_bleu(split_hyp, [split_ref], tokenize="none", smooth_method="none").score
  )
  unsplit = sacrebleu.corpus_bleu(
    ["the well-known rule applies here ."],
    [["the well-liked rule applies here ."]],
    tokenize="none",
    smooth_method="none",
  ).score
  assert score.score > 0 and score.score != pytest.approx(unsplit)
  assert "tok:none" in score.signature

  moses = sacremoses.MosesTokenizer(lang="en")
  paper = lambda text: bleu.split_compounds(moses.tokenize(text, return_str=True))
  tokenized, references = [paper(t) for t in HYPOTHESES], [paper(t) for t in REFERENCES]
  assert bleu.tokenized_bleu(HYPOTHESES, REFERENCES, "en").score == pytest.approx(
    sacrebleu.corpus_bleu(tokenized, [references], tokenize="none", smooth_method="none").score
  )


def test_tokenized_bleu_does_not_warn_that_its_input_is_tokenized(caplog):
  """The paper's protocol scores tokenized text on purpose: no 'forgot to detokenize'."""
  hypotheses = ["the cat sat on the mat ."] * 120
  with caplog.at_level(logging.WARNING):
    bleu.tokenized_bleu(hypotheses, ["the cat sat on a mat ."] * 120, "en")
  assert not [r for r in caplog.records if "detokenize" in r.getMessage()]
  with caplog.at_level(logging.WARNING):  # the check above can see the warning
    sacrebleu.metrics.BLEU(tokenize="none").corpus_score(hypotheses, [hypotheses])
  assert [r for r in caplog.records if "detokenize" in r.getMessage()]
