"""Every file, module, flag, config and make target that README, docs/, the docstrings and
the comments (the code's and pyproject.toml's) name exists; links point at files and
headings that exist.

Nothing is imported but transformer.config (for the config keys and the configs'
arguments): modules and flags are found by reading the sources, so the test takes
about a second. docs/notes/ is history and may name code as it was, and so may the
commands that rendered regions quote from their records: neither is checked.
"""

import ast
import functools
import glob
import io
import os
import re
import tokenize

import pytest

from docs.render import render_docs
from transformer import config as config_lib

ROOT = config_lib.REPO_ROOT
TOP_LEVEL = ("transformer/", "configs/", "docs/", "tests/", "bench/", "data/")
FILE_SUFFIXES = ("py", "md", "sh", "toml", "jsonl", "json", "png", "csv", "gz", "tsv")
CONFIG_PREFIXES = ("model.", "mesh.", "draft.")
# Written by the commands, not kept in the repository (.gitignore).
GENERATED = ("bench/results/", "workdirs/")

# The top-level commands; each defines its own flags.
ENTRY_POINTS = ("train.py", "eval.py", "generate.py")
# The code run as `python -m NAME`: the package, and what `make docs` runs.
PYTHON_MODULES = ("transformer", "docs.render")


def _read(relative: str) -> str:
  with open(os.path.join(ROOT, relative), encoding="utf-8") as f:
    return f.read()


def _glob(*patterns: str) -> list[str]:
  """The files of each pattern (relative to the root), sorted pattern by pattern."""
  found = (sorted(glob.glob(os.path.join(ROOT, p), recursive=True)) for p in patterns)
  return [os.path.relpath(path, ROOT) for paths in found for path in paths]


def _markdown_files() -> list[str]:
  return ["README.md", *_glob("docs/*.md")]


def _python_files() -> list[str]:
  return [*ENTRY_POINTS, *_glob("configs/**/*.py", "transformer/**/*.py", "docs/render/*.py")]


def _docstrings(relative: str) -> str:
  kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
  nodes = [n for n in ast.walk(ast.parse(_read(relative))) if isinstance(n, kinds)]
  return "\n".join(filter(None, (ast.get_docstring(n, clean=False) for n in nodes)))


def _comments(relative: str) -> str:
  """The comments of a Python file, or of pyproject.toml (whose lines Python's tokenizer
  reads as well: a # in a string is no comment)."""
  tokens = tokenize.generate_tokens(io.StringIO(_read(relative)).readline)
  return "\n".join(t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT)


def _named_text(relative: str) -> str:
  """What a file says in words: a page whole, the docstrings and comments of code, the
  comments of pyproject.toml."""
  if relative.endswith(".md"):
    return _read(relative)
  if relative.endswith(".py"):
    return _docstrings(relative) + "\n" + _comments(relative)
  return _comments(relative)


# Modules, by reading the sources.


@functools.cache
def _module_path(dotted: str) -> str | None:
  """transformer.a.b -> its .py file (or package __init__.py), or None."""
  base = os.path.join(ROOT, *dotted.split("."))
  for candidate in (base + ".py", os.path.join(base, "__init__.py")):
    if os.path.exists(candidate):
      return candidate
  return None


