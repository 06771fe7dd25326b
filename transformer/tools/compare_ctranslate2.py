"""The project's decoding beside CTranslate2's, on a trained run's split: the same
outputs, BLEU, and speed, measured in one interleaved run.

    python -m transformer.tools.compare_ctranslate2 --workdir workdirs/default --json

exports the run twice (transformer/tools/export.py: float32 and int8, into a temporary
directory), then on the split (default: test):

  quality  greedy: the share of sentences whose engine output (float32) is ours token
           for token, and for each that differs the gap between our two candidate
           log-probabilities where they part (a near-tie shows a tiny gap); BLEU of our
           greedy and beam search and of the engine's, float32 and int8. The engine's
           beam search divides log P by length^alpha (EOS not counted), ours by GNMT's
           ((5 + length) / 6)^alpha: the same alpha is passed to both.
  speed    sentences/s at batch 1 (the first --batch1_sentences sentences) and batch 32
           (the whole split), for our greedy and beam search and the engine's in float32
           and int8; the systems take turns, --rounds times, and each figure is its
           fastest round. Ours compiles each shape before it is timed.

Both read the same token ids: the run's SentencePiece ids, clipped to max_len, EOS
added (by the engine itself: add_source_eos). The engine runs --threads threads
(intra_threads) in one translator (inter_threads=1). With --json the last line is one
record for docs/results/ctranslate2.jsonl (render_docs --record).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import ctranslate2
import jax
import numpy as np

from transformer import cli, data, host_memory, storage, versions
from transformer.config import BOS_ID, EOS_ID, PAD_ID, ConfigError
from transformer.data import batching
from transformer.evaluation import bleu, translate
from transformer.inference import checkpoints, sharding
from transformer.model import decoding
from transformer.tools import export

# Its docs/results records' version: bump when what it computes changes, not on a reformat.
RECORD_VERSION = 1

SYSTEMS = ("ours", "float32", "int8")
SEARCHES = ("greedy", "beam")


class Ours:
  """The run's own search over batches of token ids, as translate_lines runs it."""

  def __init__(self, workdir: str):
    config = checkpoints.load_run_config(workdir)
    self.translator = translate.Translator(config, workdir)
    self.config, self.workdir = config, workdir

  def search(self, kind: str) -> decoding.Search:
    return translate.SearchSettings(kind).build(self.config)

  def run(self, ids: list[np.ndarray], batch: int, kind: str) -> list[list[int]]:
    """Output ids (up to EOS) of each source, `batch` sentences per call."""
    t = self.translator
    search = self.search(kind)
    # Rows split over the devices' batch axes: on several devices, fill rows make up a
    # batch of 1 (one device, as on a CPU host, needs none).
    rows = batching.round_up(batch, sharding.batch_row_shards(t.mesh, t.rules))
    outputs = []
    for start in range(0, len(ids), batch):
      chunk = ids[start : start + batch]
      prompts = decoding.translation_prompts(
        data.pad_batch(chunk, rows=rows), self.config.max_decode_extra_len, False
      )
      tokens, _ = translate.run_search(t.model, t.params, t.mesh, t.rules, prompts, search)
      outputs += [_up_to_eos(row) for row in tokens[: len(chunk)].tolist()]
    return outputs

  def logprobs(self, source: np.ndarray, prefix: list[int]) -> np.ndarray:
    """log P(next token | source, prefix) over the vocabulary, teacher-forced."""
    t = self.translator
    logits_1xTxV: Any = t.model.apply(
      {"params": jax.device_get(t.params)},
      np.asarray([source], np.int32),
      np.asarray([[BOS_ID, *prefix]], np.int32),
    )
    return np.asarray(jax.nn.log_softmax(logits_1xTxV[0, -1]))


def _up_to_eos(ids: list[int]) -> list[int]:
  ids = [i for i in ids if i != PAD_ID]
  return ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids


