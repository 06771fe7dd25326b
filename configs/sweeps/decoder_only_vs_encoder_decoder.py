"""Encoder-decoder against decoder-only at the same parameter count, on the embedded default.

    python -m transformer.sweeps --sweep configs/sweeps/decoder_only_vs_encoder_decoder.py \
        --workdir workdirs/decoder_only_vs_encoder_decoder
    python -m transformer.sweeps --sweep configs/sweeps/decoder_only_vs_encoder_decoder.py \
        --workdir workdirs/decoder_only_vs_encoder_decoder --collect --output_dir docs/results

Both rows are `configs/default.py` (Tatoeba en-es, 8,000 shared BPE pieces, d_model 256,
d_ff 1024, 4 heads, tied embeddings) at the CPU scale of BASE_OVERRIDES below (300 steps):
only the architecture differs. docs/reproduce.md has the results.

<!-- results:decoder_only_vs_encoder_decoder_expected -->
Expected, as validation perplexity and BLEU (first 500 validation sentences) at the last
step: encoder_decoder 39.13 and 8.69; decoder_only 63.76 and 2.68 (2026-12-03, commit
8fc668d; docs/results/decoder_only_vs_encoder_decoder.jsonl).
<!-- /results -->

  encoder_decoder  the default: 3 encoder + 3 decoder layers, 7,568,384 parameters.
  decoder_only     one stack of 7 layers reading source + EOS + target + EOS, the loss on
                   the target only (config.lm_loss = "target", a prefix LM): 7,569,152
                   parameters (+0.01%).

Counted with `state.setup(config).num_params` (tests/test_training_draft_and_lm_loss.py
checks they stay within 10%). The 2,048,000 embedding parameters are common; of the rest,
an encoder layer and a decoder-only layer each hold self-attention and a feed-forward
block (788,736 parameters), a decoder layer cross-attention as well (1,051,392), so
3 x 788,736 + 3 x 1,051,392 = 5,520,384 are matched by 7 x 788,736 = 5,521,152.

The parameters are matched, not the compute: each step sees the same pairs (a decoder-only
row holds both sides, with twice the length and token budget, transformer/data/pipeline.py),
but all 7 layers run over source and target alike. transformer/training/flops.py counts
about 2.0x the training FLOPs per pair (a 13 + 13 token pair: 1.19 against 0.59 GFLOP), so
expect the decoder_only row to take about twice as long. A third row with
`"lm_loss": "sequence"` as well would score the source side too.
"""

from transformer.sweeps import Row

BASE_CONFIG = "configs/default.py"
# CPU scale, as table3_small.py: 300 steps (about 2 minutes for the encoder-decoder on
# 2 cores, twice that for the decoder-only row), validated once at the end, with the BLEU
# of the first 500 validation sentences beam-searched by the run itself.
BASE_OVERRIDES = {
  "num_train_steps": 300,
  "warmup_steps": 150,
  "eval_every_steps": 300,
  "eval_bleu_sentences": 500,
  "checkpoint_every_steps": 100,
}


def get_sweep():
  return [
    Row("encoder_decoder", {}),
    Row("decoder_only", {"model.decoder_only": True, "model.num_layers": 7}),
  ]
