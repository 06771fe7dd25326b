"""Input pipeline: datasets, the SentencePiece vocabulary, training and evaluation batches.

    source = data.make_source(config)                 # tfds name or tsv:PATH
    tokenizer = data.load_or_train_tokenizer(config, source=source)
    train_iter = data.make_train_iterator(config, tokenizer, source=source,
                                          process_index=..., process_count=...,
                                          row_multiple=...)
    eval_batches = data.make_eval_batches(config, tokenizer, "validation", source=source)

Batch format and token ids: batching.py and docs/data.md.

The names below load their modules, and with them TensorFlow (about 3 s of CPU), when
first used, not when the package is imported: the tools that never read a sentence
(compile_check, memory, `train.py --dry_run`) import this package through the serving
layer and start without TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  from transformer.data.batching import pad_batch
  from transformer.data.pipeline import load_raw_pairs, make_eval_batches, make_train_iterator
  from transformer.data.sources import make_source
  from transformer.data.tokenizer import (
    Tokenizer,
    get_tokenizer,
    load_or_train_tokenizer,
    load_workdir_tokenizer,
  )

# Exported name -> the module of this package that defines it.
_MODULE_OF = {
  "pad_batch": "batching",
  "load_raw_pairs": "pipeline",
  "make_eval_batches": "pipeline",
  "make_train_iterator": "pipeline",
  "make_source": "sources",
  "Tokenizer": "tokenizer",
  "get_tokenizer": "tokenizer",
  "load_or_train_tokenizer": "tokenizer",
  "load_workdir_tokenizer": "tokenizer",
}

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


def __getattr__(name: str) -> Any:
  if name not in _MODULE_OF:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
  globals()[name] = value  # later reads skip this function
  return value
