"""Generation with a model's parameters: a search over batches, detokenized text.

`Generator` is a model set-up, its parameters and vocabulary, and a search; its one batch
loop (`search_batches`) runs every batch of every job: translating sentences
(`translate_lines`), continuing text (`continue_text`), translating a split's batches for
scoring (`generate`, evaluation/score.py), and training's validation BLEU. `Translator`
is a Generator on a trained run, restored through `transformer.inference` (parameters only),
with, optionally, a second run as the draft of speculative decoding.

`SearchSettings` says how to generate (a search of decoding/offered.py: beam search,
the paper's protocol and the default; greedy; sampling; greedy or sampling with a draft)
and builds the decoding search (transformer/model/decoding), which owns all it needs: a
speculative search owns its draft's parameters. `run_search` is the one place a batch
meets a search: its rows are spread over the mesh, sampling gets its key, and the outputs
and the draft's statistics come back to every process in the batch's row order.

Both kinds of model translate alike: decoding.translation_prompts (an encoder-decoder
reads the source and continues BOS, a decoder-only model continues BOS + source), each
sentence producing at most its source length + max_decode_extra_len tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from transformer import config as config_lib
from transformer import data, inference, storage
from transformer.data import tokenizer as tokenizer_lib
from transformer.inference import checkpoints, sharding
from transformer.model import decoding
from transformer.model.decoding import offered


class SearchSettings:
  """How hypotheses are generated: a search of offered.SEARCHES (beam search, the
  paper's protocol and the default; greedy decoding; sampling) and the values of its
  options and of the common ones (offered.COMMON_OPTIONS), each defaulting to its
  declaration; with a draft model, draft_len tokens are proposed per target pass."""

  def __init__(self, kind: str = "beam", **values: Any):
    self.kind = kind
    options = offered.all_options([kind] if kind in offered.SEARCHES else [])
    unknown = set(values) - {option.name for option in options}
    if unknown:
      raise config_lib.ConfigError(f"search {kind!r} takes no option {', '.join(sorted(unknown))}")
    self.values = {option.name: values.get(option.name, option.default) for option in options}
    self._options = options

  def __repr__(self) -> str:
    return f"SearchSettings({self.kind!r}, {self.values})"

  @property
  def seed(self) -> int:
    return self.values["seed"]

  @property
  def draft_len(self) -> int:
    return self.values["draft_len"]

  def check(self, with_draft: bool = False) -> None:
    """One-line ConfigError for values no search can use."""
    if self.kind not in offered.SEARCHES:
      raise config_lib.ConfigError(
        f"search: {self.kind!r} is not one of {', '.join(offered.SEARCHES)}"
      )
    for option in self._options:
      option.check(self.values[option.name])
    if with_draft and not offered.SEARCHES[self.kind].drafts:
      drafting = offered.drafting()
      raise config_lib.ConfigError(
        f"draft_workdir: speculative decoding is offered for {', '.join(drafting)} "
        f"(--search={'|'.join(drafting)}), not {self.kind}"
      )

  def build(self, config: ml_collections.ConfigDict, draft: Draft | None = None) -> decoding.Search:
    """The decoding search these settings describe: speculative with a draft run, whose
    model and parameters the search then owns."""
    search = offered.SEARCHES[self.kind].from_options(config, self.values)
    if draft is None:
      return search
    return decoding.Speculative(draft.model, self.draft_len, search, draft_params=draft.params)

  def record(self, config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The search's own entries in eval.py's JSON."""
    return offered.SEARCHES[self.kind].record(config, self.values)


BEAM = SearchSettings()


class Draft(NamedTuple):
  """The draft model of speculative decoding: a second run with the same vocabulary."""

  model: Any
  params: Any
  workdir: str


@dataclasses.dataclass(frozen=True)
class SearchStats:
  """What a search's model passes produced over some batches (fill rows included), which
  every search counts: what speculative decoding saved. See decoding.Generation."""

  target_calls: int = 0
  proposed: int = 0
  accepted: int = 0
  generated: int = 0  # tokens the target calls produced, EOS included
  row_calls: int = 0  # rows still generating, summed over the target calls

  def __add__(self, other: SearchStats) -> SearchStats:
    return SearchStats(
      *(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other)))
    )

  def summary(self) -> dict[str, float]:
    """acceptance_rate, and tokens_per_target_call per sentence (1 without a draft)."""
    return {
      "acceptance_rate": self.accepted / max(self.proposed, 1),
      "tokens_per_target_call": self.generated / max(self.row_calls, 1),
    }


def check_draft_vocabulary(workdir: str, draft_workdir: str) -> None:
  """One-line ConfigError unless both runs saved byte-identical vocabularies: a draft's
  token ids must mean what the target's mean."""
  paths = [storage.join(w, tokenizer_lib.WORKDIR_VOCAB_NAME) for w in (workdir, draft_workdir)]
  for path in paths:
    if not storage.exists(path):
      raise config_lib.ConfigError(f"draft_workdir: {path} is missing (was it trained?)")
  if storage.as_path(paths[0]).read_bytes() != storage.as_path(paths[1]).read_bytes():
    raise config_lib.ConfigError(
      f"draft_workdir: {paths[1]} differs from {paths[0]}; "
      "the draft must share the target's vocabulary"
    )


