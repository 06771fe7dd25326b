"""The package's layers import only downward: the layout README's code map describes."""

import ast
import os

from tests.helpers.tiny_run import REPO

PACKAGE = os.path.join(REPO, "transformer")
FOLDERS = ("model", "data", "inference", "training", "evaluation", "sweeps", "tools")
# What each layer may import from the package, besides itself (the rest is upward).
ALLOWED = {
  "messages": set(),
  "host_memory": set(),
  "versions": set(),
  "config": {"messages"},
  "storage": {"messages"},
  "cli": {"config", "messages", "host_memory"},
  "model": {"config", "messages"},
  "data": {"config", "messages", "storage"},
  # A model and its parameters on a mesh of processes: what serving a trained run needs,
  # below training.
  "inference": {"config", "messages", "storage", "model", "data"},
  "training": {"config", "messages", "storage", "versions", "model", "data", "inference"},
  # Serving a trained run: never training (train.py hands its validation to the loop).
  "evaluation": {"config", "messages", "storage", "versions", "model", "data", "inference"},
  "sweeps": {
    "config",
    "messages",
    "storage",
    "versions",
    "cli",
    "model",
    "data",
    "inference",
    "training",
    "evaluation",
  },
  "tools": {
    "config",
    "messages",
    "storage",
    "versions",
    "cli",
    "host_memory",
    "model",
    "data",
    "inference",
    "training",
    "evaluation",
    "sweeps",
  },
}
# What serves a trained run loads it through `transformer.inference`, parameters only: none
# of these imports anything of training (its state, optimizer, steps, checkpoint writer or
# process start-up), directly or through another module of the package. The whole
# evaluation layer is checked as well, by ALLOWED above.
SERVING = (
  "eval.py",
  "generate.py",
  "transformer/evaluation/translate.py",
  "transformer/evaluation/score.py",
  "transformer/evaluation/attention_maps.py",
  "transformer/evaluation/validation.py",
  "transformer/tools/export.py",
  "transformer/tools/average_checkpoints.py",
  "transformer/tools/compare_ctranslate2.py",
)
TRAINING = "transformer.training"


def _layer(module: str) -> str | None:
  parts = module.split(".")
  if parts[0] != "transformer" or len(parts) < 2:
    return None
  return parts[1]


def _imported_layers(path: str) -> set[str]:
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  layers = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    else:
      continue
    layers |= {layer for layer in map(_layer, names) if layer}
  return layers


def test_every_module_imports_only_lower_layers():
  upward = []
  for root, _, files in os.walk(PACKAGE):
    for name in files:
      if not name.endswith(".py"):
        continue
      path = os.path.join(root, name)
      relative = os.path.relpath(path, PACKAGE)
      own = relative.split(os.sep)[0].removesuffix(".py")
      if own == "__init__":
        continue
      assert own in ALLOWED, f"{relative}: a module outside the known layers"
      for layer in _imported_layers(path) - {own}:
        if layer not in ALLOWED[own]:
          upward.append(f"{relative} imports transformer.{layer}")
  assert not upward, upward


def _module_name(path: str) -> str:
  relative = os.path.relpath(path, REPO).removesuffix(".py").replace(os.sep, ".")
  return relative.removesuffix(".__init__")


def _imported_modules(path: str, known: set[str]) -> set[str]:
  """The package's modules that `path` imports (a `from X import y` counts X.y if it is one)."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      for alias in node.names:
        child = f"{node.module}.{alias.name}"
        found.add(child if child in known else node.module)
    elif isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
  return found & known


def test_no_module_imports_itself_in_a_circle():
  paths = [
    os.path.join(root, name)
    for root, _, files in os.walk(PACKAGE)
    for name in files
    if name.endswith(".py")
  ]
  known = {_module_name(p) for p in paths}
  # Package __init__ files only document and re-export: an import of `transformer.model`
  # stands for the modules it re-exports, whose own imports the graph already holds.
  graph = {
    _module_name(p): set()
    if p.endswith("__init__.py")
    else _imported_modules(p, known) - {_module_name(p)}
    for p in paths
  }
  visiting, done = [], set()

  def visit(module):
    if module in done:
      return
    assert module not in visiting, " -> ".join(visiting[visiting.index(module) :] + [module])
    visiting.append(module)
    for imported in sorted(graph.get(module, ())):
      visit(imported)
    visiting.pop()
    done.add(module)

  for module in sorted(graph):
    visit(module)


def test_the_checker_sees_an_upward_import(tmp_path):
  """The test above would fail: an import of evaluation from training is found."""
  module = tmp_path / "loop.py"
  module.write_text("from transformer.evaluation import bleu\nimport transformer.model.decoding\n")
  assert _imported_layers(str(module)) == {"evaluation", "model"}
  assert "evaluation" not in ALLOWED["training"]
  assert set(FOLDERS) <= set(ALLOWED)


def _private_names_used_across_modules(
  path: str, packages: tuple[str, ...] = ("transformer",)
) -> list[str]:
  """`from transformer.x import _name`, or `module._name` on a module of the package
  imported as `module`: another module's private names (of `packages`)."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  found, module_aliases = [], set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(packages):
      found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
      module_aliases |= {a.asname or a.name for a in node.names}
    elif isinstance(node, ast.Import):
      module_aliases |= {a.asname for a in node.names if a.asname and a.name.startswith(packages)}
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Attribute)
      and isinstance(node.value, ast.Name)
      and node.value.id in module_aliases
      and node.attr.startswith("_")
      and not node.attr.startswith("__")
    ):
      found.append(f"{node.value.id}.{node.attr}")
  return found


