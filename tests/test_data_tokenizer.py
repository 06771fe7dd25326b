"""The shared SentencePiece vocabulary (data/tokenizer.py), trained on a few hundred
sentences of the bundled corpus: fixed special ids, text <-> ids, saving and loading,
and the cache file name."""

import io
import os
import pathlib
import types

import numpy as np
import pytest
import sentencepiece as spm
import tensorflow as tf

from tests.helpers import tiny_run
from transformer import config as config_lib
from transformer.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, ConfigError
from transformer.data import tokenizer as tokenizer_lib

SPECIAL = {PAD_ID: "<pad>", EOS_ID: "</s>", BOS_ID: "<s>", UNK_ID: "<unk>"}


@pytest.fixture(scope="module")
def sentences(tmp_path_factory):
  """Both sides of every 400th pair of the bundled corpus: ~700 sentences."""
  path = tiny_run.write_small_corpus(str(tmp_path_factory.mktemp("corpus")), every=400)
  with open(path, encoding="utf-8") as f:
    return [side for line in f for side in line.rstrip("\n").split("\t")[:2]]


@pytest.fixture(scope="module")
def tokenizer(sentences):
  return tokenizer_lib.train_tokenizer(iter(sentences), vocab_size=200, vocab_type="bpe")


@pytest.mark.parametrize("vocab_type", ["bpe", "unigram"])
def test_trained_vocabulary_has_the_fixed_special_ids(sentences, vocab_type):
  """PAD=0 EOS=1 BOS=2 UNK=3 whatever the model type; other pieces come after them."""
  trained = tokenizer_lib.train_tokenizer(
    (s for s in sentences), vocab_size=200, vocab_type=vocab_type
  )
  assert trained.vocab_size == 200
  assert {i: trained.id_to_piece(i) for i in SPECIAL} == SPECIAL
  ids = [i for s in sentences[:50] for i in trained.encode(s)]
  assert min(ids) >= UNK_ID and max(ids) < 200


def test_too_large_a_vocabulary_shrinks_instead_of_failing(sentences):
  """A small corpus cannot fill 5,000 unigram pieces: it gets fewer, not an error."""
  trained = tokenizer_lib.train_tokenizer(iter(sentences), vocab_size=5000, vocab_type="unigram")
  assert 200 < trained.vocab_size < 5000


def test_encode_decode_round_trip(tokenizer, sentences):
  """Every sentence without an unknown piece decodes back to itself; encode adds
  neither EOS nor BOS."""
  known = 0
  for sentence in sentences:
    ids = tokenizer.encode(sentence)
    assert ids and EOS_ID not in ids and BOS_ID not in ids and PAD_ID not in ids
    if UNK_ID not in ids:
      assert tokenizer.decode(ids) == sentence
      known += 1
  assert known >= 0.9 * len(sentences)
  assert tokenizer.encode_batch(sentences[:5]) == [tokenizer.encode(s) for s in sentences[:5]]


def test_unseen_characters_are_unk(tokenizer):
  assert UNK_ID in tokenizer.encode("\u2603")  # a snowman is in no Tatoeba sentence


def test_decode_stops_at_eos_and_drops_pad_and_bos(tokenizer):
  """What the model emits decodes to its text: BOS and padding dropped anywhere, nothing
  after the first EOS; numpy integer arrays work as well as lists."""
  text = "Tom is here."
  ids = tokenizer.encode(text)
  other = tokenizer.encode("I like cats.")
  assert tokenizer.decode([BOS_ID] + ids + [EOS_ID] + other) == text
  assert tokenizer.decode([PAD_ID, BOS_ID] + ids[:1] + [PAD_ID] + ids[1:] + [PAD_ID]) == text
  assert tokenizer.decode(np.array(ids + [EOS_ID, EOS_ID] + other, np.int32)) == text
  assert tokenizer.decode([EOS_ID] + ids) == ""
  assert tokenizer.decode([]) == ""