def run_search(
  model,
  params,
  mesh,
  rules,
  prompts: decoding.Prompts,
  search: decoding.Search,
  *,
  seed: int = 0,
  batch_number: int = 0,
) -> tuple[np.ndarray, SearchStats]:
  """`search` on one batch every process holds whole -> (tokens [B, O], stats).

  Each device searches only its own rows, and the gather follows the global array's
  indices, not an assumed order of processes over the mesh: row r of the output is row
  r of the prompts on every process. Sampling draws from seed and batch_number.
  """
  arrays = {"prompt_BxP": prompts.prompt_BxP, "budget_B": prompts.budget_B}
  if prompts.source_BxS is not None:
    arrays["source_BxS"] = prompts.source_BxS
  arrays = sharding.global_batch_from_whole(
    {k: np.asarray(v, np.int32) for k, v in arrays.items()}, mesh, rules
  )
  prompts = decoding.Prompts(**arrays, out_len=prompts.out_len)
  key = np.asarray(jax.random.fold_in(jax.random.PRNGKey(seed), batch_number))
  rng = jax.make_array_from_callback(
    key.shape, sharding.replicated(mesh), lambda index: key[index]
  )  # the same everywhere
  with sharding.activation_sharding(mesh, rules):  # traced with the activations' axes
    out = decoding.decode(model, params, prompts, search, rng)
  if jax.process_count() > 1:
    tokens = np.asarray(multihost_utils.process_allgather(out.tokens_BxO, tiled=True))
  else:
    tokens = np.asarray(jax.device_get(out.tokens_BxO))
  stats = SearchStats(  # every search counts them; scalars, the same on every process
    int(out.calls),
    int(out.proposed),
    int(out.accepted),
    int(np.sum(tokens != config_lib.PAD_ID)),
    int(out.row_calls),
  )
  return tokens, stats


