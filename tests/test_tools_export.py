"""The CTranslate2 export (`python -m transformer.tools.export`), checked by the engine
itself as a client would use it: on tiny random models of every exportable option, its
float32 greedy output equals the project's greedy search token for token on 100 random
sources, and its score of a given target (`score_batch`) equals the model's
log-probability; on a tiny trained run, the command writes a directory the engine loads
and translates text with, and refuses bad input in one line."""

import dataclasses
import json
import os
import subprocess
import sys

import ctranslate2
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sentencepiece as spm
from ctranslate2.specs import model_spec

from tests.helpers import model_helpers
from tests.helpers.processes import subprocess_env
from tests.helpers.tiny_run import REPO, TRAINED_RUN_STEPS
from transformer import config as config_lib
from transformer import data
from transformer.config import BOS_ID, EOS_ID, PAD_ID, ConfigError
from transformer.evaluation import translate
from transformer.model import Transformer, decoding
from transformer.tools import export

VOCAB = 48
EXTRA = 6  # max_decode_extra_len: each sentence may produce its source length + this
SENTENCES = 100
# The last 3 ids have no piece, as when SentencePiece trains fewer than vocab_size.
PIECES = ["<pad>", "</s>", "<s>", "<unk>"] + [f"▁w{i}" for i in range(4, VOCAB - 3)]
TOKENS = export.vocabulary(PIECES, VOCAB)
SUPPRESS = [[TOKENS[i]] for i in export.NEVER_GENERATED]

# Every option the engine can compute, cheaply: the paper's model, then the others
# two or three at a time, and decoder-only models for the engine's Generator.
VARIANTS = [
  pytest.param(dict(), id="paper-postLN-relu-sinusoidal-tied"),
  pytest.param(
    dict(norm="pre", activation="gelu", positional="learned", tie_embeddings=False),
    id="preLN-gelu-learned-untied",
  ),
  pytest.param(
    dict(activation="swiglu", positional="rope", d_k=6, d_v=6, scan_layers=True),
    id="swiglu-rope-head6-scanned",
  ),
  pytest.param(dict(decoder_only=True), id="decoder_only-postLN-sinusoidal"),
  pytest.param(
    dict(decoder_only=True, norm="pre", positional="rope", tie_embeddings=False, activation="gelu"),
    id="decoder_only-preLN-rope-untied",
  ),
]


def _model(options, seed=0):
  options = dict(options)
  scan = options.pop("scan_layers", False)
  sizes = dict(vocab_size=VOCAB, max_position=64, d_model=16, d_ff=24, num_heads=2, d_k=8, d_v=8)
  cfg = model_helpers.tiny_config(**{**sizes, **options})
  params = model_helpers.random_params(cfg, seed)
  if scan:  # the checkpoint of a scanned run: layers stacked
    cfg = dataclasses.replace(cfg, scan_layers=True)
    params = model_helpers.stack_layer_params(params, cfg.num_layers)
  return cfg, params


def _export(cfg, params, directory, quantization="float32"):
  spec = export.model_spec(cfg, params, TOKENS)
  spec.validate()
  spec.optimize(quantization=quantization)
  spec.save(str(directory))
  engine = ctranslate2.Generator if cfg.decoder_only else ctranslate2.Translator
  return engine(str(directory), device="cpu", intra_threads=1)


def _sources(seed):
  """SENTENCES random sentences of 1 to 10 tokens (no EOS), ids that have pieces."""
  rng = np.random.default_rng(seed)
  return [list(rng.integers(4, VOCAB, size=rng.integers(1, 11))) for _ in range(SENTENCES)]


def _ours_greedy(cfg, params, sources):
  """The project's greedy output per sentence, up to (without) EOS."""
  source_BxS = data.pad_batch([s + [EOS_ID] for s in sources], rows=len(sources))
  prompts = decoding.translation_prompts(source_BxS, EXTRA, cfg.decoder_only)
  out = decoding.decode(Transformer(cfg), params, prompts, decoding.Greedy())
  outputs = []
  for row in np.asarray(out.tokens_BxO):
    row = [int(t) for t in row if t != PAD_ID]
    outputs.append(row[: row.index(EOS_ID)] if EOS_ID in row else row)
  return outputs