class Engine:
  """An exported model in ctranslate2.Translator, called as its README says."""

  def __init__(self, directory: str, tokens: list[str], config, threads: int):
    self.translator = ctranslate2.Translator(
      directory, device="cpu", inter_threads=1, intra_threads=threads
    )
    self.tokens = tokens
    self.index = {t: i for i, t in enumerate(tokens)}
    self.config = config

  def run(self, ids: list[np.ndarray], batch: int, kind: str) -> list[list[int]]:
    extra = self.config.max_decode_extra_len
    outputs = []
    for start in range(0, len(ids), batch):
      chunk = [[self.tokens[i] for i in source[:-1]] for source in ids[start : start + batch]]
      results = self.translator.translate_batch(
        chunk,
        beam_size=1 if kind == "greedy" else self.config.beam_size,
        length_penalty=self.config.length_penalty_alpha,
        max_decoding_length=max(map(len, chunk)) + 1 + extra,
        min_decoding_length=0,
        suppress_sequences=[[self.tokens[i]] for i in export.NEVER_GENERATED],
      )
      for source, result in zip(chunk, results):
        # Each sentence's own budget (its source + EOS + extra), as ours has.
        outputs.append([self.index[t] for t in result.hypotheses[0]][: len(source) + 1 + extra])
    return outputs


def _timed(runner, sources: list[np.ndarray], batch: int, kind: str):
  """(outputs, seconds) of one runner over the sources."""
  start = time.perf_counter()
  outputs = runner.run(sources, batch, kind)
  return outputs, time.perf_counter() - start


def _bleu(tokenizer, outputs: list[list[int]], references: list[str]) -> float:
  return bleu.sacre_bleu([tokenizer.decode(o) for o in outputs], references).score


def _compile_every_shape(ours: Ours, ids: list[np.ndarray], batch_size: int) -> None:
  """Runs ours once on every shape it will meet, so no timed pass compiles: one batch
  per padded source length, at batch 1 and batch_size, for each search."""
  by_length: dict[int, np.ndarray] = {}
  for source in ids:
    by_length.setdefault(batching.round_up(len(source), batching.LENGTH_MULTIPLE), source)
  for batch in (1, batch_size):
    for kind in SEARCHES:
      for source in by_length.values():
        ours.run([source] * batch, batch, kind)


def _interleaved(
  runners: dict[str, Any],
  ids: list[np.ndarray],
  batch1_sentences: int,
  batch_size: int,
  rounds: int,
):
  """The systems take turns, `rounds` times: (fastest sentences/s per (system, search,
  batch), outputs of the last batch_size round per (system, search))."""
  speed: dict[tuple[str, str, int], float] = {}
  outputs: dict[tuple[str, str], list[list[int]]] = {}
  for _ in range(rounds):
    for batch, sources in ((1, ids[:batch1_sentences]), (batch_size, ids)):
      for system in SYSTEMS:
        for kind in SEARCHES:
          result, seconds = _timed(runners[system], sources, batch, kind)
          key = (system, kind, batch)
          speed[key] = max(speed.get(key, 0.0), len(sources) / seconds)
          if batch == batch_size:
            outputs[(system, kind)] = result
  return speed, outputs


def _greedy_differences(
  ours: Ours, ids: list[np.ndarray], ours_greedy: list[list[int]], engine_greedy: list[list[int]]
) -> list[dict[str, Any]]:
  """Each sentence whose greedy outputs differ: where they part, and our log-probability
  of our token there minus that of the engine's (a near-tie shows a tiny gap)."""
  differing = []
  for index, (a, b) in enumerate(zip(ours_greedy, engine_greedy)):
    if a == b:
      continue
    at = next((t for t in range(min(len(a), len(b))) if a[t] != b[t]), min(len(a), len(b)))
    logprobs = ours.logprobs(ids[index], a[:at])
    ours_next = a[at] if at < len(a) else EOS_ID
    engine_next = b[at] if at < len(b) else EOS_ID
    differing.append(
      dict(index=index, position=at, logprob_gap=float(logprobs[ours_next] - logprobs[engine_next]))
    )
  return differing


def _run_every_system(
  ours: Ours,
  tokens: list[str],
  ids: list[np.ndarray],
  threads: int,
  batch1_sentences: int,
  batch_size: int,
  rounds: int,
) -> tuple[dict, dict]:
  """(speed, outputs) of `_interleaved` over ours and the engine on the run's export,
  float32 and int8 (exported to a scratch directory, gone after)."""
  with tempfile.TemporaryDirectory(prefix="ct2-compare-") as scratch:
    engines = {}
    for quantization in ("float32", "int8"):
      out = os.path.join(scratch, quantization)
      export.export_run(ours.workdir, out, quantization=quantization)
      engines[quantization] = Engine(out, tokens, ours.config, threads)
    runners: dict[str, Any] = {"ours": ours, **engines}
    _compile_every_shape(ours, ids, batch_size)
    return _interleaved(runners, ids, batch1_sentences, batch_size, rounds)