def test_with_eos_appends_eos_and_clips_keeping_it():
  np.testing.assert_array_equal(tokenizer_lib.with_eos([5, 6, 7], 10), [5, 6, 7, EOS_ID])
  np.testing.assert_array_equal(tokenizer_lib.with_eos([5, 6, 7], 4), [5, 6, 7, EOS_ID])
  clipped = tokenizer_lib.with_eos([5, 6, 7, 8, 9], 4)
  np.testing.assert_array_equal(clipped, [5, 6, 7, EOS_ID])
  assert clipped.dtype == np.int32
  np.testing.assert_array_equal(tokenizer_lib.with_eos([], 4), [EOS_ID])
  np.testing.assert_array_equal(tokenizer_lib.with_eos(np.arange(4, 20), 3), [4, 5, EOS_ID])


def test_encode_for_model_is_ids_plus_eos_within_max_len(tokenizer, sentences):
  """Each text becomes its ids and EOS, clipped to max_len tokens with EOS kept last."""
  long_text = " ".join(sentences[:10])
  texts = ["I like cats.", "", long_text]
  encoded = tokenizer.encode_for_model(texts, max_len=12)
  assert len(encoded) == 3
  np.testing.assert_array_equal(encoded[0], tokenizer.encode(texts[0]) + [EOS_ID])
  np.testing.assert_array_equal(encoded[1], [EOS_ID])
  assert len(tokenizer.encode(long_text)) > 12
  np.testing.assert_array_equal(encoded[2], tokenizer.encode(long_text)[:11] + [EOS_ID])
  assert all(e.dtype == np.int32 for e in encoded)


def test_save_writes_through_a_temporary_file_and_loads_back(tokenizer, tmp_path, monkeypatch):
  """save() creates missing directories, writes the whole model to a temporary name in
  the same directory, then renames it over the target, leaving nothing else behind;
  load() gives back the same model."""
  path = str(tmp_path / "a" / "b" / "vocab.model")
  renames = []
  real_rename = tf.io.gfile.rename

  def rename(source, destination, overwrite=False):
    renames.append(
      (
        source,
        destination,
        overwrite,
        os.path.exists(destination),
        pathlib.Path(source).read_bytes() == tokenizer.model_proto,
      )
    )
    real_rename(source, destination, overwrite=overwrite)

  monkeypatch.setattr(tf.io.gfile, "rename", rename)
  tokenizer.save(path)
  [(source, destination, overwrite, existed, complete)] = renames
  assert destination == path and overwrite and not existed and complete
  assert os.path.dirname(source) == os.path.dirname(path)
  assert os.path.basename(source).startswith("vocab.model.tmp-")
  assert os.listdir(os.path.dirname(path)) == ["vocab.model"]

  loaded = tokenizer_lib.Tokenizer.load(path)
  assert loaded.model_proto == tokenizer.model_proto
  assert loaded.encode("Tom is here.") == tokenizer.encode("Tom is here.")


def test_save_replaces_an_existing_file(tokenizer, sentences, tmp_path):
  path = str(tmp_path / "vocab.model")
  other = tokenizer_lib.train_tokenizer(iter(sentences), vocab_size=150, vocab_type="bpe")
  other.save(path)
  tokenizer.save(path)
  assert tokenizer_lib.Tokenizer.load(path).vocab_size == 200
  assert os.listdir(tmp_path) == ["vocab.model"]


def test_a_model_with_other_special_ids_is_refused(sentences):
  """A SentencePiece model trained with its own defaults (unk=0, bos=1, eos=2, no pad)
  would silently scramble every id the model relies on: it is refused."""
  writer = io.BytesIO()
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(sentences), model_writer=writer, vocab_size=100, minloglevel=2
  )
  with pytest.raises(
    ValueError,
    match=r"pad/eos/bos/unk ids \(-1, 2, 1, 0\), expected "
    r"\(0, 1, 2, 3\)",
  ):
    tokenizer_lib.Tokenizer(writer.getvalue())


def _source(name="tsv:/data/corpus.tsv", cache_key="tsv:/data/corpus.tsv:abc"):
  return types.SimpleNamespace(name=name, cache_key=cache_key)


