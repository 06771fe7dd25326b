"""make docs: regions rendered from result records, stale regions found, records made."""

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


def _repo(tmp_path, records, page="Results:\n\n<!-- results:steps -->\nold\n<!-- /results -->\n"):
  results = tmp_path / "docs" / "results"
  results.mkdir(parents=True)
  (results / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  (tmp_path / "README.md").write_text(page)

  def steps():
    newest = doc_views.latest(
      doc_views.read_records("steps", str(results)), key=lambda r: r["label"]
    )
    return doc_views.table(("label", "ms"), [(r["label"], r["ms"]) for r in newest])

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


def test_record_appends_what_a_command_prints_with_its_provenance(tmp_path):
  out = tmp_path / "new.jsonl"
  program = 'print(\'compiling...\'); print(\'{"name": "train_step", "step_time_s": 0.5}\')'
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "docs.render.render_docs",
      "--record",
      str(out),
      "--machine",
      "a test machine",
      "--",
      sys.executable,
      "-c",
      program,
    ],
    capture_output=True,
    text=True,
    cwd=render_docs.REPO_ROOT,
  )
  assert result.returncode == 0, result.stderr
  (record,) = [json.loads(line) for line in out.read_text().splitlines()]
  assert record["name"] == "train_step" and record["step_time_s"] == 0.5
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
  assert (
    render_docs.main(
      [
        "--record",
        str(out),
        "--from_json",
        str(written),
        "--command",
        "bash bench/cpu.sh",
        "--machine",
        "m",
      ]
    )
    == 0
  )
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["name"] for r in records] == ["peak", "train_step", "input_pipeline"]
  # The script's command, except where a row names its own.
  assert [r["command"] for r in records] == ["bash bench/cpu.sh"] * 2 + ["input_speed --json"]


def test_a_make_train_workdir_becomes_the_record_readme_renders(tmp_path, monkeypatch):
  workdir = tmp_path / "run"
  (workdir / "eval").mkdir(parents=True)
  window = {
    "kind": "train",
    "steps_per_sec": 2.0,
    "mfu": 0.5,
    "hfu": 0.55,
    "padding_efficiency": 0.9,
  }
  (workdir / "metrics.jsonl").write_text(
    "".join(
      json.dumps(r) + "\n"
      for r in (
        {**window, "step": 1, "tokens_per_sec": 1000.0, "elapsed_s": 30.0},
        {**window, "step": 2, "tokens_per_sec": 3000.0, "elapsed_s": 61.0},
        {"kind": "validation", "step": 2, "ppl": 12.5},
      )
    )
  )
  (workdir / "eval" / "test-2.json").write_text(
    json.dumps(
      {
        "split": "test",
        "step": 2,
        "num_sentences": 40,
        "beam_size": 4,
        "alpha": 0.6,
        "bleu": 12.3,
        "bleu_tok": 12.9,
        "chrf": 40.0,
        "bleu_signature": "nrefs:1|tok:13a",
        "sentences_per_sec": 8.0,
        "ppl": 13.0,
      }
    )
  )
  monkeypatch.setattr(doc_views, "RESULTS_DIR", str(tmp_path))
  assert (
    render_docs.main(
      [
        "--record",
        str(tmp_path / "make_train.jsonl"),
        "--from_workdir",
        str(workdir),
        "--wall_time_s",
        "100",
        "--command",
        "make train",
      ]
    )
    == 0
  )
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


def test_every_record_file_has_its_producing_paths_and_they_exist():
  files = {
    os.path.basename(p)[: -len(".jsonl")]
    for p in os.listdir(doc_views.RESULTS_DIR)
    if p.endswith(".jsonl")
  }
  assert set(record_sources.PRODUCERS) == files
  missing = [
    path
    for paths in record_sources.PRODUCERS.values()
    for path in paths
    if not os.path.exists(os.path.join(render_docs.REPO_ROOT, path))
  ]
  assert missing == []