def test_no_module_uses_another_modules_private_names(tmp_path):
  used = {
    os.path.relpath(os.path.join(root, name), PACKAGE): names
    for root, _, files in os.walk(PACKAGE)
    for name in files
    if name.endswith(".py")
    for names in [_private_names_used_across_modules(os.path.join(root, name))]
    if names
  }
  assert not used, used
  module = tmp_path / "speculative.py"  # the checker sees both forms
  module.write_text(
    "from transformer.model.decoding import _cached_call\n"
    "from transformer.model.decoding import cache\ncache._slot_axis(1)\n"
  )
  assert _private_names_used_across_modules(str(module)) == [
    "transformer.model.decoding._cached_call",
    "cache._slot_axis",
  ]


def _function_lengths(path: str) -> dict[str, int]:
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  return {
    node.name: node.end_lineno - node.lineno + 1
    for node in ast.walk(tree)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
  }


def test_functions_read_in_one_screen():
  """No function over 100 lines anywhere in the package; none over 60 in generation
  (decoding and evaluation), which new searches and model kinds extend."""
  too_long = []
  for root, _, files in os.walk(PACKAGE):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(root, name)
        relative = os.path.relpath(path, PACKAGE)
        limit = (
          60 if relative.startswith((os.path.join("model", "decoding"), "evaluation")) else 100
        )
        too_long += [
          f"{relative}:{function} ({lines} lines)"
          for function, lines in _function_lengths(path).items()
          if lines > limit
        ]
  assert not too_long, too_long


