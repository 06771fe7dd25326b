"""make docs: regions rendered from result records, records checked against their
producers' versions, records made."""

import json
import os
import subprocess
import sys

import pytest

from docs.render import doc_views, record_sources, render_docs

PROVENANCE = {
  "machine": "a test machine",
  "date": "2026-12-01",
  "commit": "abc1234",
  "command": "python -m transformer.tools.bench --json",
}


def test_every_region_in_the_repository_matches_its_records():
  assert render_docs.render(check=True) == [], "run `make docs`"


def test_every_view_is_used_and_every_region_names_a_view():
  used = set()
  for relative in render_docs.rendered_files():
    with open(os.path.join(render_docs.REPO_ROOT, relative), encoding="utf-8") as f:
      used |= {m.group("view") for m in render_docs.REGION.finditer(f.read())}
  assert used == set(doc_views.views())


def test_every_shown_record_has_its_provenance_and_version_and_current_ones_their_producers():
  for view in doc_views.views().values():
    for name, record, _ in doc_views.shown(view):
      assert all(record.get(k) for k in doc_views.PROVENANCE_KEYS), (name, record)
      assert isinstance(record.get("record_version"), int), (name, record)
  assert record_sources.outdated() == [], "rerun these records' commands and append"
  assert all(record_sources.producer_version(name) >= 1 for name in record_sources.PRODUCERS)


# What a producer computes, keyed by its RECORD_VERSION: a change to the output without a
# new version fails here. Table 3's dry run: parameters and FLOPs per target token of two
# rows, from shapes alone.
DRY_RUN_KNOWN_ANSWERS = {
  1: {"base": (63_045_632, 406_216_704.0), "C1": (33_644_544, 211_181_568.0)},
}


def test_the_sweeps_dry_run_matches_the_known_answer_of_its_version():
  from transformer.sweeps import report, spec

  sweep = spec.load_sweep("configs/sweeps/table3.py")
  rows = spec.select_rows(sweep, "base,C1")
  described = report.describe_rows(rows, {r.name: spec.row_config(sweep, r) for r in rows})
  assert {d["name"]: (d["num_params"], d["flops_per_token"]) for d in described} == (
    DRY_RUN_KNOWN_ANSWERS[report.RECORD_VERSION]
  )


# tools.input_speed: what it counts of a batch, from which docs/data.md's padding shares
# and tokens per batch follow. Two rows: two packed pairs beside one, padding in both.
INPUT_SPEED_KNOWN_ANSWERS = {
  1: {"pairs": 3, "source_tokens": 5, "source_slots": 8, "target_tokens": 7, "target_slots": 8},
}


def test_what_input_speed_counts_matches_the_known_answer_of_its_version():
  import numpy as np

  from transformer.tools import input_speed

  batch = {
    "source": np.array([[5, 6, 7, 0], [8, 9, 0, 0]]),
    "decoder_input": np.array([[1, 5, 6, 0], [1, 7, 8, 9]]),
    "target_segment_ids": np.array([[1, 1, 1, 0], [1, 1, 2, 2]]),
  }
  assert input_speed.count(batch) == INPUT_SPEED_KNOWN_ANSWERS[input_speed.RECORD_VERSION]


