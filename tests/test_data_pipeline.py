"""Training and evaluation streams on a small slice of the bundled corpus (tsv:PATH)."""

import gzip
import json
import weakref

import numpy as np
import pytest

from transformer import config as config_lib
from transformer.config import EOS_ID
from transformer.data import batching, pipeline, sources, tatoeba
from transformer.data import batching as batching_lib
from transformer.data import tokenizer as tokenizer_lib


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory):
  """Every 40th line of the bundled corpus: ~3,500 real pairs."""
  with gzip.open(tatoeba.CORPUS_PATH, "rt", encoding="utf-8") as f:
    lines = f.readlines()[::40]
  path = tmp_path_factory.mktemp("corpus") / "small.tsv"
  path.write_text("".join(lines), encoding="utf-8")
  return str(path)


def _config(corpus_path, cache_dir, **overrides):
  config = config_lib.base_config()
  config.dataset = f"tsv:{corpus_path}"
  config.vocab_size = 300
  config.vocab_cache_dir = str(cache_dir)
  config.max_len = 24
  config.tokens_per_batch = 384
  config.eval_batch_size = 16
  config.shuffle_buffer_size = 1000
  for key, value in overrides.items():
    config[key] = value
  return config


@pytest.fixture(scope="module")
def setup(corpus_path, tmp_path_factory):
  config = _config(corpus_path, tmp_path_factory.mktemp("vocab"))
  source = sources.make_source(config)
  return config, source, tokenizer_lib.load_or_train_tokenizer(config, source=source)


def _take(config, setup, n, **kwargs):
  _, source, tokenizer = setup
  iterator = pipeline.make_train_iterator(config, tokenizer, source=source, **kwargs)
  return [next(iterator) for _ in range(n)]


def _assert_same(batches_a, batches_b):
  assert len(batches_a) == len(batches_b)
  for a, b in zip(batches_a, batches_b):
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


def test_tokenizer_round_trip_and_fixed_ids(setup):
  _, _, tokenizer = setup
  assert tokenizer.vocab_size == 300
  ids = tokenizer.encode("I like cats.")
  assert ids and min(ids) > 3
  assert tokenizer.decode([2] + ids + [EOS_ID, 7, 8]) == "I like cats."
  assert tokenizer.id_to_piece(0) == "<pad>" and tokenizer.id_to_piece(1) == "</s>"


def test_vocab_cache_is_reused_and_copied_to_workdir(setup, monkeypatch, tmp_path):
  config, source, tokenizer = setup

  def no_training(*args, **kwargs):
    raise AssertionError("the cached vocabulary should have been reused")

  monkeypatch.setattr(tokenizer_lib, "train_tokenizer", no_training)
  again = tokenizer_lib.load_or_train_tokenizer(config, source=source)
  assert again.model_proto == tokenizer.model_proto
  other = config.copy_and_resolve_references()
  other.vocab_size = 301
  assert tokenizer_lib.vocab_cache_path(other, source) != tokenizer_lib.vocab_cache_path(
    config, source
  )
  tokenizer_lib.copy_vocab_to_workdir(tokenizer, str(tmp_path))
  assert tokenizer_lib.load_workdir_tokenizer(str(tmp_path)).model_proto == tokenizer.model_proto


@pytest.mark.parametrize("batching", ["tokens", "packed"])
def test_same_seed_same_batches_other_seed_differs(setup, batching):
  config = setup[0].copy_and_resolve_references()
  config.batching = batching
  first = _take(config, setup, 4, row_multiple=2)
  _assert_same(first, _take(config, setup, 4, row_multiple=2))
  config.seed = 1
  other = _take(config, setup, 4, row_multiple=2)
  assert any(
    a["target"].shape != b["target"].shape or (a["target"] != b["target"]).any()
    for a, b in zip(first, other)
  )


