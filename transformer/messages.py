"""Text for people: the one-line errors, hints and durations every command prints.

Errors end a run with one line on stderr, so the pieces that build such lines live here
once: the first line of an exception, a "did you mean" hint, and a short duration.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable


def first_line(error: BaseException, with_type: bool = False) -> str:
  """The first line of an error's text; its type name when the text is empty.

  with_type: prefix the type ("OSError: ...") where the text alone is unclear, such as a
  library's error surfacing inside our own message.
  """
  lines = str(error).strip().splitlines()
  if not lines:
    return type(error).__name__
  return f"{type(error).__name__}: {lines[0]}" if with_type else lines[0]


def did_you_mean(name: str, known: Iterable[str], prefix: str = "") -> str:
  """' (did you mean PREFIXclosest?)' for the closest known name, or '' if none is close."""
  close = difflib.get_close_matches(name, list(known), n=1)
  return f" (did you mean {prefix}{close[0]}?)" if close else ""


def format_duration(seconds: float) -> str:
  """'0m42s', '3m07s' or '2h05m'; '?' for an unknown (infinite or NaN) duration."""
  if not math.isfinite(seconds):
    return "?"
  seconds = max(0, int(round(seconds)))
  hours, rest = divmod(seconds, 3600)
  if hours:
    return f"{hours}h{rest // 60:02d}m"
  return f"{rest // 60}m{rest % 60:02d}s"
