"""TSV reading, the by-source-sentence split rule, and one-line errors for bad files."""

import gzip

import pytest

from transformer import config as config_lib
from transformer.config import ConfigError
from transformer.data import sources, tsv


def _write(path, data: bytes):
  path.write_bytes(data)
  return str(path)


def test_malformed_lines_are_skipped_and_counted(tmp_path):
  path = _write(
    tmp_path / "pairs.tsv",
    b"".join(
      [
        b"Hello.\tHola.\tattribution one\n",
        b"no tab on this line\n",
        b"\tempty source\n",
        b"empty target\t \n",
        b"bad bytes \xff\xfe\tmalos\n",
        b"Thanks.\tGracias.\r\n",
        b"\n",
      ]
    ),
  )
  contents = tsv.read_tsv(path)
  assert contents.pairs == [("Hello.", "Hola."), ("Thanks.", "Gracias.")]
  assert contents.extras == ["attribution one", ""]
  assert contents.line_numbers == [1, 6]
  assert contents.skipped == {"no tab": 1, "empty side": 2, "not UTF-8": 1}


def test_gzip_is_read(tmp_path):
  path = _write(tmp_path / "pairs.tsv.gz", gzip.compress(b"a\tb\nc\td\n"))
  assert tsv.read_tsv(path).pairs == [("a", "b"), ("c", "d")]


def test_file_without_usable_lines_is_a_one_line_error(tmp_path):
  path = _write(tmp_path / "empty.tsv", b"only text\n\t\n")
  with pytest.raises(ConfigError, match="no usable") as error:
    tsv.read_tsv(path)
  assert path in str(error.value) and "\n" not in str(error.value)


def test_missing_file_errors_when_the_source_is_made(tmp_path):
  config = config_lib.base_config()
  config.dataset = f"tsv:{tmp_path}/missing.tsv"
  with pytest.raises(ConfigError, match="not found") as error:
    sources.make_source(config)
  assert "missing.tsv" in str(error.value) and "\n" not in str(error.value)


def test_split_is_decided_by_the_source_sentence(tmp_path):
  # 300 source sentences with 3 translations each: no source sentence in two splits.
  lines = [f"sentence {i}.\ttranslation {i}.{j}\n" for i in range(300) for j in range(3)]
  path = _write(tmp_path / "pairs.tsv", "".join(lines).encode())
  source = sources.TsvSource(path)
  seen = {split: {s for s, _ in source.pairs(split)} for split in tsv.SPLITS}
  assert not seen["train"] & seen["validation"]
  assert not seen["train"] & seen["test"]
  assert not seen["validation"] & seen["test"]
  assert all(seen.values())  # 5% held out each: some of 300 sentences in every split
  assert sum(len(source.pairs(s)) for s in tsv.SPLITS) == 900
  for split, sentences in seen.items():
    for sentence in sentences:
      assert tsv.split_of(sentence, tsv.heldout_fraction(900)) == split


def test_separate_validation_file_keeps_its_pairs_and_main_file_feeds_train(tmp_path):
  main = _write(tmp_path / "train.tsv", "".join(f"s{i}\tt{i}\n" for i in range(200)).encode())
  validation = _write(tmp_path / "valid.tsv", b"v1\tw1\nv2\tw2\n")
  source = sources.TsvSource(main, validation_file=validation)
  assert source.pairs("validation") == [("v1", "w1"), ("v2", "w2")]
  # The main file's validation bucket goes to train; its test bucket stays test.
  assert len(source.pairs("train")) + len(source.pairs("test")) == 200
  assert source.pairs("test")
