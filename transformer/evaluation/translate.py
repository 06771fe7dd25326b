"""Translation with a trained run: restored parameters, a search, detokenized text.

`Translator` loads a workdir's (optionally averaged) parameters and vocabulary onto the
config's mesh, and optionally a second run as the draft model of speculative decoding;
`translate_lines` turns raw sentences into translations, in order. `Search` says how:
beam search (the paper's protocol, the default), greedy decoding or sampling.

Both kinds of model translate. The encoder-decoder reads the source; a decoder-only
model, trained on source + EOS + target + EOS (data/pipeline.py `make_example`),
continues the prompt BOS + source + EOS, and its output is the continuation up to its
EOS. Either way a sentence may produce (its source length) + max_decode_extra_len tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, NamedTuple, Optional

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from transformer import config as config_lib
from transformer import data
from transformer import storage
from transformer.data import tokenizer as tokenizer_lib
from transformer.model import decoding, speculative
from transformer.training import checkpoints, sharding
from transformer.training import state as state_lib

SEARCH_KINDS = ("beam", "greedy", "sample")


@dataclasses.dataclass(frozen=True)
class Search:
  """How hypotheses are generated: beam search (config's beam size and alpha), greedy
  decoding, or sampling from the filtered distribution (decoding.filter_logits).
  draft_len is the tokens a draft model proposes per target pass, when there is one."""
  kind: str = "beam"
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  draft_len: int = 4

  def check(self) -> None:
    """One-line ConfigError for values no search can use."""
    if self.kind not in SEARCH_KINDS:
      raise config_lib.ConfigError(f"search: {self.kind!r} is not one of {SEARCH_KINDS}")
    if not self.temperature > 0:
      raise config_lib.ConfigError(f"temperature: must be > 0, got {self.temperature}")
    if self.top_k < 0:
      raise config_lib.ConfigError(f"top_k: must be >= 0 (0 = all), got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise config_lib.ConfigError(f"top_p: must be in (0, 1], got {self.top_p}")
    if self.draft_len < 1:
      raise config_lib.ConfigError(f"draft_len: must be >= 1, got {self.draft_len}")

  @property
  def sampling(self) -> dict:
    return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


BEAM = Search()


class Draft(NamedTuple):
  """The draft model of speculative decoding: a second run with the same vocabulary."""
  model: Any
  params: Any
  workdir: str


class SearchStats(NamedTuple):
  """What speculative decoding saved over some batches (fill rows included): see
  speculative.SpeculativeOutput."""
  target_calls: int = 0
  proposed: int = 0
  accepted: int = 0
  generated: int = 0  # tokens the target calls produced, EOS included
  row_calls: int = 0  # rows still generating, summed over the target calls

  def __add__(self, other: "SearchStats") -> "SearchStats":
    return SearchStats(*(a + b for a, b in zip(self, other)))

  def summary(self) -> dict[str, float]:
    """acceptance_rate, and tokens_per_target_call per sentence (1 without a draft)."""
    return {"acceptance_rate": self.accepted / max(self.proposed, 1),
            "tokens_per_target_call": self.generated / max(self.row_calls, 1)}


def check_draft_vocabulary(workdir: str, draft_workdir: str) -> None:
  """One-line ConfigError unless both runs saved byte-identical vocabularies: a draft's
  token ids must mean what the target's mean."""
  paths = [storage.join(w, tokenizer_lib.WORKDIR_VOCAB_NAME) for w in (workdir, draft_workdir)]
  for path in paths:
    if not storage.exists(path):
      raise config_lib.ConfigError(f"draft_workdir: {path} is missing (was it trained?)")
  if storage.as_path(paths[0]).read_bytes() != storage.as_path(paths[1]).read_bytes():
    raise config_lib.ConfigError(f"draft_workdir: {paths[1]} differs from {paths[0]}; "
                                 "the draft must share the target's vocabulary")


def _budgets(source_BxS: np.ndarray, config: ml_collections.ConfigDict) -> np.ndarray:
  """Each sentence's most generated tokens: its source length + max_decode_extra_len."""
  return (np.sum(source_BxS != config_lib.PAD_ID, axis=1) + config.max_decode_extra_len
          ).astype(np.int32)


def generate_batch(model, params, config: ml_collections.ConfigDict, mesh, rules,
                   source_BxS: np.ndarray, search: Search = BEAM,
                   draft: Optional[Draft] = None, batch_number: int = 0
                   ) -> tuple[np.ndarray, SearchStats]:
  """`search` on padded source ids (each ending in EOS) -> (tokens [B, C], stats).

  C = S + max_decode_extra_len for both kinds of model; row r's tokens are the output
  for source row r, EOS included, PAD after it and beyond the row's budget. With a
  draft (greedy or sample only) the search is speculative and the stats count what it
  saved; otherwise they are zero. Sampling draws from seed and batch_number.

  Every process passes the same whole batch and gets every row's output back, row r for
  row r: each device searches only its own rows, and the gather follows the global
  array's indices, not an assumed order of processes over the mesh.
  """
  decoder_only = bool(config.model.decoder_only)
  extra = config.max_decode_extra_len
  out_len = source_BxS.shape[1] + extra
  inputs_BxS = source_BxS
  if decoder_only:  # the prompt: BOS + source (+ EOS), right-padded
    inputs_BxS = np.concatenate(
        [np.full((source_BxS.shape[0], 1), config_lib.BOS_ID, np.int32),
         np.asarray(source_BxS, np.int32)], axis=1)
  inputs = sharding.global_batch_from_whole({"source": inputs_BxS}, mesh, rules)["source"]
  rng = None
  if search.kind == "sample":  # the same key on every device and process
    key = np.asarray(jax.random.fold_in(jax.random.PRNGKey(search.seed), batch_number))
    rng = jax.make_array_from_callback(key.shape, sharding.replicated(mesh),
                                       lambda index: key[index])
  lengths = dict(max_new_tokens=out_len) if decoder_only else dict(max_decode_extra_len=extra)
  spec = None
  with sharding.activation_sharding(mesh, rules):  # traced with the activations' axes
    if search.kind == "beam":
      if draft is not None:
        raise config_lib.ConfigError("draft_workdir: speculative decoding is offered for "
                                     "greedy and sampling, not beam search")
      if decoder_only:
        tokens, _ = decoding.prompt_beam_search(
            model, params, inputs, beam_size=config.beam_size,
            alpha=config.length_penalty_alpha, max_new_tokens=out_len,
            max_len_B=_budgets(source_BxS, config))
      else:
        tokens, _ = decoding.beam_search(
            model, params, inputs, beam_size=config.beam_size,
            alpha=config.length_penalty_alpha, max_decode_extra_len=extra)
    elif draft is not None:
      common = dict(draft_len=search.draft_len, **lengths)
      if search.kind == "greedy":
        spec = speculative.speculative_greedy_decode(model, params, draft.model,
                                                     draft.params, inputs, **common)
      else:
        spec = speculative.speculative_sample_decode(model, params, draft.model,
                                                     draft.params, inputs, rng,
                                                     **common, **search.sampling)
      tokens = spec.tokens_BxC
    elif search.kind == "greedy":
      tokens = (speculative.prompt_greedy_decode(model, params, inputs, **lengths)
                if decoder_only else
                decoding.greedy_decode(model, params, inputs, **lengths))
    else:
      tokens = (speculative.prompt_sample_decode(model, params, inputs, rng, **lengths,
                                                 **search.sampling)
                if decoder_only else
                decoding.sample_decode(model, params, inputs, rng, **lengths,
                                       **search.sampling))
  if jax.process_count() > 1:
    tokens = np.asarray(multihost_utils.process_allgather(tokens, tiled=True))
  else:
    tokens = np.asarray(jax.device_get(tokens))
  stats = SearchStats()
  if spec is not None:  # scalars, the same on every process
    stats = SearchStats(int(spec.target_calls), int(spec.proposed), int(spec.accepted),
                        int(np.sum(tokens != config_lib.PAD_ID)), int(spec.row_calls))
  if decoder_only:
    # Prompt decoding gives every row the batch's budget; cutting a row at its own is
    # what a per-row budget would have produced (each token depends on the earlier only).
    beyond_BxC = np.arange(out_len)[None, :] >= _budgets(source_BxS, config)[:, None]
    tokens = np.where(beyond_BxC, config_lib.PAD_ID, tokens)
  return tokens, stats


def search_batch(model, params, config: ml_collections.ConfigDict, mesh, rules,
                 source_BxS: np.ndarray) -> np.ndarray:
  """Beam search (config's beam size and alpha) on padded source ids -> tokens [B, C]."""
  return generate_batch(model, params, config, mesh, rules, source_BxS)[0]


def translate_lines_with(model, params, tokenizer, config: ml_collections.ConfigDict, mesh,
                         rules, lines: list[str], search: Search = BEAM,
                         draft: Optional[Draft] = None) -> tuple[list[str], SearchStats]:
  """Translations of raw sentences, in order, and the speculative stats; an empty line
  stays empty. Inputs longer than max_len are clipped to it (the model never saw longer
  ones)."""
  outputs = [""] * len(lines)
  stats = SearchStats()
  batch_size = config.eval_batch_size
  todo = [i for i, line in enumerate(lines) if line.strip()]
  for number, start in enumerate(range(0, len(todo), batch_size)):
    chunk = todo[start:start + batch_size]
    ids = tokenizer.encode_for_model([lines[i] for i in chunk], config.max_len)
    tokens, batch_stats = generate_batch(model, params, config, mesh, rules,
                                         data.pad_batch(ids, rows=batch_size), search, draft,
                                         number)
    stats += batch_stats
    for row, i in enumerate(chunk):
      outputs[i] = tokenizer.decode(tokens[row].tolist())
  return outputs, stats


def beam_translate(model, params, tokenizer, config: ml_collections.ConfigDict, mesh,
                   rules, lines: list[str]) -> list[str]:
  """Beam-search translations of raw sentences, in order; an empty line stays empty.

  Inputs longer than max_len are clipped to it (the model never saw longer ones).
  """
  return translate_lines_with(model, params, tokenizer, config, mesh, rules, lines)[0]


class Translator:
  """Restored parameters + tokenizer + a search (and its draft model), on the run's mesh."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, *,
               step: int | None = None, average_last: int = 1,
               search: Search = BEAM, draft_workdir: str | None = None):
    config_lib.validate(config)
    search.check()
    if draft_workdir is not None and search.kind == "beam":
      raise config_lib.ConfigError("draft_workdir: speculative decoding is offered for "
                                   "greedy and sampling (search greedy|sample), not beam")
    self.config = config
    self.workdir = workdir
    self.search = search
    self.setup = state_lib.setup(config)
    self.mesh, self.rules, self.model = self.setup.mesh, self.setup.rules, self.setup.model
    self.tokenizer = data.load_workdir_tokenizer(workdir)
    self.draft = None
    if draft_workdir is not None:
      # Checked before either run's parameters are restored or anything compiles.
      check_draft_vocabulary(workdir, draft_workdir)
      draft_config = checkpoints.load_run_config(draft_workdir)
      config_lib.validate(draft_config)
      if bool(draft_config.model.decoder_only) != bool(config.model.decoder_only):
        raise config_lib.ConfigError("draft_workdir: the draft must be of the target's kind "
                                     "(decoder-only or encoder-decoder)")
      draft_config.eval_batch_size = config.eval_batch_size  # rows split as the target's
      draft_setup = state_lib.setup(draft_config, mesh=self.mesh)
      draft_params, _ = checkpoints.restore_params(draft_workdir, draft_setup)
      self.draft = Draft(draft_setup.model, draft_params, draft_workdir)
    self.params, self.step = checkpoints.restore_params(
        workdir, self.setup, step=step, average_last=average_last)
    self.average_last = average_last
    self.stats = SearchStats()  # accumulated over every search this translator ran

  def generate(self, source_BxS: np.ndarray, batch_number: int = 0) -> np.ndarray:
    """The search on one padded source batch -> tokens [B, C] (see `generate_batch`)."""
    tokens, stats = generate_batch(self.model, self.params, self.config, self.mesh,
                                   self.rules, source_BxS, self.search, self.draft,
                                   batch_number)
    self.stats += stats
    return tokens

  def translate_lines(self, lines: Iterable[str]) -> list[str]:
    """Detokenized translations of raw sentences, in order (an empty line stays empty)."""
    outputs, stats = translate_lines_with(self.model, self.params, self.tokenizer,
                                          self.config, self.mesh, self.rules, list(lines),
                                          self.search, self.draft)
    self.stats += stats
    return outputs

  def continue_text(self, texts: Iterable[str], max_new_tokens: int) -> list[str]:
    """A decoder-only model's continuation of each text (BOS + its ids, no EOS: the text
    goes on rather than being translated), detokenized up to EOS. Greedy unless the
    search samples; speculative with a draft. Prompts are clipped to max_len tokens."""
    if not self.config.model.decoder_only:
      raise config_lib.ConfigError("config.model.decoder_only: --prompt continues text "
                                   "with a decoder-only model; use --translate for this run")
    if max_new_tokens < 1:
      raise config_lib.ConfigError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    if self.search.kind == "beam":
      raise config_lib.ConfigError("search: text continuation is greedy or sampled")
    texts = list(texts)
    outputs = []
    rows = self.config.eval_batch_size
    for number, start in enumerate(range(0, len(texts), rows)):
      ids = [[config_lib.BOS_ID, *x[:self.config.max_len]]
             for x in self.tokenizer.encode_batch(texts[start:start + rows])]
      prompt_BxP = data.pad_batch(ids, rows=rows)
      prompt_BxP[len(ids):, 0] = config_lib.BOS_ID  # fill rows: a one-token prompt
      tokens = self._continue_batch(prompt_BxP, max_new_tokens, number)
      outputs += [self.tokenizer.decode(tokens[row].tolist()) for row in range(len(ids))]
    return outputs

  def _continue_batch(self, prompt_BxP: np.ndarray, max_new_tokens: int,
                      batch_number: int) -> np.ndarray:
    prompt = sharding.global_batch_from_whole({"source": prompt_BxP}, self.mesh,
                                              self.rules)["source"]
    key = np.asarray(jax.random.fold_in(jax.random.PRNGKey(self.search.seed), batch_number))
    rng = jax.make_array_from_callback(key.shape, sharding.replicated(self.mesh),
                                       lambda index: key[index])
    model, params, draft = self.model, self.params, self.draft
    with sharding.activation_sharding(self.mesh, self.rules):
      if draft is not None and self.search.kind == "greedy":
        output = speculative.speculative_greedy_decode(
            model, params, draft.model, draft.params, prompt,
            draft_len=self.search.draft_len, max_new_tokens=max_new_tokens)
      elif draft is not None:
        output = speculative.speculative_sample_decode(
            model, params, draft.model, draft.params, prompt, rng,
            draft_len=self.search.draft_len, max_new_tokens=max_new_tokens,
            **self.search.sampling)
      elif self.search.kind == "greedy":
        output = speculative.prompt_greedy_decode(model, params, prompt,
                                                  max_new_tokens=max_new_tokens)
      else:
        output = speculative.prompt_sample_decode(model, params, prompt, rng,
                                                  max_new_tokens=max_new_tokens,
                                                  **self.search.sampling)
    if draft is not None:
      self.stats += SearchStats(int(output.target_calls), int(output.proposed),
                                int(output.accepted),
                                int(jax.numpy.sum(output.tokens_BxC != config_lib.PAD_ID)),
                                int(output.row_calls))
      output = output.tokens_BxC
    if jax.process_count() > 1:
      return np.asarray(multihost_utils.process_allgather(output, tiled=True))
    return np.asarray(jax.device_get(output))
