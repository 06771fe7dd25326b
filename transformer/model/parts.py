"""The parts of the computation, as the model names them for profiles and cost models.

The model runs each part under `parts.scope(PART)`, a `jax.named_scope`, so every op
it traces carries the part in its source path (HLO metadata `op_name`, e.g.
"jit(train_step)/jvp(part.attention_core)/dot_general"). A profile finds an op's part
by `part_of_op_name`, the innermost part on the path: a dropout inside attention is
dropout. Renaming a module or a function moves nothing; an op traced under no part
scope is "other".
"""

from __future__ import annotations

import re

import jax

EMBEDDING = "embedding"
PROJECTIONS = "projections"  # attention's query/key/value and output projections
ATTENTION_CORE = "attention core"  # scores, mask, softmax, weighted values
FFN = "FFN"
LAYER_NORM = "layer norm"
DROPOUT = "dropout"
LOGITS = "logits"  # the output projection onto the vocabulary
LOSS = "loss"
OPTIMIZER = "optimizer"

PARTS = (
  ATTENTION_CORE,
  PROJECTIONS,
  FFN,
  LOGITS,
  LOSS,
  OPTIMIZER,
  DROPOUT,
  LAYER_NORM,
  EMBEDDING,
)

_PREFIX = "part."
_BY_SCOPE = {_PREFIX + part.replace(" ", "_"): part for part in PARTS}
_SCOPE = re.compile(r"part\.[A-Za-z_]+")


def scope(part: str):
  """A `jax.named_scope` that names `part` (one of PARTS) on every op traced inside it."""
  if part not in PARTS:
    raise ValueError(f"unknown model part {part!r}; one of {', '.join(PARTS)}")
  return jax.named_scope(_PREFIX + part.replace(" ", "_"))


def part_of_op_name(op_name: str) -> str | None:
  """The innermost part named on an op's source path, or None where none is."""
  for name in reversed(_SCOPE.findall(op_name)):
    if name in _BY_SCOPE:
      return _BY_SCOPE[name]
  return None