def _repo(tmp_path, records, page="Results:\n\n<!-- results:steps -->\nold\n<!-- /results -->\n"):
  """A repository with one record file, steps.jsonl, and a page showing its newest records
  per label as current figures."""
  results = tmp_path / "docs" / "results"
  results.mkdir(parents=True)
  (results / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  (tmp_path / "README.md").write_text(page)

  def steps():
    newest = doc_views.latest(
      doc_views.read_records("steps", str(results)), key=lambda r: r["label"]
    )
    rows = [(r["label"], r["ms"]) for r in newest]
    return doc_views.table(("label", "ms"), rows) + "\n\n" + doc_views.source("steps", newest)

  return {"steps": steps}


def test_a_new_record_makes_its_region_stale_until_rendered(tmp_path):
  views = _repo(tmp_path, [{"label": "base", "ms": 10, **PROVENANCE}])
  assert render_docs.render(str(tmp_path), views=views) == ["README.md"]
  assert "| base | 10 |" in (tmp_path / "README.md").read_text()
  assert render_docs.render(str(tmp_path), check=True, views=views) == []

  with open(tmp_path / "docs" / "results" / "steps.jsonl", "a") as f:
    f.write(json.dumps({"label": "base", "ms": 9, **PROVENANCE}) + "\n")
  assert render_docs.render(str(tmp_path), check=True, views=views) == ["README.md"]
  render_docs.render(str(tmp_path), views=views)
  text = (tmp_path / "README.md").read_text()
  assert "| base | 9 |" in text and "| base | 10 |" not in text  # the newer record wins
  assert text.startswith("Results:\n\n<!-- results:steps -->\n") and text.endswith(
    "<!-- /results -->\n"
  )


def test_a_record_of_an_older_version_is_named_only_where_shown_as_current(tmp_path, monkeypatch):
  producer = tmp_path / "tool.py"
  producer.write_text('"""A tool."""\n\nRECORD_VERSION = 2  # bumped: its figures changed\n')
  monkeypatch.setattr(record_sources, "REPO_ROOT", str(tmp_path))
  monkeypatch.setitem(record_sources.PRODUCERS, "steps", "tool.py")
  old, new = (
    {"label": "base", "ms": 10, "record_version": 1, **PROVENANCE},
    {"label": "big", "ms": 30, "record_version": 2, **PROVENANCE},
  )
  views = _repo(tmp_path, [old, new])
  results = str(tmp_path / "docs" / "results")
  assert record_sources.outdated(views, results) == [
    "docs/results/steps.jsonl:1 (view steps): record_version 1, tool.py is at 2: rerun and append"
  ]
  # The same record shown as dated history, labelled with its commit, is not outdated; nor
  # is a new record file no view shows yet.
  views["steps"] = lambda: doc_views.source("steps", [old], history=True)
  (tmp_path / "docs" / "results" / "no_view_yet.jsonl").write_text(json.dumps(old) + "\n")
  assert record_sources.outdated(views, results) == []
  assert "dated: each figure as of its own commit" in views["steps"]()


def test_a_shown_record_file_without_a_producer_is_named(tmp_path):
  views = _repo(tmp_path, [{"label": "base", "ms": 10, "record_version": 1, **PROVENANCE}])
  with pytest.raises(doc_views.RecordError, match="steps.jsonl has no producer in PRODUCERS"):
    record_sources.outdated(views, str(tmp_path / "docs" / "results"))


def test_a_region_in_an_indented_docstring_keeps_its_indent():
  text = '  """Doc.\n\n  <!-- results:one -->\n  <!-- /results -->\n  """\n'
  rendered = render_docs.render_text(text, {"one": lambda: "line 1\n\nline 2"})
  assert rendered == (
    '  """Doc.\n\n  <!-- results:one -->\n  line 1\n\n  line 2\n  <!-- /results -->\n  """\n'
  )


def test_an_unknown_view_is_named():
  with pytest.raises(doc_views.RecordError, match="README.md: unknown view 'nope'"):
    render_docs.render_text("<!-- results:nope -->\n<!-- /results -->\n", {}, "README.md")


def test_a_record_without_provenance_is_named_with_its_line(tmp_path):
  record = dict(PROVENANCE)
  del record["commit"]
  (tmp_path / "steps.jsonl").write_text(json.dumps(PROVENANCE) + "\n" + json.dumps(record) + "\n")
  with pytest.raises(doc_views.RecordError, match=r"steps.jsonl:2: the record has no commit"):
    doc_views.read_records("steps", str(tmp_path))


def test_record_appends_what_a_command_prints_with_its_version_and_provenance(tmp_path):
  out = tmp_path / "memory.jsonl"  # a record file of tools.memory's
  program = 'print(\'compiling...\'); print(\'{"name": "train_step", "step_time_s": 0.5}\')'
  argv = ["--record", str(out), "--machine", "a test machine", "--", sys.executable, "-c", program]
  command = [sys.executable, "-m", "docs.render.render_docs", *argv]
  result = subprocess.run(command, capture_output=True, text=True, cwd=render_docs.REPO_ROOT)
  assert result.returncode == 0, result.stderr
  (record,) = [json.loads(line) for line in out.read_text().splitlines()]
  assert record["name"] == "train_step" and record["step_time_s"] == 0.5
  assert record["record_version"] == record_sources.producer_version("memory")
  assert record["machine"] == "a test machine"
  assert record["command"] == f"{sys.executable} -c {program}"
  assert len(record["date"]) == 10 and record["commit"]


def test_record_from_json_lines_a_script_wrote(tmp_path):
  written = tmp_path / "cpu.jsonl"
  written.write_text(
    '{"name": "peak"}\n{"name": "train_step", "label": "base"}\n'
    '{"name": "input_pipeline", "command": "input_speed --json"}\n'
  )
  out = tmp_path / "records.jsonl"
  argv = ["--record", str(out), "--from_json", str(written), "--command", "bash bench/cpu.sh"]
  assert render_docs.main(argv + ["--machine", "m"]) == 0
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["name"] for r in records] == ["peak", "train_step", "input_pipeline"]
  # The script's command, except where a row names its own.
  assert [r["command"] for r in records] == ["bash bench/cpu.sh"] * 2 + ["input_speed --json"]


