"""Table 3 of the paper (En-De ablations) as a sweep on `configs/wmt14.py:base`.

    python -m transformer.sweeps --sweep configs/sweeps/table3.py --workdir W --dry_run
    python -m transformer.sweeps --sweep configs/sweeps/table3.py --workdir gs://B/t3 \
        --launch tpu --compile_check v5e-32 --tpu_name NAME --tpu_zone ZONE \
        --config.data_dir=gs://B/tfds  # or --launch slurm
    python -m transformer.sweeps --sweep configs/sweeps/table3.py --workdir W --collect

Each row lists only what differs from base, as the paper's table does, with the paper's
dev (newstest2013) perplexity, BLEU and parameters in millions. The paper's numbers are
per-wordpiece perplexity and BLEU of the last checkpoint, without averaging; base and
every ablation train 100K steps, big 300K. docs/reproduce.md has the commands and costs.
"""

from transformer.sweeps import Row

BASE_CONFIG = "configs/wmt14.py:base"

_HEADS = ("model.num_heads", "model.d_k", "model.d_v")


def get_sweep():
  # One row per line, as in the paper's table.
  # fmt: off
  return [
      Row("base", {}, paper_ppl=4.92, paper_bleu=25.8, paper_params_m=65),
      # (A) heads: h * d_k = d_model, so computation stays about the same.
      Row("A1", dict(zip(_HEADS, (1, 512, 512))), paper_ppl=5.29, paper_bleu=24.9),
      Row("A2", dict(zip(_HEADS, (4, 128, 128))), paper_ppl=5.00, paper_bleu=25.5),
      Row("A3", dict(zip(_HEADS, (16, 32, 32))), paper_ppl=4.91, paper_bleu=25.8),
      Row("A4", dict(zip(_HEADS, (32, 16, 16))), paper_ppl=5.01, paper_bleu=25.4),
      # (B) smaller attention keys only.
      Row("B1", {"model.d_k": 16}, paper_ppl=5.16, paper_bleu=25.1, paper_params_m=58),
      Row("B2", {"model.d_k": 32}, paper_ppl=5.01, paper_bleu=25.4, paper_params_m=60),
      # (C) model size. In C4 and C5 h stays 8.
      Row("C1", {"model.num_layers": 2}, paper_ppl=6.11, paper_bleu=23.7, paper_params_m=36),
      Row("C2", {"model.num_layers": 4}, paper_ppl=5.19, paper_bleu=25.3, paper_params_m=50),
      Row("C3", {"model.num_layers": 8}, paper_ppl=4.88, paper_bleu=25.5, paper_params_m=80),
      Row("C4", {"model.d_model": 256, "model.d_k": 32, "model.d_v": 32},
          paper_ppl=5.75, paper_bleu=24.5, paper_params_m=28),
      Row("C5", {"model.d_model": 1024, "model.d_k": 128, "model.d_v": 128},
          paper_ppl=4.66, paper_bleu=26.0, paper_params_m=168),
      Row("C6", {"model.d_ff": 1024}, paper_ppl=5.12, paper_bleu=25.4, paper_params_m=53),
      Row("C7", {"model.d_ff": 4096}, paper_ppl=4.75, paper_bleu=26.2, paper_params_m=90),
      # (D) regularization.
      Row("D1", {"model.dropout_rate": 0.0}, paper_ppl=5.77, paper_bleu=24.6),
      Row("D2", {"model.dropout_rate": 0.2}, paper_ppl=4.95, paper_bleu=25.5),
      Row("D3", {"label_smoothing": 0.0}, paper_ppl=4.67, paper_bleu=25.3),
      Row("D4", {"label_smoothing": 0.2}, paper_ppl=5.47, paper_bleu=25.7),
      # (E) learned positional embeddings instead of sinusoids.
      Row("E", {"model.positional": "learned"}, paper_ppl=4.92, paper_bleu=25.7),
      # big: the paper's big model, 300K steps (configs/wmt14.py:big).
      Row("big", {"model.d_model": 1024, "model.d_ff": 4096, "model.num_heads": 16,
                  "model.dropout_rate": 0.3, "num_train_steps": 300_000},
          paper_ppl=4.33, paper_bleu=26.4, paper_params_m=213),
  ]
  # fmt: on
