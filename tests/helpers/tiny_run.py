"""A tiny but real run for end-to-end tests: a slice of the bundled corpus as tsv:PATH
and a one-layer model, so training, resuming and evaluating take seconds."""

import gzip
import os
import socket

from transformer import config as config_lib
from transformer.data import tatoeba

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OVERRIDES = {
  "vocab_size": 256,
  "max_len": 24,
  "tokens_per_batch": 384,
  "eval_batch_size": 16,
  "shuffle_buffer_size": 1000,
  "warmup_steps": 10,
  "log_every_steps": 1,
  "eval_every_steps": 0,
  "checkpoint_every_steps": 2,
  "checkpoint_every_minutes": 0.0,
  "num_train_steps": 6,
  "model.num_layers": 1,
  "model.d_model": 32,
  "model.d_ff": 64,
  "model.num_heads": 2,
  "model.d_k": 16,
  "model.d_v": 16,
  # MFU against a fixed peak: measuring this machine's (an f32 matmul over both cores
  # for over a second) in every process would cost the suite minutes of CPU.
  "peak_flops_per_device": 5e10,
}

# The checkpoints of conftest's shared `trained_run`. Thirty steps take the model past
# the first few, where EOS and "." are about equally likely first tokens (every sentence
# ends with both) and greedy search can emit nothing: the generation tests need outputs.
TRAINED_RUN_STEPS = (15, 30)


def write_small_corpus(directory, every: int = 50) -> str:
  """Every `every`-th line of the bundled corpus as a TSV file; returns its path."""
  with gzip.open(tatoeba.CORPUS_PATH, "rt", encoding="utf-8") as f:
    lines = f.readlines()[::every]
  path = os.path.join(directory, "small.tsv")
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(lines)
  return path


def make_config(corpus, **overrides):
  """corpus = (tsv path, vocabulary cache dir); overrides use dotted keys."""
  path, vocab_dir = corpus
  config = config_lib.base_config()
  config_lib.apply_overrides(
    config, {"dataset": f"tsv:{path}", "vocab_cache_dir": vocab_dir, **OVERRIDES, **overrides}
  )
  return config


def flag_overrides(corpus, **overrides) -> list[str]:
  """The same run as `make_config` as train.py flags."""
  path, vocab_dir = corpus
  flat = {"dataset": f"tsv:{path}", "vocab_cache_dir": vocab_dir, **OVERRIDES, **overrides}
  return [f"--config.{k}={v}" for k, v in flat.items()]


def read_metrics(workdir, kind="train"):
  from transformer.training import reporting

  return reporting.read_metrics(workdir, kind=kind)


def free_port() -> int:
  """A free TCP port on localhost, for a jax.distributed coordinator."""
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]