@functools.cache
def _names_in(path: str) -> dict[str, ast.AST]:
  """Top-level names a module defines or imports, also under `if` (a package that loads
  its modules on first use imports their names under `if TYPE_CHECKING:`)."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  names: dict[str, ast.AST] = {}
  nodes = list(tree.body)
  while nodes:
    node = nodes.pop(0)
    if isinstance(node, ast.If):
      nodes += node.body + node.orelse
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names[node.name] = node
    elif isinstance(node, ast.Assign):
      for target in node.targets:
        if isinstance(target, ast.Name):
          names[target.id] = node
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
      names[node.target.id] = node
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      for alias in node.names:
        names[(alias.asname or alias.name).split(".")[0]] = node
  return names


@functools.cache
def _modules_by_basename() -> dict[str, list[str]]:
  """'decoding' -> ['transformer.model.decoding'], for every module and package."""
  found: dict[str, list[str]] = {}
  for path in glob.glob(os.path.join(ROOT, "transformer", "**", "*.py"), recursive=True):
    relative = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    if relative.endswith(".__init__"):
      relative = relative[: -len(".__init__")]
    found.setdefault(relative.split(".")[-1], []).append(relative)
  return found


def _resolves(dotted: str) -> bool:
  """transformer.a.b.name[.attr]: a module, or a name in one (a class's member too)."""
  parts = dotted.split(".")
  for split in range(len(parts), 0, -1):
    path = _module_path(".".join(parts[:split]))
    if path is None:
      continue
    rest = parts[split:]
    if not rest:
      return True
    names = _names_in(path)
    if rest[0] not in names:
      return False
    node = names[rest[0]]
    if len(rest) > 1 and isinstance(node, ast.ClassDef):
      members = {getattr(n, "name", None) for n in node.body}  # methods, nested classes
      fields = [n.target for n in node.body if isinstance(n, ast.AnnAssign)]
      return rest[1] in members | {t.id for t in fields if isinstance(t, ast.Name)}
    return True
  return False


# Flags, by reading the sources.

_DEFINE = re.compile(r"DEFINE_\w+\(\s*\"(\w+)\"")
_ARGPARSE = re.compile(r"add_argument\(\s*\"--(\w+)\"")
# A search's options (transformer/model/decoding/offered.py), which the commands make flags.
_SEARCH_OPTION = re.compile(r"\bOption\(\s*\"(\w+)\"")
_IMPORT = re.compile(
  r"^\s*(?:from (transformer[\w.]*) import ([\w, ]+)|import (transformer[\w.]*))", re.MULTILINE
)


@functools.cache
def _absl_builtin_flags() -> frozenset:
  from absl import app, flags, logging  # noqa: F401  (each defines its own flags)

  # --help and its kin are added when a command starts (absl's app.run, argparse).
  return frozenset(flags.FLAGS) | {"help", "helpfull", "helpshort"}


@functools.cache
def _flags_of(entry: str) -> frozenset:
  """The flags of an entry file: its own and those of every transformer module it imports."""
  seen, pending, names = set(), [os.path.join(ROOT, entry)], set(_absl_builtin_flags())
  while pending:
    path = pending.pop()
    if path in seen:
      continue
    seen.add(path)
    with open(path, encoding="utf-8") as f:
      text = f.read()
    names |= set(_DEFINE.findall(text)) | set(_ARGPARSE.findall(text))
    names |= set(_SEARCH_OPTION.findall(text))
    for package, imported, module in _IMPORT.findall(text):
      names_imported = [f"{package}.{name.strip()}" for name in imported.split(",")]
      candidates = [module] if module else [package, *names_imported]
      pending += filter(None, map(_module_path, candidates))
  return frozenset(names)


def _entry_at(words: list[str], i: int) -> str | None:
  """The file whose flags follow words[i], if words[i] starts a command: one of
  ENTRY_POINTS or `-m transformer.X` (or docs.render.X)."""
  word = words[i]
  if os.path.basename(word) in ENTRY_POINTS:
    return os.path.basename(word)
  if word == "-m" and i + 1 < len(words) and words[i + 1].startswith(PYTHON_MODULES):
    path = _module_path(words[i + 1])
    if path and path.endswith("__init__.py"):
      path = os.path.join(os.path.dirname(path), "__main__.py")
    return os.path.relpath(path, ROOT) if path else None
  return None


@functools.cache
def _all_flags() -> frozenset:
  entries = [f for f in _python_files() if not f.startswith("configs/")]
  return frozenset().union(*(_flags_of(e) for e in entries))


@functools.cache
def _config_keys() -> frozenset:
  return frozenset(_flatten(config_lib.base_config().to_dict()))


def _flatten(tree: dict, prefix: str = "") -> list[str]:
  keys = []
  for key, value in tree.items():
    keys.append(prefix + key)
    if isinstance(value, dict):
      keys += _flatten(value, prefix + key + ".")
  return keys


def _config_key_exists(key: str) -> bool:
  if key.endswith("*"):
    return any(k.startswith(key[:-1]) for k in _config_keys())
  return key in _config_keys()


def _flag_problem(flag: str, known: frozenset) -> str | None:
  name = flag.split("=")[0]
  if name.startswith("config."):
    key = name[len("config.") :]
    return None if _config_key_exists(key) else f"--{name}: no config key {key}"
  if name in known or (name.startswith("no") and name[2:] in known):
    return None
  return f"--{name}"


# What the texts name.

_CODE_BLOCK = re.compile(r"^```[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
_BACKTICKS = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PATH = re.compile(
  r"(?<![\w./<>-])((?:[\w.-]+/)*[\w.-]*\w\.(?:" + "|".join(FILE_SUFFIXES) + r"))(?![\w/-]|\.\w)"
)
_DOTTED = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+\*?)")
_FLAG = re.compile(r"^--([a-z][\w.]*)")
_PLACEHOLDER = re.compile(r"\b[A-Z]{2,}\b")  # NAME, ARG, FILE: stands for any value
# Quoted error messages name what is wrong on purpose.
_ERROR_QUOTE = re.compile(r"error:|did you mean|unknown key", re.IGNORECASE)
_CONFIG_ARG = re.compile(r"(configs/[\w/]+\.py):([\w,|-]+)")
_MAKE = re.compile(r"\bmake ([a-z][\w-]*)")


def _code(text: str, is_markdown: bool) -> list[str]:
  """Code: fenced blocks (line by line, continuations joined) and backticked spans; in
  docstrings, backticked spans and the lines that run a command."""
  spans = []
  if is_markdown:
    for block in _CODE_BLOCK.findall(text):
      spans += block.replace("\\\n", " ").splitlines()
    text = _CODE_BLOCK.sub("", text)
  else:
    spans += [
      line
      for line in text.replace("\\\n", " ").splitlines()
      if re.match(r"\s*(python|make|bash|XLA_FLAGS|TRANSFORMER_)", line)
    ]
  spans += _BACKTICKS.findall(text)
  return [span for span in spans if not _ERROR_QUOTE.search(span)]


def _file_exists(path: str, relative: str) -> bool:
  """A repository path, or one relative to the package, docs/ or the naming file's folder."""
  bases = ("", "transformer", "docs", os.path.dirname(relative))
  return any(os.path.exists(os.path.join(ROOT, base, path)) for base in bases)


@functools.cache
def _repository_basenames() -> frozenset:
  """The names of the repository's files (not those the commands write)."""
  tops = ("transformer", "configs", "tests", "bench", "docs", "data")
  return frozenset(map(os.path.basename, _glob(*(f"{top}/**/*" for top in tops)))) | set(
    ENTRY_POINTS
  )


def _problems(relative: str, text: str) -> list[str]:
  problems = []
  # Rendered regions quote each record's command as it ran, then; they are checked
  # against their records instead (test_render_docs.py).
  text = render_docs.REGION.sub("", text)
  is_markdown = relative.endswith(".md")
  code = _code(text, is_markdown)
  basenames = _repository_basenames()
  # Files.
  for span in code + [text]:
    for path in _PATH.findall(span):
      if (
        _PLACEHOLDER.search(path)
        and not path.endswith(".md")  # README.md is no placeholder
        or path.startswith(GENERATED)
      ):
        continue
      named = path.startswith(TOP_LEVEL) or path in (*ENTRY_POINTS, "pyproject.toml")
      if named or "/" not in path and path.endswith(".md"):
        if not _file_exists(path, relative):
          problems.append(f"file {path}")
      elif "/" not in path and path.endswith(".py") and path not in basenames:
        problems.append(f"file {path}")
  # Links.
  if is_markdown:
    for target in _LINK.findall(text):
      if re.match(r"[a-z]+:", target):
        continue
      path, _, anchor = target.partition("#")
      full = (
        os.path.normpath(os.path.join(ROOT, os.path.dirname(relative), path))
        if path
        else (os.path.join(ROOT, relative))
      )
      if not os.path.exists(full):
        problems.append(f"link {target}")
      elif anchor and full.endswith(".md"):
        with open(full, encoding="utf-8") as f:
          headings = re.findall(r"^#+ (.+)$", f.read(), re.MULTILINE)
        slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
        if anchor not in slugs:
          problems.append(f"link {target}: no such heading")
  # Modules and names in them, in code; in the prose of docstrings and comments,
  # `module.name` (a module of the package) or a config key is a reference when the name
  # looks like code, with an underscore or a capital: decoding.set_positions and
  # config.vocab_from are, tatoeba.org is not.
  prose = [] if is_markdown else _DOTTED.findall(text)
  prose = [d for d in prose if re.search(r"[_A-Z]", d.partition(".")[2])]
  for dotted in [d for span in code for d in _DOTTED.findall(span)] + prose:
    first, _, rest = dotted.partition(".")
    if (
      _PLACEHOLDER.search(dotted)
      or dotted.split(".")[-1] in FILE_SUFFIXES
      or dotted.endswith(tuple("." + s for s in FILE_SUFFIXES))
    ):
      continue
    if dotted.startswith(CONFIG_PREFIXES) or first == "config":
      key = rest if first == "config" else dotted
      if not (_config_key_exists(key) or _resolves("transformer." + dotted)):
        problems.append(f"config key {key}")
    elif dotted.startswith(PYTHON_MODULES):
      if not _resolves(dotted):
        problems.append(f"module or name {dotted}")
    elif first in _modules_by_basename() and not any(
      _resolves(m + "." + rest) for m in _modules_by_basename()[first]
    ):
      problems.append(f"module or name {dotted}")
  # Flags: checked against the command they follow, else against every command's flags.
  for span in code:
    words = span.split()
    known = _all_flags() if span.startswith("--") else None
    entry = None
    for i, word in enumerate(words):
      entry = _entry_at(words, i) or entry
      if entry:
        known = _flags_of(entry)
      match = _FLAG.match(word)
      if match and known is not None and not _PLACEHOLDER.search(word):
        problem = _flag_problem(match.group(1), known)
        if problem:
          problems.append(f"flag {problem} ({entry or 'no command'})")
  # Configs and their arguments.
  for span in code + ([text] if not is_markdown else []):
    for path, argument in _CONFIG_ARG.findall(span):
      if _PLACEHOLDER.search(argument):
        continue
      for arg in argument.split("|"):
        arg = arg.rstrip(",")
        try:
          config_lib.load_config(f"{path}:{arg}", {})
        except Exception as e:  # noqa: BLE001  (any failure is the finding)
          problems.append(f"config {path}:{arg} ({e})")
  # README's sections, named as README ("Section").
  readme_headings = set(re.findall(r"^#+ (.+)$", _read("README.md"), re.MULTILINE))
  for section in re.findall(r"README \(\"([^\"]+)\"\)", text):
    if section not in readme_headings:
      problems.append(f"README section {section}")
  # make targets.
  targets = set(re.findall(r"^([\w-]+):", _read("Makefile"), re.MULTILINE))
  for span in code:
    for target in _MAKE.findall(span):
      if target not in targets:
        problems.append(f"make {target}")
  return sorted(set(problems))


@pytest.mark.parametrize("relative", _markdown_files() + _python_files() + ["pyproject.toml"])
def test_everything_named_exists(relative):
  assert _problems(relative, _named_text(relative)) == []


def test_the_check_reads_comments_and_pyproject(tmp_path):
  """A stale path in a code comment or in pyproject.toml's comments, and a stale
  `module.name` in a docstring's prose, are found."""
  code = tmp_path / "code.py"
  code.write_text(
    '"""Rolls back with decoding.no_such_function."""\n'
    '# The fake lives in tests/no_such_fake.py.\nx = "# not a comment"\n'
  )
  toml = tmp_path / "pyproject.toml"
  toml.write_text('# the local GCS (tests/no_such_gcs.py)\nname = "a # in a string"\n')
  assert _comments(str(code)) == "The fake lives in tests/no_such_fake.py."
  assert _comments(str(toml)) == "the local GCS (tests/no_such_gcs.py)"
  assert _problems("code.py", _named_text(str(code))) == [
    "file tests/no_such_fake.py",
    "module or name decoding.no_such_function",
  ]
  assert _problems("pyproject.toml", _named_text(str(toml))) == ["file tests/no_such_gcs.py"]


def test_the_check_finds_what_is_missing():
  text = """
```
python train.py --config configs/default.py:nosuch --no_such_flag --config.model.no_key=1
python -m transformer.tools.no_such_tool
python -m docs.render.render_docs --no_such_render_flag
python -m docs.render.no_such_renderer
make no_such_target
```
`speed.py` in `transformer/data/`; `tied_projection` in `model.py`; `decoding.no_such_name`;
`model.no_such_key`; [a link](docs/no_such_page.md); [a heading](docs/data.md#no-such-heading)
The paper's values (PAPER.md). Started as README ("No such section") says.
"""
  found = "\n".join(_problems("README.md", text))
  for expected in (
    "file speed.py",
    "file model.py",
    "flag --no_such_flag",
    "--config.model.no_key",
    "config configs/default.py:nosuch",
    "module or name transformer.tools.no_such_tool",
    "flag --no_such_render_flag (docs/render/render_docs.py)",
    "module or name docs.render.no_such_renderer",
    "module or name decoding.no_such_name",
    "config key model.no_such_key",
    "make no_such_target",
    "link docs/no_such_page.md",
    "file PAPER.md",
    "README section No such section",
    "link docs/data.md#no-such-heading",
  ):
    assert expected in found
