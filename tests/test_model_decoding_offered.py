"""The searches the commands offer (transformer/model/decoding/offered.py): a search that is
one class, declaring its options beside how it decodes, reaches the commands' flags, their
one-line checks and decoding, with no other file changed."""

import dataclasses
import subprocess
import sys

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tests.helpers.model_helpers import SOURCE, make_model
from tests.helpers.processes import subprocess_env
from tests.helpers.tiny_run import REPO
from transformer.config import EOS_ID, PAD_ID, ConfigError
from transformer.evaluation import translate
from transformer.model import decoding
from transformer.model.decoding import offered


@dataclasses.dataclass(frozen=True)
class Repeat(offered.Offered):
  """A toy search: the most likely first token, `repeats` times, then EOS."""

  name = "repeat"
  help = "the first token over and over"
  options = (
    offered.Option(
      "repeats", int, 2, "How often the first token comes.", lambda n: n >= 1, "must be >= 1"
    ),
  )
  repeats: int = 2

  @classmethod
  def from_options(cls, config, values):
    return cls(values["repeats"])

  def run(self, model, params, prompts, rng):
    prompt_BxP = prompts.prompt_BxP
    prefilled = model.prefill(
      params, prompt_BxP, cache_len=prompt_BxP.shape[1], source_BxS=prompts.source_BxS
    )
    first_B = jnp.argmax(decoding.search.forbid_special(prefilled.logits_BxV), axis=-1)
    slot_O = jnp.arange(prompts.out_len)
    tokens_BxO = jnp.where(
      slot_O < self.repeats,
      first_B[:, None].astype(jnp.int32),
      jnp.where(slot_O == self.repeats, EOS_ID, PAD_ID),
    )
    zero = jnp.array(0, jnp.int32)
    batch = prompt_BxP.shape[0]
    return decoding.Generation(tokens_BxO, jnp.zeros((batch,)), zero, zero, zero, zero)


def register_repeat():
  offered.register(Repeat)


@pytest.fixture
def with_repeat(monkeypatch):
  monkeypatch.setattr(offered, "SEARCHES", dict(offered.SEARCHES))  # restored after
  register_repeat()


def test_a_registered_search_is_offered_by_generate_py():
  """`generate.py translate --help` in a process that registered the toy search first."""
  program = (
    "import runpy, sys\n"
    "from tests.test_model_decoding_offered import register_repeat\n"
    "register_repeat()\n"
    "sys.argv = ['generate.py', 'translate', '--help']\n"
    "runpy.run_path('generate.py', run_name='__main__')\n"
  )
  result = subprocess.run(
    [sys.executable, "-c", program],
    cwd=REPO,
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr
  help_text = " ".join(result.stdout.split())
  assert "--search {beam,greedy,sample,repeat}" in help_text
  assert "repeat, the first token over and over" in help_text
  assert "--repeats REPEATS How often the first token comes." in help_text


def test_a_registered_search_checks_its_options_and_decodes(with_repeat):
  with pytest.raises(ConfigError, match=r"^repeats: must be >= 1, got 0$"):
    translate.SearchSettings("repeat", repeats=0).check()
  with pytest.raises(
    ConfigError,
    match=r"^draft_workdir: speculative decoding is offered "
    r"for greedy, sample \(--search=greedy\|sample\), "
    r"not repeat$",
  ):
    translate.SearchSettings("repeat").check(with_draft=True)
  settings = translate.SearchSettings("repeat", repeats=3)
  settings.check()
  model, params = make_model(2)
  prompts = decoding.translation_prompts(SOURCE, 4, model.config.decoder_only)
  out = decoding.decode(model, params, prompts, settings.build(config=None))
  greedy = decoding.decode(model, params, prompts, decoding.Greedy())
  first_B = np.asarray(greedy.tokens_BxO)[:, 0]
  tokens_BxO = np.asarray(out.tokens_BxO)
  np.testing.assert_array_equal(tokens_BxO[:, :3], np.repeat(first_B[:, None], 3, axis=1))
  assert (tokens_BxO[:, 3] == EOS_ID).all() and (tokens_BxO[:, 4:] == PAD_ID).all()


def test_an_option_declared_two_ways_or_a_name_taken_twice_is_refused(with_repeat):
  @dataclasses.dataclass(frozen=True)
  class Other(Repeat):
    name = "other"
    options = (offered.Option("repeats", int, 5, "Another default."),)

  with pytest.raises(ValueError, match="--repeats of search 'other' differs"):
    offered.register(Other)
  with pytest.raises(ValueError, match="a search named 'repeat' is already registered"):
    offered.register(Repeat)


def test_every_search_option_and_no_other_reaches_the_settings():
  settings = translate.SearchSettings("sample", top_k=3)
  assert settings.values == dict(
    temperature=1.0, top_k=3, top_p=1.0, seed=0, draft_workdir=None, draft_len=4
  )
  with pytest.raises(ConfigError, match=r"^search 'greedy' takes no option beam_size$"):
    translate.SearchSettings("greedy", beam_size=4)
  with pytest.raises(
    ConfigError,
    match=r"^search: 'nucleus' is not one of beam, greedy, "
    r"sample$",
  ):
    translate.SearchSettings("nucleus").check()


def test_each_offered_search_is_its_decoding_class():
  """One class per search: what --search names is the class that decodes, built from its
  options (the config's beam size and alpha where none is given)."""
  assert {
    "beam": decoding.BeamSearch,
    "greedy": decoding.Greedy,
    "sample": decoding.Sampling,
  } == offered.SEARCHES
  config = ml_collections.ConfigDict({"beam_size": 6, "length_penalty_alpha": 0.3})
  beam = translate.SearchSettings("beam", alpha=0.8)
  assert beam.build(config) == decoding.BeamSearch(6, 0.8)
  assert beam.record(config) == {"beam_size": 6, "alpha": 0.8}
  sample = translate.SearchSettings("sample", temperature=0.5, top_p=0.9)
  assert sample.build(config) == decoding.Sampling(0.5, 0, 0.9)
  assert offered.continuing() == ["greedy", "sample"] and offered.drafting() == ["greedy", "sample"]