def compare(
  workdir: str,
  *,
  split: str = "test",
  batch1_sentences: int = 200,
  batch_size: int = 32,
  rounds: int = 2,
  threads: int = 0,
  limit: int = 0,
) -> dict[str, Any]:
  """The record: quality on the whole split (or its first `limit` sentences), speed."""
  threads = threads or os.cpu_count() or 1
  ours = Ours(workdir)
  config, tokenizer = ours.config, ours.translator.tokenizer
  if config.model.decoder_only:
    raise ConfigError("--workdir: the comparison translates with an encoder-decoder run")
  pairs = data.load_raw_pairs(config, split)
  if limit:
    pairs = pairs[:limit]
  references = [r for _, r in pairs]
  ids = tokenizer.encode_for_model([s for s, _ in pairs], config.max_len)
  pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
  tokens = export.vocabulary(pieces, config.vocab_size)

  speed, outputs = _run_every_system(
    ours, tokens, ids, threads, batch1_sentences, batch_size, rounds
  )
  differing = _greedy_differences(
    ours, ids, outputs[("ours", "greedy")], outputs[("float32", "greedy")]
  )
  identical = len(ids) - len(differing)
  return {
    "name": "ctranslate2",
    "workdir": workdir,
    "step": ours.translator.step,
    "split": split,
    "num_sentences": len(ids),
    "greedy_identical": identical,
    "greedy_identical_share": identical / len(ids),
    "greedy_differing": differing,
    "bleu": {
      f"{system}_{kind}": _bleu(tokenizer, outputs[(system, kind)], references)
      for system in SYSTEMS
      for kind in SEARCHES
    },
    "beam_size": config.beam_size,
    "length_penalty_alpha": config.length_penalty_alpha,
    "speed": [
      dict(system=system, search=kind, batch=batch, sentences_per_sec=rate)
      for (system, kind, batch), rate in sorted(speed.items(), key=lambda item: item[0][2])
    ],
    "batch1_sentences": min(batch1_sentences, len(ids)),
    "batch_size": batch_size,
    "rounds": rounds,
    "ctranslate2_threads": f"intra_threads={threads}, inter_threads=1",
    "ctranslate2": ctranslate2.__version__,
    "versions": versions.library_versions(),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True, help="A trained encoder-decoder run.")
  parser.add_argument("--split", default="test", choices=["validation", "test"])
  parser.add_argument("--batch1_sentences", type=int, default=200)
  parser.add_argument("--batch_size", type=int, default=32, help="the batched figure's size")
  parser.add_argument("--rounds", type=int, default=2, help="timed turns of every system")
  parser.add_argument("--threads", type=int, default=0, help="the engine's; 0 = every core")
  parser.add_argument("--limit", type=int, default=0, help="only the first N sentences")
  parser.add_argument("--json", action="store_true", help="print the record as a last line")
  args = parser.parse_args()
  try:
    record = compare(
      args.workdir,
      split=args.split,
      batch1_sentences=args.batch1_sentences,
      batch_size=args.batch_size,
      rounds=args.rounds,
      threads=args.threads,
      limit=args.limit,
    )
  except (ConfigError, OSError, checkpoints.CheckpointError, storage.StorageTimeout) as e:
    cli.exit_with_error(e)  # at once after a stalled read: its thread is still blocked
  print(
    f"greedy: {record['greedy_identical']} of {record['num_sentences']} sentences identical "
    f"to ours; where they differ, our log-prob gaps: "
    f"{[round(d['logprob_gap'], 6) for d in record['greedy_differing']]}"
  )
  for name, score in record["bleu"].items():
    print(f"BLEU {name}: {score:.2f}")
  for row in record["speed"]:
    print(
      f"batch {row['batch']:>3} {row['system']:>7} {row['search']:>6}: "
      f"{row['sentences_per_sec']:.1f} sentences/s"
    )
  if args.json:
    print(json.dumps(record))


if __name__ == "__main__":
  host_memory.retain_freed_memory()  # a command's setting, before JAX starts (host_memory.py)
  main()
