"""Generation beyond the paper's beam search: greedy, sampling and speculative decoding
through the split evaluation and eval.py, decoder-only runs evaluated like the
encoder-decoder (beam search continuing a prompt, validation BLEU), and generate.py."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import tiny_run
from tests.helpers.model_helpers import SOURCE, make_model, strip
from tests.helpers.processes import subprocess_env
from transformer.config import EOS_ID, PAD_ID, ConfigError
from transformer.data import pipeline
from transformer.evaluation import score, translate
from transformer.evaluation.validation import ValidationWithBleu
from transformer.model import decoding
from transformer.training import checkpoints, loop

SENTENCES = ["I like cats.", "Good morning.", "Where is the station?", "He is here."]
# The whole test split (143 sentences) in one batch: one shape to compile per search.
SPLIT_BATCH = 144


@pytest.fixture(scope="module")
def draft_run(small_corpus, tmp_path_factory):
  """A 2-step encoder-decoder run with another seed: trained_run's draft (same
  vocabulary, from the shared cache)."""
  workdir = str(tmp_path_factory.mktemp("draft"))
  loop.train_and_evaluate(
    tiny_run.make_config(small_corpus, num_train_steps=2, seed=7, max_decode_extra_len=5), workdir
  )
  return workdir


@pytest.fixture(scope="module")
def decoder_only_run(small_corpus, tmp_path_factory):
  """(config, workdir) of a 2-step decoder-only run, validated with BLEU at its end."""
  workdir = str(tmp_path_factory.mktemp("decoder_only"))
  config = tiny_run.make_config(
    small_corpus,
    num_train_steps=2,
    eval_every_steps=2,
    eval_bleu_sentences=4,
    max_decode_extra_len=5,
    eval_batch_size=SPLIT_BATCH,
    **{"model.decoder_only": True},
  )
  loop.train_and_evaluate(config, workdir, validation=ValidationWithBleu)
  return config, workdir


def _translator(workdir, search="beam", draft_workdir=None, eval_batch_size=None, **settings):
  config = checkpoints.load_run_config(workdir)
  config.eval_batch_size = eval_batch_size or config.eval_batch_size
  return translate.Translator(
    config,
    workdir,
    settings=translate.SearchSettings(search, **settings),
    draft_workdir=draft_workdir,
  )


def _read(stem):
  files = {
    s: pathlib.Path(f"{stem}.{s}.txt").read_text(encoding="utf-8").split("\n")[:-1]
    for s in ("src", "ref", "hyp")
  }
  return files, json.loads(pathlib.Path(f"{stem}.json").read_text())


def _run(script, *args):
  env = subprocess_env(devices=1)
  return subprocess.run(
    [sys.executable, script, *args],
    cwd=tiny_run.REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )


# ----------------------------------------------------------------------------------
# Decoder-only beam search, on a random model far from uniform outputs.


def test_decoder_only_beam_of_one_is_greedy_and_scores_its_output():
  model, params = make_model(2, decoder_only=True)
  # Prompts of 4, 2, 6 and 3 tokens, budgets of 8 new tokens.
  prompt = decoding.translation_prompts(SOURCE, 4, True).prompt_BxP
  prompts = decoding.continuation_prompts(prompt, 8)
  greedy = np.asarray(decoding.decode(model, params, prompts, decoding.Greedy()).tokens_BxO)
  one = decoding.decode(model, params, prompts, decoding.BeamSearch(1, 0.0)).tokens_BxO
  np.testing.assert_array_equal(one, greedy)
  assert len({len(strip(row)) for row in greedy}) > 1  # rows end at different steps

  # Beam 3: each row's score is its output's log-probability under the teacher-forced
  # model (prompt and output read at once, no cache) over the length penalty, and no
  # row exceeds its own budget.
  budget = np.array([3, 8, 5, 2], np.int32)
  out = decoding.decode(
    model, params, prompts.replace(budget_B=jnp.asarray(budget)), decoding.BeamSearch(3, 0.6)
  )
  tokens, scores = np.asarray(out.tokens_BxO), np.asarray(out.scores_B)
  for row in range(len(budget)):
    output = strip(tokens[row])
    assert 1 <= len(output) <= budget[row]
    real = [int(t) for t in np.asarray(prompt[row]) if t != PAD_ID]
    sequence = jnp.array([real + output], jnp.int32)
    logits = model.apply({"params": params}, None, sequence, method=model.__call__)
    logp = jax.nn.log_softmax(logits[0], axis=-1)
    total = sum(float(logp[len(real) - 1 + i, t]) for i, t in enumerate(output))
    expected = total / float(decoding.length_penalty(len(output), 0.6))
    assert scores[row] == pytest.approx(expected, abs=1e-4)


# ----------------------------------------------------------------------------------
# Encoder-decoder: greedy, sampling and speculative through the split evaluation.


def test_speculative_greedy_split_is_the_greedy_split(trained_run, draft_run):
  _, workdir = trained_run
  spec = _translator(
    workdir, "greedy", draft_workdir=draft_run, draft_len=3, eval_batch_size=SPLIT_BATCH
  )
  results = score.evaluate_split(spec, "test")
  assert results["path"].endswith(os.path.join("eval", f"test-{spec.step}-greedy-spec.json"))
  files, saved = _read(results["path"].removesuffix(".json"))
  assert saved["search"] == "greedy" and "beam_size" not in saved
  assert saved["draft_workdir"] == draft_run and saved["draft_len"] == 3
  assert 0 <= saved["acceptance_rate"] < 1  # another model never agrees throughout
  # Per sentence per target pass: above 1 when drafts are accepted, at most k + 1 plus
  # the first token, which the (uncounted) prefill yields.
  assert 1 < saved["tokens_per_target_call"] <= saved["draft_len"] + 2
  assert 0 <= saved["bleu"] <= 100 and saved["ppl"] > 1

  greedy = _translator(workdir, "greedy", eval_batch_size=SPLIT_BATCH)
  # Token for token the target's own greedy output, in the split's order.
  assert greedy.translate_lines(files["src"]) == files["hyp"]
  # Plain greedy and sampled runs write beside beam search's files, not over them.
  assert score.output_stem(greedy, "test").endswith(f"test-{greedy.step}-greedy")
  assert score.output_stem(_translator(workdir), "test").endswith(f"test-{greedy.step}")


def test_sampling_is_seeded_and_top_k_one_is_greedy(trained_run, draft_run):
  _, workdir = trained_run
  translator = _translator(workdir, "greedy", draft_workdir=draft_run)
  translator.draft, draft = None, translator.draft  # plain greedy first
  greedy = translator.translate_lines(SENTENCES)
  translator.settings = translate.SearchSettings("sample", top_k=1)
  assert translator.translate_lines(SENTENCES) == greedy
  translator.draft = draft  # speculative sampling from a one-hot target is greedy too
  assert translator.translate_lines(SENTENCES) == greedy and translator.stats.proposed > 0

  translator.draft = None
  sample = lambda seed: (
    setattr(translator, "settings", translate.SearchSettings("sample", seed=seed, temperature=3.0)),
    translator.translate_lines(SENTENCES * 4),
  )[1]
  first = sample(1)
  assert sample(1) == first and sample(2) != first


def test_bad_search_settings_fail_in_one_line_before_restoring(trained_run, tmp_path):
  _, workdir = trained_run
  for settings in (
    dict(search="beam", draft_workdir=workdir),
    dict(search="sample", top_p=0),
    dict(search="greedy", draft_len=0),
    dict(search="nucleus"),
  ):
    with pytest.raises(ConfigError) as error:
      _translator(workdir, **settings)
    assert "\n" not in str(error.value)
  # A draft with another vocabulary: a copy of the run whose vocab.model differs.
  other = tmp_path / "other_vocab"
  shutil.copytree(workdir, other)
  (other / "vocab.model").write_bytes((other / "vocab.model").read_bytes() + b"\0")
  with pytest.raises(ConfigError, match="^draft_workdir: .*vocab.model differs"):
    _translator(workdir, "greedy", draft_workdir=str(other))


def test_generate_py_continue_on_an_encoder_decoder_suggests_translate(trained_run):
  _, workdir = trained_run
  result = _run("generate.py", "continue", "--workdir", workdir, "I like")
  assert result.returncode != 0
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("error: continue extends text with a decoder-only model")
  assert "generate.py translate" in last


# ----------------------------------------------------------------------------------
# Decoder-only runs: the same evaluation as the encoder-decoder, and --prompt.


def test_decoder_only_run_is_validated_and_evaluated_like_the_encoder_decoder(decoder_only_run):
  config, workdir = decoder_only_run
  [record] = tiny_run.read_metrics(workdir, kind="validation")
  assert 0 <= record["bleu"] <= 100  # ValidationWithBleu no longer skips decoder-only

  results = score.evaluate_split(_translator(workdir), "test")
  files, saved = _read(os.path.join(workdir, "eval", "test-2"))
  pairs = pipeline.load_raw_pairs(config, "test")
  assert files["src"] == [s for s, _ in pairs] and files["ref"] == [r for _, r in pairs]
  assert len(files["hyp"]) == len(pairs) == results["num_sentences"]
  assert saved["search"] == "beam" and saved["decoder_only"] and saved["ppl"] > 1
  for key in ("bleu", "bleu_signature", "bleu_tok", "chrf", "beam_size"):
    assert key in saved, key

  # Each hypothesis is the continuation only, cut at its EOS and its budget.
  translator = _translator(workdir, "greedy")
  batch = pipeline.make_eval_batches(config, translator.tokenizer, "test")[0]
  tokens = translator.generate(batch["source"])
  budget = (batch["source"] != PAD_ID).sum(axis=1) + config.max_decode_extra_len
  for row in range(len(budget)):
    output = strip(tokens[row])
    assert len(output) <= budget[row] and EOS_ID not in output[:-1]


def test_speculative_decoder_only_split_and_continuation(decoder_only_run):
  _, workdir = decoder_only_run
  result = _run(
    "eval.py",
    "--workdir",
    workdir,
    "--search",
    "greedy",
    "--draft_workdir",
    workdir,
    "--draft_len",
    "2",
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.splitlines()[-1].startswith("sacreBLEU")
  files, saved = _read(os.path.join(workdir, "eval", "test-2-greedy-spec"))
  # Its own draft: the target agrees with nearly every proposal.
  assert saved["acceptance_rate"] > 0.9 and saved["tokens_per_target_call"] > 2
  plain = _translator(workdir, "greedy").translate_lines(files["src"][:16])
  assert plain == files["hyp"][:16]

  translator = _translator(workdir, "greedy")
  (expected,) = translator.continue_text(["I like"], max_new_tokens=6)
  result = _run("generate.py", "continue", "--workdir", workdir, "I like", "--max_new_tokens", "6")
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.splitlines() == [expected]
