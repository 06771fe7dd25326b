"""Input pipeline: datasets, the SentencePiece vocabulary, training and evaluation batches.

    source = data.make_source(config)                 # tfds name or tsv:PATH
    tokenizer = data.load_or_train_tokenizer(config, source=source)
    train_iter = data.make_train_iterator(config, tokenizer, source=source,
                                          process_index=..., process_count=...,
                                          row_multiple=...)
    eval_batches = data.make_eval_batches(config, tokenizer, "validation", source=source)

Batch format and token ids: batching.py and docs/data.md.
"""

from transformer.data.batching import pad_batch
from transformer.data.pipeline import load_raw_pairs, make_eval_batches, make_train_iterator
from transformer.data.sources import make_source
from transformer.data.tokenizer import (
  Tokenizer,
  get_tokenizer,
  load_or_train_tokenizer,
  load_workdir_tokenizer,
)

__all__ = [
  "Tokenizer",
  "get_tokenizer",
  "load_or_train_tokenizer",
  "load_raw_pairs",
  "load_workdir_tokenizer",
  "make_eval_batches",
  "make_source",
  "make_train_iterator",
  "pad_batch",
]