class Generator:
  """A model set-up (inference.ModelSetup), its parameters and vocabulary, and a search (the
  settings', speculative with `draft`): what every generation job runs, through one
  batch loop. `after_batch`, if set, is called after every batch searched (eval.py and
  generate.py stop there on a preemption notice: distributed.StopBetweenBatches);
  `stats` adds up what speculative decoding saved over every batch."""

  def __init__(
    self,
    setup: inference.ModelSetup,
    params: Any,
    tokenizer: data.Tokenizer,
    settings: SearchSettings = BEAM,
    draft: Draft | None = None,
  ):
    self.setup, self.params, self.tokenizer = setup, params, tokenizer
    self.config = setup.config
    self.mesh, self.rules, self.model = setup.mesh, setup.rules, setup.model
    self.settings, self.draft = settings, draft
    self.stats = SearchStats()
    self.after_batch: Callable[[], None] | None = None

  @property
  def search(self) -> decoding.Search:
    """The decoding search of the settings (speculative with the draft, if any)."""
    return self.settings.build(self.config, self.draft)

  def search_batches(
    self, prompt_batches: Iterable[decoding.Prompts], first_number: int = 0
  ) -> Iterator[np.ndarray]:
    """The one batch loop: each batch's tokens [B, O] in turn, the batches numbered from
    `first_number` (what sampling draws from, with the seed), their statistics added,
    after_batch called after each."""
    search = self.search
    for number, prompts in enumerate(prompt_batches, start=first_number):
      tokens, stats = run_search(
        self.model,
        self.params,
        self.mesh,
        self.rules,
        prompts,
        search,
        seed=self.settings.seed,
        batch_number=number,
      )
      self.stats += stats
      if self.after_batch is not None:
        self.after_batch()
      yield tokens

  def _translation_prompts(self, source_BxS: np.ndarray) -> decoding.Prompts:
    config = self.config
    return decoding.translation_prompts(
      source_BxS, config.max_decode_extra_len, bool(config.model.decoder_only)
    )

  def generate(self, source_BxS: np.ndarray, batch_number: int = 0) -> np.ndarray:
    """The search on one padded source batch -> tokens [B, S + max_decode_extra_len]."""
    return next(self.search_batches([self._translation_prompts(source_BxS)], batch_number))

  def translate_batches(self, sources: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
    """Each padded source batch's tokens, in turn (evaluation/score.py's split)."""
    return self.search_batches(self._translation_prompts(source) for source in sources)

  def _rows_of(self, ids: Sequence[Any], make_prompts) -> list[np.ndarray]:
    """The search over rows of token ids, eval_batch_size at a time, in order: each row's
    tokens [O]."""
    rows = self.config.eval_batch_size
    chunks = [ids[start : start + rows] for start in range(0, len(ids), rows)]
    batches = self.search_batches(make_prompts(chunk) for chunk in chunks)
    return [tokens[row] for chunk, tokens in zip(chunks, batches) for row in range(len(chunk))]

  def translate_lines(self, lines: Iterable[str]) -> list[str]:
    """Detokenized translations of raw sentences, in order; an empty line stays empty.
    Inputs longer than max_len are clipped to it (the model never saw longer ones)."""
    lines = list(lines)
    todo = [i for i, line in enumerate(lines) if line.strip()]
    ids = self.tokenizer.encode_for_model([lines[i] for i in todo], self.config.max_len)
    rows = self.config.eval_batch_size
    tokens = self._rows_of(
      ids, lambda chunk: self._translation_prompts(data.pad_batch(chunk, rows=rows))
    )
    outputs = [""] * len(lines)
    for i, row_tokens in zip(todo, tokens):
      outputs[i] = self.tokenizer.decode(row_tokens.tolist())
    return outputs

  def continue_text(self, texts: Iterable[str], max_new_tokens: int) -> list[str]:
    """A decoder-only model's continuation of each text (BOS + its ids, no EOS: the text
    goes on rather than being translated), detokenized up to EOS. Greedy unless the
    search samples; speculative with a draft. Prompts are clipped to max_len tokens."""
    config = self.config
    if not config.model.decoder_only:
      raise config_lib.ConfigError(
        "config.model.decoder_only: continuing text needs a "
        "decoder-only model; translate with this run"
      )
    if not offered.SEARCHES[self.settings.kind].continues_text:
      continuing = offered.continuing()
      raise config_lib.ConfigError(f"search: text continuation is {' or '.join(continuing)}")
    check_generation_length(config, config.max_len + 1, max_new_tokens)
    rows = config.eval_batch_size
    ids = [
      [config_lib.BOS_ID, *x[: config.max_len]] for x in self.tokenizer.encode_batch(list(texts))
    ]

    def prompts(chunk: list[list[int]]) -> decoding.Prompts:
      prompt_BxP = data.pad_batch(chunk, rows=rows)
      prompt_BxP[len(chunk) :, 0] = config_lib.BOS_ID  # fill rows: a one-token prompt
      return decoding.continuation_prompts(prompt_BxP, max_new_tokens)

    return [self.tokenizer.decode(t.tolist()) for t in self._rows_of(ids, prompts)]


class Translator(Generator):
  """A trained run's Generator: its parameters (only) restored through `transformer.inference`
  onto the config's mesh, and a search (with its draft run, if any)."""

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    step: int | None = None,
    average_last: int = 1,
    settings: SearchSettings = BEAM,
    draft_workdir: str | None = None,
  ):
    config_lib.validate(config)
    settings.check(with_draft=draft_workdir is not None)
    if draft_workdir is not None:  # checked before either run is restored
      draft_config = self._check_draft(config, workdir, draft_workdir)
    restored = inference.restore(workdir, step, average_last, config=config)
    draft = None
    if draft_workdir is not None:  # on the target's mesh, its rows split as the target's
      draft_run = inference.restore(draft_workdir, config=draft_config, mesh=restored.setup.mesh)
      draft = Draft(draft_run.setup.model, draft_run.params, draft_workdir)
    super().__init__(restored.setup, restored.params, restored.tokenizer, settings, draft)
    self.workdir, self.step, self.average_last = workdir, restored.step, average_last

  @staticmethod
  def _check_draft(config, workdir: str, draft_workdir: str) -> ml_collections.ConfigDict:
    """The draft run's config, once it is known to fit the target: a one-line ConfigError
    otherwise."""
    if not storage.is_dir(draft_workdir):
      raise config_lib.ConfigError(f"draft_workdir: {draft_workdir} does not exist")
    check_draft_vocabulary(workdir, draft_workdir)
    draft_config = checkpoints.load_run_config(draft_workdir)
    config_lib.validate(draft_config)
    if bool(draft_config.model.decoder_only) != bool(config.model.decoder_only):
      raise config_lib.ConfigError(
        "draft_workdir: the draft must be of the target's kind (decoder-only or encoder-decoder)"
      )
    draft_config.eval_batch_size = config.eval_batch_size  # rows split as the target's
    return draft_config


def check_generation_length(
  config: ml_collections.ConfigDict, prompt_len: int, max_new_tokens: int
) -> None:
  """One-line ConfigError unless max_new_tokens >= 1 and, with a learned position table,
  a prompt of prompt_len tokens and its continuation fit in the table."""
  if max_new_tokens < 1:
    raise config_lib.ConfigError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
  table = config_lib.position_table_size(config)
  if config.model.positional == "learned" and prompt_len + max_new_tokens > table:
    raise config_lib.ConfigError(
      f"max_new_tokens: {max_new_tokens} after a prompt of up to {prompt_len} tokens "
      f"passes the {table} learned positions; use at most {table - prompt_len}"
    )
