"""A speculative-decoding draft trained on its target's vocabulary (config.vocab_from,
configs/default.py:draft), the decoder-only loss switch (config.lm_loss), and the
matched-parameter sweep configs/sweeps/decoder_only_vs_encoder_decoder.py."""

import os

import numpy as np
import pytest

from tests.helpers import tiny_run
from transformer import config as config_lib
from transformer.config import EOS_ID
from transformer.data import pipeline
from transformer.data import tokenizer as tokenizer_lib

SWEEP = os.path.join(tiny_run.REPO, "configs/sweeps/decoder_only_vs_encoder_decoder.py")


def test_default_config_draft_variant_has_one_layer_per_stack_and_the_same_vocabulary():
  default = config_lib.load_config("configs/default.py")
  draft = config_lib.load_config("configs/default.py:draft")
  config_lib.validate(draft)
  assert (default.model.num_layers, draft.model.num_layers) == (3, 1)
  # Only the layer count differs: the draft reads the target's ids and embeds them alike.
  changed = {k for k, v in config_lib.flatten(draft).items() if config_lib.flatten(default)[k] != v}
  assert changed == {"model.num_layers"}
  with pytest.raises(ValueError, match="must be empty, 'draft' or 'shallow_draft'"):
    config_lib.load_config("configs/default.py:big")


def test_default_config_shallow_draft_variant_keeps_the_targets_model():
  default = config_lib.load_config("configs/default.py")
  shallow = config_lib.load_config("configs/default.py:shallow_draft")
  assert shallow.model.to_dict() == default.model.to_dict()
  assert (shallow.draft.num_layers, shallow.draft.shortlist_size) == (1, 1024)
  # It names no target: validation says which key to set, in one line.
  with pytest.raises(config_lib.ConfigError, match=r"^config.draft.target_workdir: is empty"):
    config_lib.validate(shallow)
  shallow.draft.target_workdir = "workdirs/spec_target"
  config_lib.validate(shallow)
  shallow.weight_decay = 0.1
  with pytest.raises(config_lib.ConfigError, match=r"^config.weight_decay: must be 0 for a "):
    config_lib.validate(shallow)


def test_a_draft_trained_with_vocab_from_gets_the_targets_vocabulary_bytes(
  small_corpus, trained_run, tmp_path
):
  from transformer.training import loop

  _, target_workdir = trained_run
  # A different size: trained, or taken from the cache, this vocabulary would differ.
  config = tiny_run.make_config(
    small_corpus,
    num_train_steps=1,
    checkpoint_every_steps=1,
    vocab_from=target_workdir,
    vocab_size=300,
  )
  config_lib.validate(config)
  loop.train_and_evaluate(config, str(tmp_path / "draft"))
  target_vocab = (tmp_path / "draft" / "vocab.model").read_bytes()
  with open(os.path.join(target_workdir, "vocab.model"), "rb") as f:
    assert target_vocab == f.read()


def test_vocab_from_a_workdir_without_a_vocabulary_is_a_one_line_error(small_corpus, tmp_path):
  config = tiny_run.make_config(small_corpus, vocab_from=str(tmp_path / "nothing"))
  with pytest.raises(config_lib.ConfigError, match=r"^config.vocab_from: no vocab.model in "):
    tokenizer_lib.get_tokenizer(config, str(tmp_path / "run"))
  assert not (tmp_path / "run" / "vocab.model").exists()


def test_lm_loss_is_validated_in_one_line():
  config = config_lib.base_config()
  config.lm_loss = "source"
  with pytest.raises(
    config_lib.ConfigError, match=r"^config.lm_loss: 'source' is not one of target, sequence$"
  ):
    config_lib.validate(config)
  config.lm_loss = "sequence"  # an encoder-decoder model has only a target loss
  with pytest.raises(
    config_lib.ConfigError,
    match=r"^config.lm_loss: 'sequence' needs "
    r"model.decoder_only=True",
  ):
    config_lib.validate(config)
  config.model.decoder_only = True
  config_lib.validate(config)


def _first_batch(small_corpus, lm_loss):
  config = tiny_run.make_config(small_corpus, lm_loss=lm_loss, **{"model.decoder_only": True})
  config_lib.validate(config)
  tokenizer = tokenizer_lib.load_or_train_tokenizer(config)
  iterator = pipeline.make_train_iterator(config, tokenizer)
  try:
    return next(iterator)
  finally:
    iterator.close()


def test_lm_loss_target_zeroes_the_source_and_sequence_keeps_it(small_corpus):
  target_only = _first_batch(small_corpus, "target")
  sequence = _first_batch(small_corpus, "sequence")
  # The same pairs in the same rows (one per row: length buckets); only the loss differs.
  np.testing.assert_array_equal(target_only["decoder_input"], sequence["decoder_input"])
  for masked, whole in zip(target_only["target"], sequence["target"]):
    length = int(np.sum(whole != 0))
    assert (whole[:length] != 0).all() and not whole[length:].any()  # then padding
    eos = np.flatnonzero(whole == EOS_ID)
    assert len(eos) == 2 and eos[1] == length - 1  # source + EOS + target + EOS
    source_end = eos[0] + 1
    assert not masked[:source_end].any()  # target: no loss on the source nor its EOS
    np.testing.assert_array_equal(masked[source_end:], whole[source_end:])
  # The plain translation example is untouched by the switch.
  source, target = np.array([5, EOS_ID]), np.array([6, 7, EOS_ID])
  example = pipeline.make_example(source, target, decoder_only=False, lm_loss="sequence")
  assert set(example) == {"source", "target"}


def test_matched_parameter_sweep_rows_are_within_ten_percent():
  from transformer.sweeps.spec import load_sweep, row_config
  from transformer.training import state

  sweep = load_sweep(SWEEP)
  assert [row.name for row in sweep.rows] == ["encoder_decoder", "decoder_only"]
  counts = {}
  for row in sweep.rows:
    config = row_config(sweep, row)
    counts[row.name] = state.setup(config).num_params  # shapes only: nothing trains
  assert not config_lib.load_config(sweep.base_config).model.decoder_only
  ratio = counts["decoder_only"] / counts["encoder_decoder"]
  assert 0.9 < ratio < 1.1, counts