def _engine_greedy(engine, cfg, sources):
  """The engine's greedy output, called as the exported README says, a batch per source
  length so each gets exactly its own budget (source + EOS + EXTRA tokens, EOS included)."""
  outputs = [None] * len(sources)
  for length in sorted({len(s) for s in sources}):
    rows = [i for i, s in enumerate(sources) if len(s) == length]
    pieces = [[TOKENS[t] for t in sources[i]] for i in rows]
    budget = length + 1 + EXTRA
    if cfg.decoder_only:
      prompts = [[TOKENS[BOS_ID], *p, TOKENS[EOS_ID]] for p in pieces]
      results = engine.generate_batch(
        prompts,
        beam_size=1,
        include_prompt_in_result=False,
        max_length=budget,
        end_token=TOKENS[EOS_ID],
        suppress_sequences=SUPPRESS,
      )
      hypotheses = [r.sequences[0] for r in results]
    else:
      # min_decoding_length: the engine's default (1) forbids an empty output.
      results = engine.translate_batch(
        pieces,
        beam_size=1,
        max_decoding_length=budget,
        min_decoding_length=0,
        suppress_sequences=SUPPRESS,
      )
      hypotheses = [r.hypotheses[0] for r in results]
    for i, hypothesis in zip(rows, hypotheses):
      outputs[i] = [TOKENS.index(t) for t in hypothesis]
  return outputs


def _ours_logprobs(cfg, params, sources, targets):
  """log P(token | prefix) for every target token and its EOS (decoder-only: for every
  token after BOS, the source + EOS too)."""
  if cfg.decoder_only:
    sequences = [[BOS_ID, *s, EOS_ID, *t, EOS_ID] for s, t in zip(sources, targets)]
    batch = data.pad_batch(sequences, rows=len(sequences))
    logits = Transformer(cfg).apply({"params": params}, None, jnp.asarray(batch[:, :-1]))
    scored = [seq[1:] for seq in sequences]
  else:
    source = data.pad_batch([s + [EOS_ID] for s in sources], rows=len(sources))
    scored = [t + [EOS_ID] for t in targets]
    decoder_input = data.pad_batch([[BOS_ID, *t] for t in targets], rows=len(targets))
    logits = Transformer(cfg).apply(
      {"params": params}, jnp.asarray(source), jnp.asarray(decoder_input)
    )
  logprobs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  return [logprobs[i, np.arange(len(s)), s] for i, s in enumerate(scored)]


def _engine_logprobs(engine, cfg, sources, targets):
  if cfg.decoder_only:
    sequences = [
      [TOKENS[t] for t in [BOS_ID, *s, EOS_ID, *t, EOS_ID]] for s, t in zip(sources, targets)
    ]
    results = engine.score_batch(sequences)  # every token after the first
  else:
    # The engine appends EOS to the source (add_source_eos) and to the target.
    results = engine.score_batch(
      [[TOKENS[t] for t in s] for s in sources], [[TOKENS[t] for t in t] for t in targets]
    )
  return [np.asarray(r.log_probs) for r in results]


@pytest.mark.slow
@pytest.mark.parametrize("options", VARIANTS)
def test_engine_decodes_and_scores_as_the_model(options, tmp_path):
  cfg, params = _model(options)
  engine = _export(cfg, params, tmp_path)
  sources = _sources(seed=1)

  ours = _ours_greedy(cfg, params, sources)
  theirs = _engine_greedy(engine, cfg, sources)
  differing = [i for i in range(SENTENCES) if ours[i] != theirs[i]]
  assert not differing, (
    f"{len(differing)} differ, e.g. {ours[differing[0]]} (ours) vs {theirs[differing[0]]}"
  )
  # The outputs are real tests of the search: long and short, ended by EOS or the budget.
  lengths = {len(o) for o in ours}
  assert len(lengths) > 3, lengths

  targets = _sources(seed=2)[:32]
  for mine, engines in zip(
    _ours_logprobs(cfg, params, sources[:32], targets),
    _engine_logprobs(engine, cfg, sources[:32], targets),
  ):
    assert len(engines) == len(mine)
    np.testing.assert_allclose(engines, mine, atol=1e-4, rtol=0)


# The command, on a tiny trained run.


def _lines(config, count, column=0):
  """The first `count` lines of the run's corpus: one column, or whole lines."""
  with open(config.dataset.removeprefix("tsv:"), encoding="utf-8") as f:
    lines = [line.rstrip("\n") for line in f][:count]
  return lines if column is None else [line.split("\t")[column] for line in lines]


def _engine_translate(out, lines, max_len, extra, beam_size=1):
  sp = spm.SentencePieceProcessor(model_file=os.path.join(out, export.SENTENCEPIECE_NAME))
  translator = ctranslate2.Translator(out, device="cpu", intra_threads=1)
  sources = [sp.encode(line, out_type=str)[: max_len - 1] for line in lines]
  results = translator.translate_batch(
    sources,
    beam_size=beam_size,
    max_decoding_length=max(map(len, sources)) + 1 + extra,
    min_decoding_length=0,
    suppress_sequences=[["<pad>"], ["<s>"]],
    return_scores=True,
  )
  return [sp.decode(r.hypotheses[0]) for r in results], results


