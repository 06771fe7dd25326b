"""The searches the commands offer: each is its decoding class (beam.py, sampling.py),
which declares, beside how it decodes, its --search name and its command-line options.

eval.py and generate.py build their --search choices and their option flags from
`SEARCHES`, and evaluation/translate.SearchSettings checks the values and builds the
search through it, so a new search is one class: an `Offered` search that decodes
(`run`, decoding/search.py), registered with `register`:

  @offered.register
  @struct.dataclass
  class Nucleus(offered.Offered):
    name = "nucleus"
    help = "sampling from the top_p mass"
    options = (offered.Option("top_p", float, 0.9, "Probability mass kept.", ...),)
    top_p: float = struct.field(pytree_node=False, default=0.9)

    @classmethod
    def from_options(cls, config, values):
      return cls(top_p=values["top_p"])

    def run(self, model, params, prompts, rng): ...

An option several searches declare is one flag (its declarations must agree); the
options every search takes (`COMMON_OPTIONS`: the seed and the draft of speculative
decoding, speculative.py, which wraps an offered search) are declared here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import ml_collections

from transformer.config import ConfigError


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
      raise ConfigError(f"{self.name}: {self.requirement}, got {value}")


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


class Offered:
  """What a search the commands offer declares, beside decoding: its name for --search,
  its options, and how it is built from a config and the options' values (every option
  of the search and of COMMON_OPTIONS, by name)."""

  name: ClassVar[str]
  help: ClassVar[str]
  options: ClassVar[tuple[Option, ...]] = ()
  drafts: ClassVar[bool] = False  # speculative decoding can reproduce it with a draft
  continues_text: ClassVar[bool] = True  # generate.py continue offers it

  @classmethod
  def from_options(cls, config: ml_collections.ConfigDict, values: Mapping[str, Any]) -> Any:
    """The search these option values describe (`config`: the run's, for defaults)."""
    raise NotImplementedError

  @classmethod
  def record(cls, config: ml_collections.ConfigDict, values: Mapping[str, Any]) -> dict:
    """What eval.py's JSON records of how the hypotheses were generated."""
    return {}


SEARCHES: dict[str, type[Offered]] = {}


def register(search: type[Offered]) -> type[Offered]:
  """Offers a search to every command (a class decorator); refuses a second search of the
  name, and an option declared otherwise than where it already is."""
  if search.name in SEARCHES:
    raise ValueError(f"a search named {search.name!r} is already registered")
  known = {option.name: option for option in all_options()}
  for option in search.options:
    if known.get(option.name, option) != option:
      raise ValueError(f"--{option.name} of search {search.name!r} differs from its other uses")
  SEARCHES[search.name] = search
  return search


def all_options(names: Iterable[str] | None = None) -> list[Option]:
  """The options of the named searches (default: all) and COMMON_OPTIONS, each once."""
  names = SEARCHES if names is None else names
  options = {option.name: option for name in names for option in SEARCHES[name].options}
  options.update({option.name: option for option in COMMON_OPTIONS})
  return list(options.values())


def drafting() -> list[str]:
  """The searches speculative decoding reproduces."""
  return [name for name, search in SEARCHES.items() if search.drafts]


def continuing() -> list[str]:
  """The searches that continue text (generate.py continue)."""
  return [name for name, search in SEARCHES.items() if search.continues_text]
