"""Decoder-only models with every position kind and batching: rows of source + target fill
the longest bucket, training stays finite, and cached decoding gives the tokens of the
decoder rerun over the whole prefix. The learned position table covers all of it
(config.position_table_size), for any lengths."""

import math

import numpy as np
import pytest

from tests.helpers import tiny_run
from transformer import config as config_lib
from transformer.data import batching as batching_lib
from transformer.data import pipeline
from transformer.evaluation import translate
from transformer.model import decoding
from transformer.tools.decoding_speed import Recomputing
from transformer.training import loop

MAX_LEN = 8  # with clipping, decoder-only rows of 2 * 8 tokens fill the top bucket


@pytest.mark.parametrize("batching", ["tokens", "packed"])
@pytest.mark.parametrize("positional", ["sinusoidal", "learned", "rope"])
def test_decoder_only_trains_and_decodes_as_the_uncached_model(
  small_corpus, tmp_path, positional, batching
):
  config = tiny_run.make_config(
    small_corpus,
    num_train_steps=3,
    checkpoint_every_steps=3,
    max_len=MAX_LEN,
    drop_long_examples=False,
    max_decode_extra_len=4,
    batching=batching,
    eval_batch_size=16,
    **{"model.decoder_only": True, "model.positional": positional},
  )
  workdir = str(tmp_path / "run")
  loop.train_and_evaluate(config, workdir)
  losses = [r["loss"] for r in tiny_run.read_metrics(workdir)]
  assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses

  translator = translate.Translator(config, workdir, settings=translate.SearchSettings("greedy"))
  source = pipeline.make_eval_batches(config, translator.tokenizer, "test")[-1]["source"]
  assert source.shape[1] == MAX_LEN  # prompts of 1 + 8 tokens and 8 + 4 outputs
  cached = translator.generate(source)
  prompts = decoding.translation_prompts(source, config.max_decode_extra_len, True)
  uncached = decoding.decode(
    Recomputing(translator.model), translator.params, prompts, decoding.Greedy()
  )
  np.testing.assert_array_equal(cached, uncached.tokens_BxO)
  assert np.all(np.isfinite(uncached.scores_B))


def positions_used(config) -> dict[str, int]:
  """How many positions each reader of the table needs, counted apart from
  config.position_table_size: training rows (length buckets up to the longest row rounded
  up, or packed rows of exactly the longest row), evaluation rows (at most the longest
  row), and generation (BOS, a decoder-only model's source, and all but the last output)."""
  sides = 2 if config.model.decoder_only else 1
  row = sides * config.max_len
  training = row if config.batching == "packed" else -(-row // 8) * 8
  prompt = 1 + (config.max_len if config.model.decoder_only else 0)
  return {
    "training rows": training,
    "evaluation rows": row,
    "generation": prompt + config.max_len + config.max_decode_extra_len - 1,
  }


def test_no_config_can_look_past_the_learned_position_table():
  """Every reader of the table fits, for any lengths: the data pipeline's rows and the
  longest generation."""
  for decoder_only in (False, True):
    for batching in ("tokens", "packed"):
      for max_len in (2, 7, 16, 17, 64, 100):
        for extra in (1, 5, 50):
          config = config_lib.base_config()
          config.model.positional, config.model.decoder_only = "learned", decoder_only
          config.batching, config.max_len, config.max_decode_extra_len = (batching, max_len, extra)
          config_lib.validate(config)
          table = config_lib.position_table_size(config)
          used = positions_used(config)
          assert max(used.values()) <= table
          # What the data pipeline builds: length buckets or packed rows, and evaluation
          # batches padded geometrically, capped at the longest row.
          row = (2 if decoder_only else 1) * max_len
          built = row if batching == "packed" else batching_lib.bucket_lengths(row)[-1]
          assert built == used["training rows"]
          assert batching_lib.geometric_length(row, row) == used["evaluation rows"]


def test_a_continuation_past_the_learned_table_is_refused_in_one_line():
  config = config_lib.base_config()
  config.model.positional, config.model.decoder_only = "learned", True
  table = config_lib.position_table_size(config)  # 179 for max_len 64, extra 50
  prompt = config.max_len + 1
  translate.check_generation_length(config, prompt, table - prompt)
  with pytest.raises(config_lib.ConfigError) as error:
    translate.check_generation_length(config, prompt, table - prompt + 1)
  assert str(error.value) == (
    f"max_new_tokens: {table - prompt + 1} after a prompt of up to "
    f"{prompt} tokens passes the {table} learned positions; use at "
    f"most {table - prompt}"
  )
  config.model.positional = "rope"  # no table: any length
  translate.check_generation_length(config, prompt, 10 * table)
