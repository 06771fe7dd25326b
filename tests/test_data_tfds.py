"""The tfds path: the bundled `tatoeba_en_es` builder and WMT through tfds mock data."""

import numpy as np
import pytest
import tensorflow_datasets as tfds

from transformer import config as config_lib
from transformer.config import EOS_ID
from transformer.data import pipeline, sources
from transformer.data import tokenizer as tokenizer_lib


@pytest.fixture(scope="session")
def tatoeba_builder(tmp_path_factory):
  """The full bundled corpus built once (about 15 s)."""
  builder = tfds.builder("tatoeba_en_es", data_dir=str(tmp_path_factory.mktemp("tfds")))
  builder.download_and_prepare()
  return builder


def test_tatoeba_splits_are_disjoint_by_english_sentence(tatoeba_builder):
  english = {}
  for split in ("train", "validation", "test"):
    texts = tatoeba_builder.as_dataset(split=split).map(lambda ex: ex["en"]).batch(8192)
    english[split] = [t for chunk in texts.as_numpy_iterator() for t in chunk]
  sets = {split: set(sentences) for split, sentences in english.items()}
  assert not sets["train"] & sets["validation"]
  assert not sets["train"] & sets["test"]
  assert not sets["validation"] & sets["test"]
  assert sum(len(s) for s in english.values()) == 140_868
  for split in ("validation", "test"):
    assert 1_700 <= len(english[split]) <= 2_300
  # Several Spanish translations of one English sentence stay together (there are some).
  assert len(english["validation"]) > len(sets["validation"])


# `tatoeba_builder` prepares the whole bundled corpus (about 24 s) for it in the fast tier.
@pytest.mark.slow
def test_tatoeba_source_default_direction_and_attribution(tatoeba_builder):
  config = config_lib.base_config()
  config.data_dir = tatoeba_builder.data_dir.rsplit("/tatoeba_en_es", 1)[0]
  pairs = pipeline.load_raw_pairs(config, "test")
  example = next(iter(tfds.as_numpy(tatoeba_builder.as_dataset(split="test").take(1))))
  assert pairs[0] == (example["en"].decode(), example["es"].decode())
  assert b"tatoeba.org" in example["attribution"]


def _wmt_config(tmp_path):
  config = config_lib.base_config()
  config.dataset = "wmt14_translate/de-en"
  config.direction = "en-de"
  config.data_dir = str(tmp_path / "tfds")
  config.vocab_cache_dir = str(tmp_path / "vocab")
  config.vocab_size = 60
  config.vocab_type = "unigram"
  config.max_len = 64
  config.tokens_per_batch = 256  # 40 mock pairs of random text fill a bucket of this
  config.eval_batch_size = 8
  return config


def test_wmt_mock_data_en_de_puts_english_on_the_source_side(tmp_path):
  config = _wmt_config(tmp_path)
  with tfds.testing.mock_data(num_examples=40):
    expected = [
      (ex["en"].decode(), ex["de"].decode())
      for ex in tfds.as_numpy(
        tfds.load("wmt14_translate/de-en", split="validation", data_dir=config.data_dir)
      )
    ]
    source = sources.make_source(config)
    pairs = pipeline.load_raw_pairs(config, "validation", source=source)
    tokenizer = tokenizer_lib.load_or_train_tokenizer(config, source=source)
    eval_batches = pipeline.make_eval_batches(config, tokenizer, "validation", source=source)
    train_batch = next(pipeline.make_train_iterator(config, tokenizer, source=source))
  assert pairs == expected  # (English, German): 'en-de' reversed tfds's (de, en)
  first_source = next(
    b["source"][list(b["index"]).index(0)] for b in eval_batches if 0 in b["index"]
  )
  encoded = tokenizer.encode(pairs[0][0])[: config.max_len - 1] + [EOS_ID]
  np.testing.assert_array_equal(first_source[: len(encoded)], encoded)
  assert set(train_batch) == {"source", "decoder_input", "target"}


def test_direction_must_name_the_datasets_languages(tmp_path):
  config = _wmt_config(tmp_path)
  config.direction = "en-fr"
  with (
    tfds.testing.mock_data(num_examples=4),
    pytest.raises(config_lib.ConfigError, match="direction"),
  ):
    sources.make_source(config)
