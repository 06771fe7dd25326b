"""Table 3's ablations scaled to the embedded Tatoeba default (`configs/default.py`).

    python -m transformer.sweeps --sweep configs/sweeps/table3_small.py \
        --workdir workdirs/table3_small --only base,A1,A4,C1,D1,D3,E --nofinal_eval
    python -m transformer.sweeps --sweep configs/sweeps/table3_small.py \
        --workdir workdirs/table3_small --collect --output_dir docs/results

The default is half the paper's base in every dimension (3 layers, d_model 256, d_ff
1024, 4 heads of 64), so each row makes the same change relative to it: h * d_k stays
d_model in (A), layer counts 2/4/8 of 6 become 1/2/4 of 3, and widths halve or double
as in the paper. Unlike the default, base keeps the paper's P_drop = 0.1, so that rows
D1 and D2 change something. Each row trains 300 steps of about 1,000 target tokens, a
third of what `make train` trains; docs/reproduce.md has the results.
The numbers beside each row are the paper's, on WMT14 at full scale: compare the
direction and rough size of each change, not the values.

<!-- results:table3_small_expected -->
Expected, as validation perplexity and BLEU (first 500 validation sentences) at the last
step: base 52.88 and 2.89; A1 76.20 and 1.35; A4 47.19 and 3.37; C1 36.58 and 8.83; D1
39.13 and 8.69; D3 51.76 and 3.04; E 42.88 and 6.91 (2026-12-03, commit 8fc668d;
docs/results/table3_small.jsonl).
<!-- /results -->
"""

import os

from transformer.sweeps import Row
from transformer.sweeps.spec import load_sweep

BASE_CONFIG = "configs/default.py"
BASE_OVERRIDES = {
  "num_train_steps": 300,
  "warmup_steps": 150,  # half the run, as the default's 300 of 1,000 is about a third
  "model.dropout_rate": 0.1,  # the paper's base P_drop, so row D1 (0.0) differs
  "eval_every_steps": 300,  # one validation evaluation, at the end
  # BLEU of the first 500 validation sentences, beam-searched by the training run at
  # its last step. After 300 steps many hypotheses run to the length limit, and a
  # beam search of all 2,000 sentences (eval.py) would cost more than the training.
  "eval_bleu_sentences": 500,
  "checkpoint_every_steps": 100,
}

_HEADS = ("model.num_heads", "model.d_k", "model.d_v")

# Paper-scale overrides are replaced by these; the paper's numbers come from table3.py.
_SCALED = {
  "base": {},
  "A1": dict(zip(_HEADS, (1, 256, 256))),
  "A2": dict(zip(_HEADS, (2, 128, 128))),
  "A3": dict(zip(_HEADS, (8, 32, 32))),
  "A4": dict(zip(_HEADS, (16, 16, 16))),
  "B1": {"model.d_k": 16},
  "B2": {"model.d_k": 32},
  "C1": {"model.num_layers": 1},
  "C2": {"model.num_layers": 2},
  "C3": {"model.num_layers": 4},
  "C4": {"model.d_model": 128, "model.d_k": 32, "model.d_v": 32},
  "C5": {"model.d_model": 512, "model.d_k": 128, "model.d_v": 128},
  "C6": {"model.d_ff": 512},
  "C7": {"model.d_ff": 2048},
  "D1": {"model.dropout_rate": 0.0},
  "D2": {"model.dropout_rate": 0.2},
  "D3": {"label_smoothing": 0.0},
  "D4": {"label_smoothing": 0.2},
  "E": {"model.positional": "learned"},
  "big": {
    "model.d_model": 512,
    "model.d_ff": 2048,
    "model.num_heads": 8,
    "model.dropout_rate": 0.3,
    "num_train_steps": 900,
  },
}


def get_sweep():
  paper = load_sweep(os.path.join(os.path.dirname(__file__), "table3.py")).rows
  return [
    Row(row.name, _SCALED[row.name], row.paper_ppl, row.paper_bleu, row.paper_params_m)
    for row in paper
  ]