@pytest.mark.parametrize(
  "key,value",
  [
    ("direction", "es-en"),
    ("vocab_type", "unigram"),
    ("vocab_size", 8001),
    ("vocab_max_sentences", 1000),
  ],
)
def test_vocab_cache_path_changes_with_every_setting_it_depends_on(key, value):
  config = config_lib.base_config()
  config.vocab_cache_dir = "/cache"
  path = tokenizer_lib.vocab_cache_path(config, _source())
  assert path == tokenizer_lib.vocab_cache_path(config.copy_and_resolve_references(), _source())
  changed = config.copy_and_resolve_references()
  changed[key] = value
  assert tokenizer_lib.vocab_cache_path(changed, _source()) != path


def test_vocab_cache_path_depends_on_the_data_not_on_other_settings():
  """Another corpus (cache key) is another vocabulary; model or batch settings are not."""
  config = config_lib.base_config()
  config.vocab_cache_dir = "/cache"
  path = tokenizer_lib.vocab_cache_path(config, _source())
  assert tokenizer_lib.vocab_cache_path(config, _source(cache_key="other")) != path
  unrelated = config.copy_and_resolve_references()
  unrelated.max_len, unrelated.model.d_model, unrelated.seed = 12, 16, 5
  assert tokenizer_lib.vocab_cache_path(unrelated, _source()) == path
  assert os.path.dirname(path) == "/cache"
  assert os.path.basename(path).startswith("corpus_tsv_en-es_bpe8000_")
  assert path.endswith(".model")


def test_vocab_cache_dir_defaults_under_data_dir_or_home(monkeypatch):
  config = config_lib.base_config()
  config.data_dir = "/data/tfds"
  assert os.path.dirname(tokenizer_lib.vocab_cache_path(config, _source())) == (
    "/data/tfds/transformer_vocab"
  )
  config.data_dir = ""
  monkeypatch.setenv("HOME", "/home/someone")
  assert os.path.dirname(tokenizer_lib.vocab_cache_path(config, _source())) == (
    "/home/someone/.cache/transformer_vocab"
  )


def test_load_workdir_tokenizer(tokenizer, tmp_path):
  """A missing WORKDIR/vocab.model is a one-line ConfigError naming the workdir."""
  with pytest.raises(ConfigError) as error:
    tokenizer_lib.load_workdir_tokenizer(str(tmp_path))
  assert str(error.value) == (f"workdir: no vocab.model in {tmp_path} (was it trained here?)")
  tokenizer_lib.copy_vocab_to_workdir(tokenizer, str(tmp_path))
  assert tokenizer_lib.load_workdir_tokenizer(str(tmp_path)).model_proto == (tokenizer.model_proto)


def test_a_stalled_vocabulary_read_is_a_timeout_naming_the_file(tokenizer, tmp_path, monkeypatch):
  """Reading a resumed run's vocab.model from a stalled bucket: one line after
  storage_timeout_s, naming the file, rather than a wait as long as the client retries."""
  import threading

  from transformer import storage

  tokenizer_lib.copy_vocab_to_workdir(tokenizer, str(tmp_path))
  release = threading.Event()
  load = tokenizer_lib.Tokenizer.load.__func__

  def stalled_load(cls, path):
    release.wait(30)
    return load(cls, path)

  monkeypatch.setattr(tokenizer_lib.Tokenizer, "load", classmethod(stalled_load))
  config = config_lib.base_config()
  config.storage_timeout_s = 0.3
  path = os.path.join(str(tmp_path), tokenizer_lib.WORKDIR_VOCAB_NAME)
  # Training's read, and a trained run's (eval.py, generate.py, the export) given the
  # run's timeout.
  for read in (
    lambda: tokenizer_lib.get_tokenizer(config, str(tmp_path)),
    lambda: tokenizer_lib.load_workdir_tokenizer(str(tmp_path), config.storage_timeout_s),
  ):
    try:
      with pytest.raises(storage.StorageTimeout) as error:
        read()
    finally:
      release.set()
    release.clear()
    assert str(error.value).startswith(
      f"reading {path} did not finish within 0.3 s (config.storage_timeout_s)"
    )
  monkeypatch.undo()
  assert tokenizer_lib.get_tokenizer(config, str(tmp_path)).model_proto == tokenizer.model_proto
