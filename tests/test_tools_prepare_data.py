"""prepare_data: a config's dataset and vocabulary built once, where train.py then finds
them (the cluster scripts run it before training on many hosts)."""

from __future__ import annotations

import os

from tests.helpers import tiny_run
from transformer.data import tokenizer
from transformer.tools import prepare_data


def test_prepare_trains_the_vocabulary_into_the_cache_train_py_reads(small_corpus, tmp_path):
  config = tiny_run.make_config((small_corpus[0], str(tmp_path / "vocab")))
  dataset, vocabulary = prepare_data.prepare(config)
  assert dataset == f"tsv:{small_corpus[0]}"
  assert os.path.isfile(vocabulary)
  written = os.stat(vocabulary).st_mtime_ns
  # What a training run's first process loads instead of training its own.
  assert tokenizer.load_or_train_tokenizer(config).vocab_size == config.vocab_size
  assert prepare_data.prepare(config) == (dataset, vocabulary)
  assert os.stat(vocabulary).st_mtime_ns == written  # found in place, not trained again
