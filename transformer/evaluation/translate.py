"""Generation with a trained run: restored parameters, a search, detokenized text.

`Translator` loads a workdir's (optionally averaged) parameters and vocabulary onto the
config's mesh, and optionally a second run as the draft model of speculative decoding.
`SearchSettings` says how to generate (a search of evaluation/searches.py: beam search,
the paper's protocol and the default; greedy; sampling; greedy or sampling with a draft)
and builds the decoding search (transformer/model/decoding). `run_search` is the one
place a batch meets a search: its rows are spread over the mesh, sampling gets its key,
and the outputs and the draft's statistics come back to every process in the batch's
row order.

Both kinds of model translate alike: decoding.translation_prompts (an encoder-decoder
reads the source and continues BOS, a decoder-only model continues BOS + source), each
sentence producing at most its source length + max_decode_extra_len tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from transformer import config as config_lib
from transformer import data, run, storage
from transformer.data import tokenizer as tokenizer_lib
from transformer.evaluation import searches
from transformer.model import decoding
from transformer.run import checkpoints, sharding


class SearchSettings:
  """How hypotheses are generated: a search of searches.SEARCHES (beam search, the
  paper's protocol and the default; greedy decoding; sampling) and the values of its
  options and of the common ones (searches.COMMON_OPTIONS), each defaulting to its
  declaration; with a draft model, draft_len tokens are proposed per target pass."""

  def __init__(self, kind: str = "beam", **values: Any):
    self.kind = kind
    options = searches.all_options([kind] if kind in searches.SEARCHES else [])
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
    if self.kind not in searches.SEARCHES:
      raise config_lib.ConfigError(
        f"search: {self.kind!r} is not one of {', '.join(searches.SEARCHES)}"
      )
    for option in self._options:
      option.check(self.values[option.name])
    if with_draft and not searches.SEARCHES[self.kind].drafts:
      offered = searches.drafting()
      raise config_lib.ConfigError(
        f"draft_workdir: speculative decoding is offered for {', '.join(offered)} "
        f"(--search={'|'.join(offered)}), not {self.kind}"
      )

  def build(self, config: ml_collections.ConfigDict, draft_model: Any = None) -> decoding.Search:
    """The decoding search these settings describe (speculative with a draft model)."""
    search = searches.SEARCHES[self.kind].build(config, self.values)
    if draft_model is None:
      return search
    return decoding.Speculative(draft_model, self.draft_len, search)

  def record(self, config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The search's own entries in eval.py's JSON."""
    return searches.SEARCHES[self.kind].record(config, self.values)


BEAM = SearchSettings()


class Draft(NamedTuple):
  """The draft model of speculative decoding: a second run with the same vocabulary."""

  model: Any
  params: Any
  workdir: str


@dataclasses.dataclass(frozen=True)
class SearchStats:
  """What speculative decoding saved over some batches (fill rows included): see
  decoding.Generation."""

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
  draft_params: Any = None,
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
    out = decoding.decode(model, params, prompts, search, rng, draft_params)
  if jax.process_count() > 1:
    tokens = np.asarray(multihost_utils.process_allgather(out.tokens_BxO, tiled=True))
  else:
    tokens = np.asarray(jax.device_get(out.tokens_BxO))
  stats = SearchStats()
  if isinstance(search, decoding.Speculative):  # scalars, the same on every process
    stats = SearchStats(
      int(out.calls),
      int(out.proposed),
      int(out.accepted),
      int(np.sum(tokens != config_lib.PAD_ID)),
      int(out.row_calls),
    )
  return tokens, stats


def translate_lines(
  model,
  params,
  tokenizer,
  config: ml_collections.ConfigDict,
  mesh,
  rules,
  lines: list[str],
  search: decoding.Search | None = None,
  *,
  seed: int = 0,
  draft_params: Any = None,
  after_batch: Callable[[], None] | None = None,
) -> tuple[list[str], SearchStats]:
  """Translations of raw sentences, in order, and the speculative stats; an empty line
  stays empty. Inputs longer than max_len are clipped to it (the model never saw longer
  ones). The search defaults to the config's beam search. `after_batch` is called after
  each batch (Translator.after_batch)."""
  search = search or BEAM.build(config)
  outputs = [""] * len(lines)
  stats = SearchStats()
  rows = config.eval_batch_size
  todo = [i for i, line in enumerate(lines) if line.strip()]
  for number, start in enumerate(range(0, len(todo), rows)):
    chunk = todo[start : start + rows]
    ids = tokenizer.encode_for_model([lines[i] for i in chunk], config.max_len)
    prompts = decoding.translation_prompts(
      data.pad_batch(ids, rows=rows), config.max_decode_extra_len, bool(config.model.decoder_only)
    )
    tokens, batch_stats = run_search(
      model,
      params,
      mesh,
      rules,
      prompts,
      search,
      seed=seed,
      batch_number=number,
      draft_params=draft_params,
    )
    stats += batch_stats
    for row, i in enumerate(chunk):
      outputs[i] = tokenizer.decode(tokens[row].tolist())
    if after_batch is not None:
      after_batch()
  return outputs, stats


class Translator:
  """Restored parameters + tokenizer + a search (and its draft model), on the run's mesh."""

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
    restored = run.restore(workdir, step, average_last, config=config)
    self.config, self.workdir = config, workdir
    self.setup, self.params, self.step = restored.setup, restored.params, restored.step
    self.mesh, self.rules, self.model = self.setup.mesh, self.setup.rules, self.setup.model
    self.tokenizer = restored.tokenizer
    self.draft = None
    if draft_workdir is not None:  # on the target's mesh, its rows split as the target's
      draft = run.restore(draft_workdir, config=draft_config, mesh=self.mesh)
      self.draft = Draft(draft.setup.model, draft.params, draft_workdir)
    self.settings = settings
    self.average_last = average_last
    self.stats = SearchStats()  # accumulated over every search this translator ran
    # Called after every batch searched: eval.py and generate.py stop there on a
    # preemption notice (training.distributed.StopBetweenBatches).
    self.after_batch: Callable[[], None] | None = None

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

  @property
  def search(self) -> decoding.Search:
    """The decoding search of the settings (speculative with the draft, if any)."""
    return self.settings.build(self.config, self.draft and self.draft.model)

  def _run(self, prompts: decoding.Prompts, batch_number: int) -> np.ndarray:
    tokens, stats = run_search(
      self.model,
      self.params,
      self.mesh,
      self.rules,
      prompts,
      self.search,
      seed=self.settings.seed,
      batch_number=batch_number,
      draft_params=self.draft and self.draft.params,
    )
    self.stats += stats
    if self.after_batch is not None:
      self.after_batch()
    return tokens

  def generate(self, source_BxS: np.ndarray, batch_number: int = 0) -> np.ndarray:
    """The search on one padded source batch -> tokens [B, S + max_decode_extra_len]."""
    return self._run(
      decoding.translation_prompts(
        source_BxS, self.config.max_decode_extra_len, bool(self.config.model.decoder_only)
      ),
      batch_number,
    )

  def translate_lines(self, lines: Iterable[str]) -> list[str]:
    """Detokenized translations of raw sentences, in order (an empty line stays empty)."""
    outputs, stats = translate_lines(
      self.model,
      self.params,
      self.tokenizer,
      self.config,
      self.mesh,
      self.rules,
      list(lines),
      self.search,
      seed=self.settings.seed,
      draft_params=self.draft and self.draft.params,
      after_batch=self.after_batch,
    )
    self.stats += stats
    return outputs

  def continue_text(self, texts: Iterable[str], max_new_tokens: int) -> list[str]:
    """A decoder-only model's continuation of each text (BOS + its ids, no EOS: the text
    goes on rather than being translated), detokenized up to EOS. Greedy unless the
    search samples; speculative with a draft. Prompts are clipped to max_len tokens."""
    if not self.config.model.decoder_only:
      raise config_lib.ConfigError(
        "config.model.decoder_only: continuing text needs a "
        "decoder-only model; translate with this run"
      )
    if not searches.SEARCHES[self.settings.kind].continues_text:
      offered = [name for name, kind in searches.SEARCHES.items() if kind.continues_text]
      raise config_lib.ConfigError(f"search: text continuation is {' or '.join(offered)}")
    check_generation_length(self.config, self.config.max_len + 1, max_new_tokens)
    texts = list(texts)
    outputs = []
    rows = self.config.eval_batch_size
    for number, start in enumerate(range(0, len(texts), rows)):
      ids = [
        [config_lib.BOS_ID, *x[: self.config.max_len]]
        for x in self.tokenizer.encode_batch(texts[start : start + rows])
      ]
      prompt_BxP = data.pad_batch(ids, rows=rows)
      prompt_BxP[len(ids) :, 0] = config_lib.BOS_ID  # fill rows: a one-token prompt
      tokens = self._run(decoding.continuation_prompts(prompt_BxP, max_new_tokens), number)
      outputs += [self.tokenizer.decode(tokens[row].tolist()) for row in range(len(ids))]
    return outputs


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
