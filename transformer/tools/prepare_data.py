r"""Prepare a config's dataset and vocabulary once, before a job of many hosts reads them.

    python -m transformer.tools.prepare_data --config configs/wmt14.py:big \
        --config.data_dir=gs://BUCKET/tfds

Builds the tfds dataset into config.data_dir (downloads it, or reads config.manual_dir)
and trains the SentencePiece vocabulary into its cache (config.vocab_cache_dir, by
default DATA_DIR/transformer_vocab), then prints both paths. Run it on one host, with
the same config and overrides as train.py; every host of the job then reads the prepared
copy instead of building its own (docs/clusters.md). A TSV dataset needs no preparing:
only its vocabulary is trained. Rerunning it finds both in place and returns at once.
"""

import sys

from absl import app
from ml_collections import config_flags

from transformer import cli
from transformer import config as config_lib

_FLAG_VALUES = cli.program_flags(__name__)  # absl's only when run as a program
_CONFIG = config_flags.DEFINE_config_file(
  "config",
  config_lib.DEFAULT_CONFIG,
  "Config file, optionally FILE:ARG, with train.py's overrides (--config.data_dir=...).",
  flag_values=_FLAG_VALUES,
)


def prepare(config) -> tuple[str, str]:
  """(where the dataset is, where its vocabulary is), each built if missing."""
  from transformer import data
  from transformer.data import tokenizer

  config_lib.validate(config)
  source = data.make_source(config)
  source.prepare()
  where = getattr(source, "builder", None)
  dataset = where.data_dir if where is not None else source.name
  if config.vocab_from:  # another run's vocabulary: nothing to train
    return dataset, f"{config.vocab_from} (config.vocab_from)"
  data.load_or_train_tokenizer(config, source=source)
  return dataset, tokenizer.vocab_cache_path(config, source)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    dataset, vocabulary = prepare(_CONFIG.value)
  except config_lib.ConfigError as e:
    sys.exit(f"error: {e}")
  print(f"dataset: {dataset}\nvocabulary: {vocabulary}")


if __name__ == "__main__":
  cli.run(main)