def _imported_test_modules(path: str) -> set[str]:
  """What `path` imports from the `tests` package, as dotted module names."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      if node.module == "tests":
        found |= {f"tests.{alias.name}" for alias in node.names}
      elif node.module.startswith("tests."):
        found.add(node.module)
    elif isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.startswith("tests.")}
  return found


def test_test_files_share_code_only_through_helpers():
  """A test file imports tests.helpers, never another test file: each runs alone, and
  moving a test never breaks a second file."""
  tests_dir = os.path.join(REPO, "tests")
  crossing = [
    f"{name} imports {module}"
    for name in sorted(os.listdir(tests_dir))
    if name.endswith(".py")
    for module in sorted(_imported_test_modules(os.path.join(tests_dir, name)))
    if not (module == "tests.helpers" or module.startswith("tests.helpers."))
  ]
  assert not crossing, crossing


def test_the_checker_sees_a_test_file_importing_another(tmp_path):
  module = tmp_path / "test_a.py"
  module.write_text(
    "from tests.test_config import load_config\nfrom tests import test_b\n"
    "from tests.helpers import tiny_run\n"
  )
  assert _imported_test_modules(str(module)) == {
    "tests.test_config",
    "tests.test_b",
    "tests.helpers",
  }


def test_importing_every_module_leaves_absl_flags_to_the_programs():
  """Every module of the package imports into one process (a notebook, a test worker),
  and none but a program's `__main__` adds to absl's flag registry: tools that are
  imported too (bench, memory, average_checkpoints) define --config or --workdir only
  when run, else the second import would raise DuplicateFlagError."""
  import importlib

  from absl import flags

  before = set(flags.FLAGS)
  modules = sorted(
    _module_name(os.path.join(root, name))
    for root, _, files in os.walk(PACKAGE)
    for name in files
    if name.endswith(".py") and name != "__main__.py"
  )
  for module in modules:
    importlib.import_module(module)
  added = {name: flags.FLAGS.find_module_defining_flag(name) for name in set(flags.FLAGS) - before}
  assert not {name: m for name, m in added.items() if m and m.startswith("transformer")}, added


def _private_modules_imported(path: str) -> list[str]:
  """Imports of any library's private modules (`from jax._src import ...`)."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  modules = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
  modules += [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
  return [
    m
    for m in modules
    if any(part.startswith("_") and not part.startswith("__") for part in m.split("."))
  ]


def test_tests_use_private_names_only_through_their_helpers(tmp_path):
  """A test file reaches no private name of the package, of docs/render or of a
  library; what must is wrapped once in tests/helpers/."""
  tests_dir = os.path.dirname(os.path.abspath(__file__))
  used = {
    name: found
    for name in sorted(os.listdir(tests_dir))
    if name.endswith(".py")
    for found in [
      _private_names_used_across_modules(
        os.path.join(tests_dir, name), ("transformer", "docs.render")
      )
      + _private_modules_imported(os.path.join(tests_dir, name))
    ]
    if found
  }
  assert not used, used
  module = tmp_path / "test_x.py"  # the checker sees each form
  module.write_text(
    "from jax._src import xla_bridge\nfrom docs.render import doc_views\n"
    "doc_views._acceptance_for(1.0, 3)\n"
  )
  assert _private_names_used_across_modules(str(module), ("transformer", "docs.render")) == [
    "doc_views._acceptance_for"
  ]
  assert _private_modules_imported(str(module)) == ["jax._src"]


# What only the model's incremental side (model/incremental.py) may know of the decoding
# cache: the names of its leaves and collections, and the scanned stack's layout.
CACHE_LEAVES = {
  "cache",
  "decoder",
  "position",
  "key",
  "value",
  "cross_key",
  "cross_value",
  "layers",
  "tokens",
  "self_attention",
  "cross_attention",
}
MODEL_INSIDES = {
  "scan_layers",
  "unstack_layer_params",
  "stack_layer_params",
  "apply",
  "mutable",
  "use_cache",
  "clone",
}


def _model_insides_named(path: str) -> set[str]:
  """The cache leaf names among a module's string constants (docstrings aside) and the
  model's insides among its names, attributes and keywords."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  docstrings = {
    id(node.body[0].value)
    for node in ast.walk(tree)
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
    and node.body
    and isinstance(node.body[0], ast.Expr)
  }
  named = set()
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Constant)
      and isinstance(node.value, str)
      and id(node) not in docstrings
      and node.value in CACHE_LEAVES
    ):
      named.add(repr(node.value))
    for name in (
      getattr(node, "id", None),
      getattr(node, "attr", None),
      getattr(node, "arg", None),
    ):
      if name in MODEL_INSIDES:
        named.add(name)
  return named


def test_decoding_never_names_a_cache_leaf_or_the_scan_layout():
  """The searches drive the model through model/incremental.py alone, so a new kind of
  model or cache changes that module and no search."""
  folder = os.path.join(PACKAGE, "model", "decoding")
  named = {
    name: found
    for name in sorted(os.listdir(folder))
    if name.endswith(".py")
    for found in [_model_insides_named(os.path.join(folder, name))]
    if found
  }
  assert not named, named
  # The checker sees them where they are: in the model's own incremental side.
  assert {
    "'cross_key'",
    "'layers'",
    "'key'",
    "'value'",
    "scan_layers",
    "apply",
    "unstack_layer_params",
  } <= _model_insides_named(os.path.join(PACKAGE, "model", "incremental.py"))


def _reachable_modules(path: str, known: set[str]) -> set[str]:
  """The package's modules that `path` imports, directly or through one another."""
  paths = {_module_name(p): p for p in _package_paths()}
  seen: set[str] = set()
  todo = list(_imported_modules(path, known))
  while todo:
    module = todo.pop()
    if module in seen:
      continue
    seen.add(module)
    if module in paths and not paths[module].endswith("__init__.py") or module in paths:
      todo += _imported_modules(paths[module], known)
  return seen


def _package_paths() -> list[str]:
  return [
    os.path.join(root, name)
    for root, _, files in os.walk(PACKAGE)
    for name in files
    if name.endswith(".py")
  ]


def _training_reached(path: str, known: set[str]) -> list[str]:
  return sorted(
    m for m in _reachable_modules(path, known) if m == TRAINING or m.startswith(TRAINING + ".")
  )


def test_serving_a_run_never_reaches_training(tmp_path):
  """The floor under serving: eval.py, generate.py, the searches, the export, averaging and
  the CTranslate2 comparison load a run through transformer.inference, and none of them
  imports training, however indirectly. The checker itself sees the leaks it guards
  against: training's checkpoint writer, its process start-up, its loop."""
  known = {_module_name(p) for p in _package_paths()}
  reached = {
    relative: _training_reached(os.path.join(REPO, relative), known) for relative in SERVING
  }
  assert {k: v for k, v in reached.items() if v} == {}
  assert all(
    "transformer.inference.restore" in _reachable_modules(os.path.join(REPO, relative), known)
    for relative in ("eval.py", "generate.py", "transformer/tools/export.py")
  )
  leaks = {
    "from transformer.training import checkpoints": "transformer.training.checkpoints",
    "from transformer.training.loop import TrainingRun": "transformer.training.loop",
    "import transformer.training.state": "transformer.training.state",
  }
  for line, module in leaks.items():
    leaking = tmp_path / "leak.py"
    leaking.write_text(line + "\n")
    assert module in _training_reached(str(leaking), known), line
  # Training itself reaches the start-up below it, and the optimizer: the walk is deep.
  train = os.path.join(REPO, "train.py")
  assert "transformer.inference.distributed" in _reachable_modules(train, known)
  assert "transformer.training.optimizer" in _training_reached(train, known)
