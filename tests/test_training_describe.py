"""`train.py --dry_run`: parameter counts against the paper (FLOPs: test_training_flops.py)."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.processes import subprocess_env
from transformer.config import load_config
from transformer.training import describe

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("arg,paper_params", [("base", 65e6), ("big", 213e6)])
def test_param_count_within_4_percent_of_paper(arg, paper_params):
  config = load_config(f"configs/wmt14.py:{arg}")
  assert config.vocab_size == 37000
  assert abs(describe.count_params(config) / paper_params - 1) < 0.04


def test_tied_embedding_counted_once():
  config = load_config("configs/wmt14.py:base")
  tied = describe.count_params(config)
  config.model.tie_embeddings = False
  untied = describe.count_params(config)
  assert untied - tied == 2 * config.vocab_size * config.model.d_model


def test_dry_run_prints_one_json_line():
  result = subprocess.run(
    [sys.executable, "train.py", "--config", "configs/wmt14.py:big", "--dry_run"],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
    env=subprocess_env(devices=1),
  )
  assert result.returncode == 0, result.stderr[-2000:]
  lines = [line for line in result.stdout.splitlines() if line.strip()]
  assert len(lines) == 1
  info = json.loads(lines[0])
  assert abs(info["num_params"] / 213e6 - 1) < 0.04
  assert info["flops_per_token"] > 6 * info["num_params"] * 0.9
  assert info["d_model"] == 1024 and info["num_heads"] == 16
  assert info["dataset"] == "wmt14_translate/de-en"
  assert info["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}