@pytest.mark.parametrize("batching", ["tokens", "packed"])
def test_batches_hold_the_budget_in_real_tokens_in_few_shapes(setup, batching):
  config = setup[0].copy_and_resolve_references()
  config.batching = batching
  _, source, tokenizer = setup
  iterator = pipeline.make_train_iterator(config, tokenizer, source=source, row_multiple=4)
  batches = [next(iterator) for _ in range(60)]
  shapes = {batch["target"].shape for batch in batches}
  assert len(shapes) <= batching_lib.MAX_BUCKETS
  for rows, length in shapes:
    assert rows % 4 == 0 and length <= config.max_len
    assert iterator.rows_by_length[length] == rows
  # The fuller side of a batch holds up to tokens_per_batch real tokens, never more (on
  # average; rows come in multiples of 4, so up to 4 rows' worth less): more padded
  # slots than the budget, not fewer real tokens.
  real = [max(int((b[side] != 0).sum()) for side in ("source", "decoder_input")) for b in batches]
  assert 0.8 * config.tokens_per_batch < np.mean(real) <= config.tokens_per_batch
  assert np.mean([b["target"].size for b in batches]) > 1.05 * config.tokens_per_batch


@pytest.mark.parametrize("batching", ["tokens", "packed"])
def test_two_processes_make_the_same_global_batches(setup, batching):
  config = setup[0].copy_and_resolve_references()
  config.batching = batching
  single = _take(config, setup, 5, row_multiple=2)
  parts = [
    _take(config, setup, 5, process_index=p, process_count=2, row_multiple=2) for p in range(2)
  ]
  joined = [{k: np.concatenate([a[k], b[k]]) for k in a} for a, b in zip(*parts)]
  assert parts[0][0]["target"].shape == parts[1][0]["target"].shape
  _assert_same(single, joined)


def test_restored_state_gives_the_same_next_batches_across_epochs(setup):
  config = setup[0].copy_and_resolve_references()
  config.batching = "packed"
  config.tokens_per_batch = 24 * 96  # big batches: an epoch is about ten steps
  _, source, tokenizer = setup
  iterator = pipeline.make_train_iterator(config, tokenizer, source=source)
  epoch_length = None
  for step in range(25):
    next(iterator)
    if epoch_length is None and iterator.get_state()["epoch"] == 1:
      epoch_length = step
  assert epoch_length is not None  # the stream went on past the end of an epoch
  state = json.loads(json.dumps(iterator.get_state()))
  expected = [next(iterator) for _ in range(3)]
  resumed = pipeline.make_train_iterator(config, tokenizer, source=source)
  resumed.set_state(state)
  _assert_same(expected, [next(resumed) for _ in range(3)])


def test_close_stops_the_tf_data_iterator_and_the_stream_goes_on_from_its_state(setup):
  config, source, tokenizer = setup
  expected = _take(config, setup, 4)
  iterator = pipeline.make_train_iterator(config, tokenizer, source=source)
  first = [next(iterator), next(iterator)]
  examples = iterator._batches.gi_frame.f_locals["examples"]
  tf_data_iterator = weakref.ref(examples.gi_frame.f_locals["chunks"])
  del examples
  iterator.close()
  assert tf_data_iterator() is None  # deleted now, its threads with it: not at exit
  iterator.close()  # a second close is harmless
  _assert_same(expected, first + [next(iterator), next(iterator)])


def test_decoder_only_batches(setup):
  config = setup[0].copy_and_resolve_references()
  config.model.decoder_only = True
  batch = _take(config, setup, 1)[0]
  assert set(batch) == {"decoder_input", "target"}
  # The loss covers exactly one segment per row: the target after the prompt's EOS.
  first_row_input = batch["decoder_input"][0]
  prompt_end = list(first_row_input).index(EOS_ID)  # decoder_input = BOS, prompt ... EOS
  assert (batch["target"][0][:prompt_end] == 0).all()
  assert batch["target"][0][prompt_end] != 0


def test_each_evaluation_sentence_exactly_once(setup):
  config, source, tokenizer = setup
  pairs = pipeline.load_raw_pairs(config, "validation", source=source)
  assert len(pairs) > config.eval_batch_size  # several batches, the last one partial
  batches = pipeline.make_eval_batches(config, tokenizer, "validation", source=source)
  indices, rows_by_index = [], {}
  for batch in batches:
    rows, length = batch["source"].shape
    assert rows == config.eval_batch_size
    # The smallest of 8, 16, 32, ... (or max_len) that holds the batch's longest source.
    longest = max(int((row != 0).sum()) for row in batch["source"])
    assert length in (8, 16, 32, 64, 128, 256, config.max_len) and length >= longest
    assert length == 8 or length // 2 < longest or length == config.max_len
    for row, index in enumerate(batch["index"]):
      indices.append(index)
      rows_by_index[index] = batch["source"][row]
  lengths = [b["source"].shape[1] for b in batches]
  assert lengths == sorted(lengths) and lengths[0] < lengths[-1]  # batched by length
  real = sorted(i for i in indices if i >= 0)
  assert real == list(range(len(pairs)))
  assert all(i == -1 for i in indices if i < 0)
  assert not rows_by_index.get(-1, np.zeros(1)).any()  # fill rows are all padding
  for index in (0, len(pairs) - 1):
    expected = tokenizer.encode(pairs[index][0])[: config.max_len - 1] + [EOS_ID]
    assert list(rows_by_index[index][: len(expected)]) == expected


