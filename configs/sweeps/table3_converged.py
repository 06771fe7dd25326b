"""Table 3's ablations trained to convergence on the bundled Tatoeba corpus, with seeds.

    nice python -m transformer.sweeps --sweep configs/sweeps/table3_converged.py \
        --workdir workdirs/table3_converged --records docs/results/table3_converged.jsonl
    python -m transformer.sweeps --sweep configs/sweeps/table3_converged.py \
        --records docs/results/table3_converged.jsonl --collect --output_dir docs/results

Where `table3_small.py` is the quick smoke sweep (300 steps, a fifth of an epoch, not
converged), every row here trains many epochs of the training split's 1.29M target tokens
(1,350 steps of about 1,000 a step make an epoch), evaluating validation perplexity once
an epoch. The learning rate depends only on the step (the paper's schedule, no decay to a
final step), so the step count can be raised and every row resumed from its last
checkpoint.

The scale comes from pilots of base and D1, trained until base's validation perplexity
improves by less than 1% over two epochs, within about 12 hours of a 2-core CPU for the
whole study (21 runs). At half the embedded default's width (d_model 128) base still
improved 2% an epoch after 12 epochs, and would need about 20
(docs/notes/table3-converged-pilot.md), so the model here is a quarter of the default's
width: 3+3 layers, d_model 64, d_ff 256, 4 heads of 16, the paper's P_drop 0.1 and label
smoothing 0.1. Each row makes the paper's change relative to that, as `table3_small.py`
does to the default: h * d_k stays d_model in (A), d_k shrinks to a quarter in (B), 2 of
6 layers become 1 of 3, and widths halve. NUM_EPOCHS is the pilot's at this width: base
seed 0 improved 3.0% in its tenth epoch and 1.0% in its eleventh (5.27 to 5.22), and a fit
of a + b * epoch^-c to epochs 3-10 puts one epoch's gain under 1.1% from the sixteenth
(docs/notes/table3-converged-pilot.md). Sixteen epochs for 21 runs is about 12 hours here.

Each (row, seed) ends with eval.py on the whole validation split: beam 4, alpha 0.6, the
average of the last five checkpoints (one every 135 steps, the last half epoch), as the
paper averages its last checkpoints. Base and the rows whose paper effect is small (D3,
E) run three seeds, the others two; `--collect` gives each row's mean, an interval, its
change against base at the same seed and a paired bootstrap of BLEU against base.
"""

import os

from transformer.sweeps import Row
from transformer.sweeps.spec import load_sweep

BASE_CONFIG = "configs/default.py"
STEPS_PER_EPOCH = 1350  # 1.29M target tokens of the training split / about 1,000 a step
NUM_EPOCHS = 16
BASE_OVERRIDES = {
  "model.d_model": 64,
  "model.d_ff": 256,
  "model.d_k": 16,
  "model.d_v": 16,
  "model.dropout_rate": 0.1,  # the paper's base P_drop, so that D1 changes something
  "num_train_steps": NUM_EPOCHS * STEPS_PER_EPOCH,
  "eval_every_steps": STEPS_PER_EPOCH,  # validation perplexity once an epoch
  "eval_bleu_sentences": 0,  # BLEU is eval.py's, of the whole split, at the end
  "checkpoint_every_steps": STEPS_PER_EPOCH // 10,
  "keep_checkpoints": 5,
}
# eval.py averages the last five checkpoints, as the paper does.
AVERAGE_LAST = 5

_HEADS = ("model.num_heads", "model.d_k", "model.d_v")

# Row name: (overrides at this scale, seeds). The paper's numbers come from table3.py.
_SCALED = {
  "base": ({}, (0, 1, 2)),
  "A1": (dict(zip(_HEADS, (1, 64, 64))), (0, 1)),
  "B1": ({"model.d_k": 4}, (0, 1)),
  "C1": ({"model.num_layers": 1}, (0, 1)),
  "C4": ({"model.d_model": 32, "model.d_k": 8, "model.d_v": 8}, (0, 1)),
  "C6": ({"model.d_ff": 128}, (0, 1)),
  "D1": ({"model.dropout_rate": 0.0}, (0, 1)),
  "D3": ({"label_smoothing": 0.0}, (0, 1, 2)),
  "E": ({"model.positional": "learned"}, (0, 1, 2)),
}


def get_sweep():
  paper = {
    row.name: row for row in load_sweep(os.path.join(os.path.dirname(__file__), "table3.py")).rows
  }
  return [
    Row(
      name,
      overrides,
      paper[name].paper_ppl,
      paper[name].paper_bleu,
      paper[name].paper_params_m,
      seeds=seeds,
    )
    for name, (overrides, seeds) in _SCALED.items()
  ]
