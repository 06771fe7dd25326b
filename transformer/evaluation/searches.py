"""The searches the commands offer, each declaring its command-line options once.

eval.py and generate.py build their --search choices and their option flags from
`SEARCHES`, and translate.SearchSettings checks the values and builds the decoding search
through it, so adding a search is one `SearchKind` subclass, registered with `register`:

  @searches.register
  class Nucleus(searches.SearchKind):
    name = "nucleus"
    help = "sampling from the top_p mass"
    options = (searches.Option("top_p", float, 0.9, "Probability mass kept.", ...),)

    def build(self, config, values):
      return decoding.Sampling(top_p=values["top_p"])

An option several searches declare is one flag (its declarations must agree); the
options every search takes (`COMMON_OPTIONS`: the seed and the draft of speculative
decoding) are declared here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import ml_collections

from transformer import config as config_lib
from transformer.model import decoding


@dataclasses.dataclass(frozen=True)
class Option:
  """One command-line option: --name of `type` (int, float or str), `default` when not
  given (None: the search's own default, e.g. the config's), and the one-line check that
  a given value is `valid` (`requirement` says what it asks, for the error)."""

  name: str
  type: type
  default: Any
  help: str
  valid: Callable[[Any], bool] | None = None
  requirement: str = ""

  def check(self, value: Any) -> None:
    """One-line ConfigError for a given value the option cannot take."""
    if value is not None and self.valid is not None and not self.valid(value):
      raise config_lib.ConfigError(f"{self.name}: {self.requirement}, got {value}")


COMMON_OPTIONS = (
  Option("seed", int, 0, "Sampling seed."),
  Option(
    "draft_workdir",
    str,
    None,
    "A second run (same vocabulary) drafting for speculative decoding.",
  ),
  Option(
    "draft_len",
    int,
    4,
    "Tokens the draft proposes per target pass.",
    lambda n: n >= 1,
    "must be >= 1",
  ),
)


class SearchKind:
  """A search a command offers: its name for --search, its options, and the decoding
  search it builds from a config and the options' values (every option of the search and
  of COMMON_OPTIONS, by name)."""

  name: ClassVar[str]
  help: ClassVar[str]
  options: ClassVar[tuple[Option, ...]] = ()
  drafts: ClassVar[bool] = False  # speculative decoding can reproduce it with a draft
  continues_text: ClassVar[bool] = True  # generate.py continue offers it

  def build(self, config: ml_collections.ConfigDict, values: Mapping[str, Any]) -> Any:
    """The decoding search (decoding.Search)."""
    raise NotImplementedError

  def record(self, config: ml_collections.ConfigDict, values: Mapping[str, Any]) -> dict:
    """What eval.py's JSON records of how the hypotheses were generated."""
    return {}


SEARCHES: dict[str, SearchKind] = {}


def register(kind: type[SearchKind]) -> type[SearchKind]:
  """Adds a search to every command (a class decorator); refuses a second search of the
  name, and an option declared otherwise than where it already is."""
  if kind.name in SEARCHES:
    raise ValueError(f"a search named {kind.name!r} is already registered")
  known = {option.name: option for option in all_options()}
  for option in kind.options:
    if known.get(option.name, option) != option:
      raise ValueError(f"--{option.name} of search {kind.name!r} differs from its other uses")
  SEARCHES[kind.name] = kind()
  return kind


def all_options(kinds: Iterable[str] | None = None) -> list[Option]:
  """The options of the named searches (default: all) and COMMON_OPTIONS, each once."""
  names = SEARCHES if kinds is None else kinds
  options = {option.name: option for name in names for option in SEARCHES[name].options}
  options.update({option.name: option for option in COMMON_OPTIONS})
  return list(options.values())


def drafting() -> list[str]:
  """The searches speculative decoding reproduces."""
  return [name for name, kind in SEARCHES.items() if kind.drafts]


@register
class Beam(SearchKind):
  name = "beam"
  help = "beam search (the paper's)"
  continues_text = False
  options = (
    Option(
      "beam_size", int, None, "Beam size (default: the config's).", lambda n: n >= 1, "must be >= 1"
    ),
    Option("alpha", float, None, "Length penalty alpha (default: the config's)."),
  )

  def _size_and_alpha(self, config, values) -> tuple[int, float]:
    size, alpha = values.get("beam_size"), values.get("alpha")
    return (
      config.beam_size if size is None else size,
      config.length_penalty_alpha if alpha is None else alpha,
    )

  def build(self, config, values):
    return decoding.BeamSearch(*self._size_and_alpha(config, values))

  def record(self, config, values):
    beam_size, alpha = self._size_and_alpha(config, values)
    return {"beam_size": beam_size, "alpha": alpha}


@register
class GreedySearch(SearchKind):
  name = "greedy"
  help = "the most likely token at every step"
  drafts = True

  def build(self, config, values):
    return decoding.Greedy()


@register
class Sample(SearchKind):
  name = "sample"
  help = "sampling from the filtered distribution"
  drafts = True
  options = (
    Option(
      "temperature", float, 1.0, "Sampling temperature (> 0).", lambda t: t > 0, "must be > 0"
    ),
    Option(
      "top_k",
      int,
      0,
      "Sample from the K most likely tokens (0 = all).",
      lambda k: k >= 0,
      "must be >= 0 (0 = all)",
    ),
    Option(
      "top_p",
      float,
      1.0,
      "Sample from the smallest set of tokens reaching this mass.",
      lambda p: 0 < p <= 1,
      "must be in (0, 1]",
    ),
  )

  def build(self, config, values):
    return decoding.Sampling(values["temperature"], values["top_k"], values["top_p"])

  def record(self, config, values):
    return {name: values[name] for name in ("seed", "temperature", "top_k", "top_p")}