@pytest.mark.slow
def test_command_writes_a_directory_the_engine_translates_text_with(
  trained_run, tmp_path, monkeypatch, capsys
):
  config, workdir = trained_run
  out = str(tmp_path / "ct2")
  exported = export.export_run(workdir, out)
  assert exported.step == TRAINED_RUN_STEPS[1] and not exported.decoder_only
  assert {
    "model.bin",
    "config.json",
    "shared_vocabulary.json",
    "README.md",
    "export.json",
    export.SENTENCEPIECE_NAME,
  } <= set(os.listdir(out))
  with (
    open(os.path.join(workdir, "vocab.model"), "rb") as a,
    open(os.path.join(out, export.SENTENCEPIECE_NAME), "rb") as b,
  ):
    assert a.read() == b.read()
  with open(os.path.join(out, "shared_vocabulary.json"), encoding="utf-8") as f:
    tokens = json.load(f)
  sp = spm.SentencePieceProcessor(model_file=os.path.join(workdir, "vocab.model"))
  assert len(tokens) == config.vocab_size
  assert tokens[: sp.get_piece_size()] == [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
  with open(os.path.join(out, "export.json"), encoding="utf-8") as f:
    record = json.load(f)
  assert record["step"] == exported.step and record["quantization"] == "float32"

  # Text in, text out, as the project's own greedy translation (after 30 steps mostly the
  # same few words: the random models above test diverse outputs), and the checkpoint's
  # log-probabilities of the references.
  lines = _lines(config, 40)
  ours = translate.Translator(config, workdir, settings=translate.SearchSettings("greedy"))
  expected = ours.translate_lines(lines)
  engine, _ = _engine_translate(out, lines, config.max_len, config.max_decode_extra_len)
  assert engine == expected
  references = [line.split("\t")[1] for line in _lines(config, 8, column=None)]
  source_ids = [sp.encode(line) for line in lines[:8]]
  target_ids = [sp.encode(line) for line in references]
  cfg = ours.model.config
  mine = _ours_logprobs(cfg, jax.device_get(ours.params), source_ids, target_ids)
  scored = ctranslate2.Translator(out, device="cpu", intra_threads=1).score_batch(
    [[sp.id_to_piece(i) for i in ids] for ids in source_ids],
    [[sp.id_to_piece(i) for i in ids] for ids in target_ids],
  )
  for a, b in zip(mine, scored):
    np.testing.assert_allclose(b.log_probs, a, atol=1e-4, rtol=0)

  # The README's code runs as written, from the directory.
  with open(os.path.join(out, "README.md"), encoding="utf-8") as f:
    code = f.read().split("```python\n")[1].split("```")[0]
  monkeypatch.chdir(out)
  exec(compile(code, "README.md", "exec"), {})
  printed = capsys.readouterr().out.strip()
  assert printed.startswith("['") and printed.endswith("']"), printed

  # int8: the engine finds 8-bit weights (computing in float32 on a CPU), and they hold
  # the checkpoint's weights rounded to 8 bits as the test rounds them (_check_int8).
  out8 = str(tmp_path / "ct2-int8")
  export.export_run(workdir, out8, quantization="int8")
  assert ctranslate2.Translator(out, device="cpu").compute_type == "float32"
  assert ctranslate2.Translator(out8, device="cpu").compute_type == "int8_float32"
  rounded = str(tmp_path / "ct2-rounded")
  os.makedirs(rounded)
  spec = export.model_spec(cfg, jax.device_get(ours.params), tokens)
  model_spec.visit_spec(spec, _round_to_8_bits)
  spec.validate()
  spec.optimize(quantization="float32")
  spec.save(rounded)
  _check_int8(
    out,
    out8,
    rounded,
    [sp.encode(line, out_type=str)[: config.max_len - 1] for line in lines],
    [sp.encode(line, out_type=str) for line in _lines(config, len(lines), column=1)],
  )


def _round_to_8_bits(layer, name, value):
  """For model_spec.visit_spec: each matrix the engine stores in 8 bits (a weight with a
  weight_scale: the linear layers and embeddings) as its 8 bits give it back, each row
  scaled so that its largest |entry| is 127, rounded and scaled back."""
  if name.split("/")[-1] == "weight" and hasattr(layer, "weight_scale"):
    amax_Rx1 = np.max(np.abs(value), axis=1, keepdims=True)
    scale_Rx1 = np.float32(127) / np.where(amax_Rx1 == 0, np.float32(127), amax_Rx1)
    layer.weight = (np.rint(value * scale_Rx1) / scale_Rx1).astype(np.float32)


def _check_int8(out, out8, rounded, sources, targets):
  """The int8 export `out8` beside the float32 one `out` and `rounded` (the float32
  model with the test's 8-bit weights, _round_to_8_bits): their log-probabilities of
  the targets (pieces). Returns the figures bounded: the greatest difference of `out8`
  in float32 from `rounded`, and the mean one of `out8`'s int8 products from `out` over
  the mean |log-probability|.

  Teacher-forced scores, not translations: this model's greedy outputs are near-ties
  (one of `rounded`'s is 4e-6 in logits, within what float32 rounding differs by from
  CPU to CPU), and int8 products flip most of them (here 31 of 40)."""

  def logprobs(directory, compute_type="default"):
    engine = ctranslate2.Translator(
      directory, device="cpu", intra_threads=1, compute_type=compute_type
    )
    return np.concatenate([r.log_probs for r in engine.score_batch(sources, targets)])

  # What the file holds, on any CPU: loaded in float32, the engine multiplies each row's
  # 8 bits by its stored scale and computes in float32 (as for `out` above, to 1e-4), so
  # it scores as `rounded`: a wrong scale, weight or row (one matrix's scales 5% off, or
  # +-1 on half of one matrix's 8-bit values) differs by 1e-2 or more.
  dequantized, expected = logprobs(out8, compute_type="float32"), logprobs(rounded)
  np.testing.assert_allclose(dequantized, expected, atol=1e-4, rtol=0)
  # What a CPU's int8 products (the default compute type) make of it: the same model,
  # near enough. Their error depends on the instructions: oneDNN's u8 x s8 products on
  # AVX2 without VNNI saturate 16-bit pair sums, the least exact x86 path (1.0% of the
  # float32 log-probabilities; MKL's, on Intel CPUs, 0.1%): a bound 5 times that.
  int8, float32 = logprobs(out8), logprobs(out)
  relative = np.mean(np.abs(int8 - float32)) / np.mean(np.abs(float32))
  assert relative < 0.05, relative
  return np.max(np.abs(dequantized - expected)), relative


def test_bad_input_is_refused_in_one_line_before_anything_loads(tmp_path):
  """A run's config.json and no checkpoint: every refusal comes before any restore."""
  run = tmp_path / "run"
  run.mkdir()
  config = config_lib.base_config()
  (run / "config.json").write_text(json.dumps(config.to_dict()))
  out = str(tmp_path / "out")
  with pytest.raises(ConfigError, match="--quantization: 'int4' is not one of float32, int8"):
    export.export_run(str(run), out, quantization="int4")
  with pytest.raises(ConfigError, match="does not exist"):
    export.export_run(str(tmp_path / "nowhere"), out)
  with pytest.raises(ConfigError, match="holds no checkpoint"):
    export.export_run(str(run), out)
  # An existing export is kept unless --force.
  (tmp_path / "taken").mkdir()
  (tmp_path / "taken" / "model.bin").write_bytes(b"kept")
  with pytest.raises(ConfigError, match="already holds a model.bin; pass --force"):
    export.export_run(str(run), str(tmp_path / "taken"))
  assert (tmp_path / "taken" / "model.bin").read_bytes() == b"kept"
  # Options the engine cannot compute, named.
  config.model.d_v = config.model.d_k * 2
  (run / "config.json").write_text(json.dumps(config.to_dict()))
  with pytest.raises(ConfigError, match=r"config.model.d_v: CTranslate2 has one head size"):
    export.export_run(str(run), out)
  draft = config_lib.base_config()
  draft.draft.num_layers, draft.draft.target_workdir = 1, "runs/target"
  with pytest.raises(ConfigError, match="config.draft.num_layers: a shallow draft"):
    export.check_exportable(draft)
  assert not os.path.exists(out)


@pytest.mark.slow
def test_command_line_error_is_one_line(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "transformer.tools.export",
      "--workdir",
      str(tmp_path),
      "--out",
      str(tmp_path / "out"),
      "--quantization",
      "int3",
    ],
    cwd=REPO,
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode != 0
  assert result.stderr.strip().splitlines()[-1] == (
    f"error: --quantization: 'int3' is not one of {', '.join(export.QUANTIZATIONS)}"
  )


@pytest.mark.slow
def test_comparison_tool_on_a_trained_run(trained_run):
  """compare_ctranslate2's record: every system's outputs on the split, the engine's
  float32 greedy identical to ours, and a speed for each system, search and batch."""
  from transformer.tools import compare_ctranslate2

  _, workdir = trained_run
  record = compare_ctranslate2.compare(
    workdir, limit=12, batch1_sentences=3, batch_size=4, rounds=1, threads=1
  )
  assert record["num_sentences"] == 12
  assert record["greedy_identical"] == 12 and record["greedy_differing"] == []
  assert set(record["bleu"]) == {
    f"{s}_{k}" for s in ("ours", "float32", "int8") for k in ("greedy", "beam")
  }
  assert {(r["system"], r["search"], r["batch"]) for r in record["speed"]} == {
    (s, k, b) for s in ("ours", "float32", "int8") for k in ("greedy", "beam") for b in (1, 4)
  }
  assert all(r["sentences_per_sec"] > 0 for r in record["speed"])
