"""The text every command prints (messages.py): an error's first line, the "did you mean"
hint and short durations."""

import math

import pytest

from transformer import messages


class CustomError(RuntimeError):
  pass


@pytest.mark.parametrize(
  "error,plain,typed",
  [
    (ValueError("bad value\nsecond line"), "bad value", "ValueError: bad value"),
    (ValueError("\n  \n  first\nsecond"), "first", "ValueError: first"),
    (CustomError("went wrong"), "went wrong", "CustomError: went wrong"),
    (
      OSError(2, "No such file"),
      "[Errno 2] No such file",
      "FileNotFoundError: [Errno 2] No such file",
    ),  # OSError(2, ...) is this subclass
    (KeyError("x"), "'x'", "KeyError: 'x'"),
  ],
)
def test_first_line_is_the_first_non_blank_line(error, plain, typed):
  """Only the first line of the text, leading blank lines skipped; with_type prefixes
  the error's own class name."""
  assert messages.first_line(error) == plain
  assert messages.first_line(error, with_type=True) == typed


@pytest.mark.parametrize("error", [KeyboardInterrupt(), ValueError(""), CustomError(" \n ")])
def test_first_line_of_an_error_without_text_is_its_type(error):
  """No text: the type name alone, never an empty line or a dangling 'Type: '."""
  name = type(error).__name__
  assert messages.first_line(error) == name
  assert messages.first_line(error, with_type=True) == name


def test_did_you_mean_names_the_closest_known_name():
  known = ["d_ff", "d_model", "d_k", "dropout_rate"]
  assert messages.did_you_mean("d_fff", known) == " (did you mean d_ff?)"
  assert messages.did_you_mean("d_modle", known, prefix="config.model.") == (
    " (did you mean config.model.d_model?)"
  )
  assert messages.did_you_mean("bse", ["A1", "bs", "base"]) == " (did you mean base?)"


def test_did_you_mean_is_empty_when_nothing_is_close():
  assert messages.did_you_mean("learning_rate", ["d_ff", "seed"]) == ""
  assert messages.did_you_mean("anything", []) == ""


def test_did_you_mean_takes_any_iterable():
  """`known` may be a generator or a set, consumed once."""
  assert messages.did_you_mean("sed", (k for k in ["seed", "beam_size"])) == (
    " (did you mean seed?)"
  )
  assert messages.did_you_mean("beam_sise", {"seed", "beam_size"}) == (" (did you mean beam_size?)")


@pytest.mark.parametrize(
  "seconds,text",
  [
    (-5, "0m00s"),  # a clock stepping back never prints a negative duration
    (0, "0m00s"),
    (0.4, "0m00s"),
    (42, "0m42s"),
    (59.4, "0m59s"),
    (59.6, "1m00s"),  # rounded before splitting: never "0m60s"
    (187, "3m07s"),
    (3599, "59m59s"),
    (3599.6, "1h00m"),  # never "60m00s"
    (3600, "1h00m"),
    (3661, "1h01m"),  # hours drop the seconds
    (7500, "2h05m"),
    (100 * 3600 + 59 * 60 + 59, "100h59m"),  # minutes are truncated, not rounded up
  ],
)
def test_format_duration(seconds, text):
  assert messages.format_duration(seconds) == text


@pytest.mark.parametrize("seconds", [math.inf, -math.inf, math.nan])
def test_format_duration_of_an_unknown_duration_is_a_question_mark(seconds):
  """An ETA divided by a zero rate (inf) or a NaN is '?', not an exception."""
  assert messages.format_duration(seconds) == "?"