def test_a_make_train_workdir_becomes_the_record_readme_renders(tmp_path, monkeypatch):
  workdir = tmp_path / "run"
  (workdir / "eval").mkdir(parents=True)
  window = {"kind": "train", "steps_per_sec": 2.0, "mfu": 0.5, "hfu": 0.55}
  metrics = (
    {**window, "step": 1, "tokens_per_sec": 1000.0, "elapsed_s": 30.0},
    {**window, "step": 2, "tokens_per_sec": 3000.0, "elapsed_s": 61.0},
    {"kind": "validation", "step": 2, "ppl": 12.5},
  )
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
  scores = {"split": "test", "step": 2, "num_sentences": 40, "beam_size": 4, "alpha": 0.6}
  scores |= {"bleu": 12.3, "bleu_tok": 12.9, "chrf": 40.0, "ppl": 13.0}
  scores |= {"bleu_signature": "nrefs:1|tok:13a", "sentences_per_sec": 8.0}
  (workdir / "eval" / "test-2.json").write_text(json.dumps(scores))
  monkeypatch.setattr(doc_views, "RESULTS_DIR", str(tmp_path))
  argv = ["--record", str(tmp_path / "make_train.jsonl"), "--from_workdir", str(workdir)]
  assert render_docs.main(argv + ["--wall_time_s", "100", "--command", "make train"]) == 0
  text = doc_views.make_train()
  for expected in (
    "1m40s, of which training 1m01s (2 steps of about 1,000 real",
    "2,000 target tokens/s (1,000 to 3,000), MFU 50.0%",
    "| test split perplexity (unsmoothed) | 13.00 |",
    "| validation perplexity, last step (unsmoothed) | 12.50 |",
    "**sacreBLEU 12.30**, tokenized BLEU 12.90",
    "8.0 sentences/s",
    "`sacreBLEU 12.30  nrefs:1|tok:13a`",
    "`make train`",
  ):
    assert expected in text


@pytest.mark.parametrize("a", [0.3, 0.67, 0.95])
def test_the_acceptance_rate_a_speed_up_needs_inverts_the_tokens_per_round(a):
  """decoding.md's speculative view: the a at which a round of k = 3 gives
  (1 - a^4) / (1 - a) tokens."""
  tokens_per_round = (1 - a**4) / (1 - a)
  assert doc_views.acceptance_for(tokens_per_round, 3) == pytest.approx(a, abs=1e-9)
