"""Mixed precision against float32, on the embedded default: does bfloat16 cost accuracy?

    python -m transformer.sweeps --sweep configs/sweeps/mixed_precision.py \
        --workdir workdirs/mixed_precision
    python -m transformer.sweeps --sweep configs/sweeps/mixed_precision.py \
        --workdir workdirs/mixed_precision --collect --output_dir docs/results

Each pair of rows is `configs/default.py` at the CPU scale of BASE_OVERRIDES below (300
steps, the same seed, so the same batches and initial parameters): only `model.dtype`,
the compute dtype of activations and matmuls, differs. The second pair repeats the first
at another seed.

<!-- results:mixed_precision_expected -->
Expected, as validation perplexity and BLEU (first 500 validation sentences) at the last
step: float32 38.40 and 9.84; bfloat16 40.79 and 6.94; float32_seed1 42.87 and 7.88;
bfloat16_seed1 43.29 and 8.15 (2026-12-05, commit 2b1ee99;
docs/results/mixed_precision.jsonl).
<!-- /results -->

  float32   the default on CPU.
  bfloat16  mixed precision: bf16 activations and matmul inputs; f32 parameters, Adam
            moments, matmul sums, attention scores and softmax, logits and loss
            (docs/performance.md). The criterion: validation perplexity within 2% of
            float32's.

A CPU has no bf16 matmul units, so the bfloat16 row is slower here; the record measures
accuracy only.
"""

from transformer.sweeps import Row

BASE_CONFIG = "configs/default.py"
# The CPU scale of the other sweeps of the default (decoder_only_vs_encoder_decoder.py):
# 300 steps, validated once at the end, with the BLEU of the first 500 validation
# sentences beam-searched by the run itself.
BASE_OVERRIDES = {
  "num_train_steps": 300,
  "warmup_steps": 150,
  "eval_every_steps": 300,
  "eval_bleu_sentences": 500,
  "checkpoint_every_steps": 100,
}


def get_sweep():
  # The same pair at a second seed: how far two float32 runs of different seeds end
  # apart is the noise against which the bfloat16 gap is read.
  return [
    Row("float32", {"model.dtype": "float32"}),
    Row("bfloat16", {"model.dtype": "bfloat16"}),
    Row("float32_seed1", {"model.dtype": "float32", "seed": 1}),
    Row("bfloat16_seed1", {"model.dtype": "bfloat16", "seed": 1}),
  ]