def test_a_validation_subset_spans_every_length(setup):
  """num_eval_batches takes batches spread over the length order, the same every time:
  the first ones would hold only the shortest sentences."""
  config, source, tokenizer = setup
  every = pipeline.make_eval_batches(config, tokenizer, "validation", source=source)
  subset = pipeline.make_eval_batches(config, tokenizer, "validation", source=source, max_batches=3)
  assert len(every) >= 9 and len(subset) == 3
  positions = [[(b["index"] == s["index"]).all() for b in every].index(True) for s in subset]
  assert positions == [len(every) // 6, len(every) // 2, 5 * len(every) // 6]

  def mean_source_length(batches):
    real = np.concatenate([(b["source"] != 0).sum(1)[b["index"] >= 0] for b in batches])
    return real.mean()

  whole = mean_source_length(every)
  assert abs(mean_source_length(subset) - whole) < 0.15 * whole
  assert mean_source_length(every[:3]) < 0.7 * whole  # what the first batches measured
  assert pipeline.spread_over(list(range(10)), 0) == list(range(10))
  assert pipeline.spread_over(list(range(10)), 20) == list(range(10))
  assert pipeline.spread_over(list(range(10)), 1) == [5]


def test_long_pairs_are_dropped_or_clipped_keeping_eos():
  ids = np.array([5, 6, 7, 8, EOS_ID], np.int32)
  assert pipeline.fit_to_length(ids, 5, clip=False) is ids
  assert pipeline.fit_to_length(ids, 4, clip=False) is None
  np.testing.assert_array_equal(pipeline.fit_to_length(ids, 4, clip=True), [5, 6, 7, EOS_ID])


def test_get_tokenizer_copies_to_workdir_and_resumes_from_it(setup, tmp_path):
  config, source, tokenizer = setup
  workdir = tmp_path / "run"
  got = tokenizer_lib.get_tokenizer(config, str(workdir), source=source)
  assert (workdir / "vocab.model").read_bytes() == tokenizer.model_proto == got.model_proto
  # A resumed run uses the workdir's copy even if the settings now point elsewhere.
  other = config.copy_and_resolve_references()
  other.vocab_cache_dir = str(tmp_path / "empty_cache")
  resumed = tokenizer_lib.get_tokenizer(other, str(workdir))
  assert resumed.model_proto == tokenizer.model_proto


def test_pad_batch_fills_rows_and_rounds_length():
  padded = batching.pad_batch([[5, EOS_ID], [6, 7, 8, EOS_ID]], rows=3)
  np.testing.assert_array_equal(
    padded, [[5, EOS_ID, 0, 0, 0, 0, 0, 0], [6, 7, 8, EOS_ID, 0, 0, 0, 0], [0] * 8]
  )


# --- The stream on another mesh: the same examples in the same global batches.


def _ids_by_example(config, setup):
  """{(source ids, target ids) as training feeds them: example id}, the id being the
  pair's index in the training split. The slice holds no pair twice, so each example's
  tokens name it."""
  _, source, tokenizer = setup
  pairs = pipeline.load_raw_pairs(config, "train", source=source)
  ids = {}
  for index, (source_text, target_text) in enumerate(pairs):
    key = tuple(
      tuple(tokenizer_lib.with_eos(tokenizer.encode(text), config.max_len))
      for text in (source_text, target_text)
    )
    ids.setdefault(key, index)
  assert len(ids) > 0.99 * len(pairs)  # the few repeated pairs share an id
  return ids


def _example_ids(batch, ids):
  """Ids of the examples in a global batch, row by row and segment by segment."""
  found = []
  for row in range(len(batch["target"])):
    sides = []
    for side in ("source", "target"):
      tokens = batch[side][row]
      segments = batch.get(f"{side}_segment_ids", (batch[side] != 0).astype(np.int32))[row]
      sides.append(
        [tuple(tokens[(segments == s) & (tokens != 0)]) for s in range(1, segments.max() + 1)]
      )
    found += [ids[pair] for pair in zip(*sides)]
  return found


def _global_batches(config, setup, steps, state, processes, row_multiple, **kwargs):
  """`steps` global batches from `state` on `processes` hosts, each host's rows joined
  in process order (as sharding.global_batch lays them out)."""
  _, source, tokenizer = setup
  hosts = []
  for index in range(processes):
    iterator = pipeline.make_train_iterator(
      config,
      tokenizer,
      source=source,
      process_index=index,
      process_count=processes,
      row_multiple=row_multiple,
    )
    iterator.set_state(json.loads(json.dumps(state)), **kwargs)
    hosts.append(iterator)
  batches = []
  for _ in range(steps):
    parts = [next(host) for host in hosts]
    batches.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
  return batches, hosts


@pytest.mark.parametrize("batching", ["tokens", "packed"])
def test_resumed_on_another_mesh_the_global_batches_hold_the_same_examples(setup, batching):
  """4 devices to step N, then 2 hosts x 1 device, or 1 device: the examples of every
  later global batch, in order, are the uninterrupted 4-device run's."""
  config = setup[0].copy_and_resolve_references()
  config.batching = batching
  config.tokens_per_batch = 430  # plans rows that 4 divides and 1 device would not take
  _, source, tokenizer = setup
  ids = _ids_by_example(config, setup)
  first_steps, later_steps = 5, 4
  straight = pipeline.make_train_iterator(config, tokenizer, source=source, row_multiple=4)
  before = [_example_ids(next(straight), ids) for _ in range(first_steps)]
  state = straight.get_state()
  expected = [_example_ids(next(straight), ids) for _ in range(later_steps)]
  # Planned afresh on 1 device, the batches would hold other rows: the saved plan matters.
  fresh = pipeline.make_train_iterator(config, tokenizer, source=source, row_multiple=1)
  assert fresh.rows_by_length != straight.rows_by_length
  for processes, row_multiple in ((2, 2), (1, 1)):
    batches, hosts = _global_batches(config, setup, later_steps, state, processes, row_multiple)
    assert [_example_ids(b, ids) for b in batches] == expected, (processes, row_multiple)
    assert all(h.rows_by_length == straight.rows_by_length for h in hosts)
  seen = {i for step in before for i in step}
  assert not seen & {i for step in expected for i in step}  # nothing trained twice


def test_a_plan_the_new_mesh_cannot_split_is_a_one_line_error(setup):
  config, source, tokenizer = setup
  straight = pipeline.make_train_iterator(config, tokenizer, source=source, row_multiple=4)
  next(straight)
  rows = straight.rows_by_length
  uneven = {length: r for length, r in rows.items() if r % 3}
  assert uneven  # rows a multiple of 4, not all of 3
  with pytest.raises(config_lib.ConfigError) as error:
    _global_batches(
      config, setup, 1, straight.get_state(), 1, 3, layout="mesh {'data': 3} over 1 processes"
    )
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith(
    f"the checkpoint's batches have {uneven} rows by length, which "
    "are not multiples of 3, the least common multiple of this run's "
    "row shards and processes (mesh {'data': 3} over 1 processes)"
  )
  assert "change tokens_per_batch" in message


def test_a_changed_tokens_per_batch_plans_again_says_so_and_skips_nothing_trained(
  setup, monkeypatch
):
  config, source, tokenizer = setup
  ids = _ids_by_example(config, setup)
  straight = pipeline.make_train_iterator(config, tokenizer, source=source, row_multiple=2)
  trained = {i for _ in range(5) for i in _example_ids(next(straight), ids)}
  state = straight.get_state()
  warnings = []
  monkeypatch.setattr(pipeline.logging, "warning", lambda *a: warnings.append(a[0] % a[1:]))
  bigger = config.copy_and_resolve_references()
  bigger.tokens_per_batch = 2 * config.tokens_per_batch
  batches, (host,) = _global_batches(bigger, setup, 3, state, 1, 2)
  assert len(warnings) == 1 and "\n" not in warnings[0]
  assert warnings[0].startswith(
    f"tokens_per_batch {config.tokens_per_batch} -> "
    f"{bigger.tokens_per_batch} since the checkpoint: batches "
    "planned again"
  )
  assert f"the stream goes on at pair {state['pairs_read']} of epoch 0" in warnings[0]
  assert all(len(b["target"]) == host.rows_by_length[b["target"].shape[1]] for b in batches)
  assert sum(host.rows_by_length.values()) > sum(straight.rows_by_length.values())
  later = [i for b in batches for i in _example_ids(b, ids)]
  assert later and not trained & set(later)


# --- Data states of older formats.


def test_a_data_state_without_a_plan_resumes_with_the_plan_it_was_written_with(setup, monkeypatch):
  """A checkpoint from before plans were saved holds {epoch, batch_in_epoch} (format 1),
  and its code planned rows rounded to the nearest multiple. Planned today's way (down),
  the batches before batch_in_epoch would be others, and the resumed run would skip or
  replay examples for the rest of the epoch."""
  config, source, tokenizer = setup
  multiple, skipped, later = 4, 6, 4
  measured = []  # (budget, real tokens per row, row_multiple) of each shape the plan sized
  rows_for_real_tokens = batching.rows_for_real_tokens

  def spy(budget, real, row_multiple, nearest=False):
    measured.append((budget, real, row_multiple))
    return rows_for_real_tokens(budget, real, row_multiple, nearest)

  monkeypatch.setattr(batching, "rows_for_real_tokens", spy)
  warnings = []
  monkeypatch.setattr(pipeline.logging, "warning", lambda *a: warnings.append(a[0] % a[1:]))

  def from_old_state(batch_in_epoch):
    iterator = pipeline.make_train_iterator(config, tokenizer, source=source, row_multiple=multiple)
    # What the code before DATA_STATE_FORMAT 2 saved, through the checkpoint's JSON.
    iterator.set_state(json.loads(json.dumps({"epoch": 0, "batch_in_epoch": batch_in_epoch})))
    return iterator

  resumed = from_old_state(skipped)
  assert len(warnings) == 1 and "\n" not in warnings[0] and "format 1" in warnings[0]
  # It names the row multiple it planned with, this run's: the old mesh's is not saved.
  assert f"nearest multiple of {multiple} " in warnings[0] and "this run's mesh" in warnings[0]
  # The old code's expression, over the real tokens per row this plan measured.
  then = sorted(round(budget / real / m) * m for budget, real, m in measured)
  assert sorted(resumed.rows_by_length.values()) == then
  today = pipeline.make_train_iterator(config, tokenizer, source=source, row_multiple=multiple)
  assert today.rows_by_length != resumed.rows_by_length  # the rounding matters here
  # The old run from its start, planned the same way: the resumed stream is its own.
  straight = from_old_state(0)
  expected = [next(straight) for _ in range(skipped + later)][skipped:]
  _assert_same(expected, [next(resumed) for _ in range(later)])
  state = resumed.get_state()  # saved again, in today's format, with that plan
  assert state["format"] == pipeline.DATA_STATE_FORMAT
  assert dict(state["plan"]["rows_by_length"]) == resumed.rows_by_length


def test_a_data_state_of_a_newer_format_is_a_one_line_error(setup):
  config, source, tokenizer = setup
  iterator = pipeline.make_train_iterator(config, tokenizer, source=source)
  state = {**iterator.get_state(), "format": pipeline.DATA_STATE_FORMAT + 1}
  with pytest.raises(config_lib.ConfigError) as error:
    iterator.set_state(state)
  assert "\n" not in str(error.value)
  assert f"format {pipeline.DATA_STATE_FORMAT + 1}, written by a newer version" in str(error.value)


def test_the_package_loads_tensorflow_only_when_a_name_is_used():
  """Tools that never read a sentence import `transformer.data` through the serving
  layer; TensorFlow comes with the first name used, and every exported name resolves."""
  import subprocess
  import sys

  import transformer.data

  code = (
    "import sys\n"
    "import transformer.tools.compile_check, transformer.tools.memory, transformer.inference\n"
    "assert 'tensorflow' not in sys.modules, 'imported with the tools'\n"
    "from transformer import data\n"
    "data.make_source\n"
    "assert 'tensorflow' in sys.modules, 'not imported on use'\n"
  )
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert result.returncode == 0, result.stderr[-2000:]
  assert sorted(transformer.data.__all__) == sorted(transformer.data._MODULE_OF)
  for name in transformer.data.__all__:
    assert getattr(transformer.data, name).__name__ == name
  with pytest.raises(AttributeError, match="no attribute 'nothing'"):
    transformer.data.nothing  # noqa: B018