def test_every_shown_record_is_as_new_as_the_code_it_measures():
  """A record the docs show was made at or after the last change to the code that
  produces it (docs/render/record_sources.py); each stale one is named in a line."""
  problems, reason = record_sources.check()
  if reason:
    pytest.skip(reason)
  stale_files = {
    line.split()[0].removeprefix("docs/results/").removesuffix(".jsonl") for line in problems
  }
  unexpected = [
    line
    for line in problems
    if line.split()[0].removeprefix("docs/results/").removesuffix(".jsonl")
    not in record_sources.AWAITING_RERUN
  ]
  assert not unexpected, "rerun these records:\n" + "\n".join(unexpected)
  fresh = sorted(set(record_sources.AWAITING_RERUN) - stale_files)
  assert not fresh, f"fresh again, drop them from AWAITING_RERUN: {fresh}"


def test_records_that_trail_the_code_are_left_out_of_the_check_and_only_they_are():
  trailing = set(record_sources.TRAILS_THE_CODE)
  assert trailing <= set(record_sources.PRODUCERS)
  assert not trailing & set(record_sources.AWAITING_RERUN)
  problems, reason = record_sources.check()
  if reason:
    pytest.skip(reason)
  named = {
    line.split()[0].removeprefix("docs/results/").removesuffix(".jsonl") for line in problems
  }
  assert not named & trailing
  # Every other stale file is still named: the awaiting ones are all stale here.
  assert set(record_sources.AWAITING_RERUN) <= named


def test_only_executable_code_counts_as_a_change():
  code = b'"""A module."""\nimport os\n\ndef f():\n  """Doc."""\n  return 1  # one\n'
  reworded = b'"""Another docstring."""\nimport os\n\n\ndef f():\n  return 1  # 1\n'
  changed = b'"""A module."""\nimport os\n\ndef f():\n  """Doc."""\n  return 2\n'
  executable = record_sources.executable
  assert executable("m.py", code) == executable("m.py", reworded)
  assert executable("m.py", code) != executable("m.py", changed)
  assert executable("cpu.sh", b"a\n") != executable("cpu.sh", b"b\n")
  assert executable("m.py", None) is None  # a file that does not exist


def test_a_record_older_than_a_code_change_is_named_with_the_commit(tmp_path):
  env = {
    **os.environ,
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
  }

  def git(*args):
    return subprocess.run(
      ["git", *args], cwd=tmp_path, env=env, check=True, capture_output=True, text=True
    ).stdout.strip()

  def commit(text, message):
    (tmp_path / "tool.py").write_text(text)
    git("add", "-A")
    git("commit", "-qm", message)
    return git("rev-parse", "--short", "HEAD")

  git("init", "-q")
  (tmp_path / "docs" / "results").mkdir(parents=True)
  measured = commit('"""Tool."""\nSTEPS = 10\n', "tool")
  record = {"name": "steps", **PROVENANCE, "commit": measured + "-dirty"}
  (tmp_path / "docs" / "results" / "steps.jsonl").write_text(json.dumps(record) + "\n")
  commit('"""The tool, reworded."""\n\nSTEPS = 10  # a comment\n', "docstring only")
  shown, producers = {"steps": [record]}, {"steps": ("tool.py",)}
  assert record_sources.stale(shown, producers, str(tmp_path)) == []
  changed = commit('"""The tool, reworded."""\n\nSTEPS = 20\n', "fewer steps")
  commit('"""The tool once more."""\n\nSTEPS = 20\n', "docstring again")
  assert record_sources.stale(shown, producers, str(tmp_path)) == [
    f"docs/results/steps.jsonl line(s) 1: commit {measured} predates {changed}, which "
    "changed tool.py: rerun and append"
  ]


def test_the_rendered_records_are_those_a_view_shows(tmp_path):
  """The newest record per label (what the view's Records line names), not the one it
  replaced; a view without a Records line shows the newest record of its file."""
  records = [
    {"label": "base", "ms": 10, **PROVENANCE},
    {"label": "base", "ms": 9, **PROVENANCE},
    {"label": "big", "ms": 30, **PROVENANCE},
  ]
  views = _repo(tmp_path, records)
  results = str(tmp_path / "docs" / "results")
  views["steps"] = lambda: doc_views.source(
    "steps", doc_views.latest(doc_views.read_records("steps", results), key=lambda r: r["label"])
  )
  views["newest"] = lambda: str(doc_views.read_records("steps", results)[-1]["ms"])
  assert record_sources.rendered_records(views) == {"steps": records[1:]}
  del views["steps"]
  assert record_sources.rendered_records(views) == {"steps": records[2:]}
