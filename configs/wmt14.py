"""The paper's WMT14 models: `--config configs/wmt14.py:ARG`.

ARG is `base` or `big`, optionally with `,en-de` (default) or `,en-fr`:

    python train.py --config configs/wmt14.py:base,en-de --workdir gs://BUCKET/base-ende
    python eval.py  --config configs/wmt14.py:base,en-de --workdir gs://BUCKET/base-ende \
        --split test --average_last 5

Hyperparameters are the paper's (Vaswani et al. 2017, "Attention Is All You Need",
arXiv:1706.03762, sections 5 and 6): Adam(0.9, 0.98, 1e-9), warmup 4000, label smoothing
0.1, about 25,000 source and 25,000 target tokens per step, beam 4, alpha 0.6; base trains
100K steps, big 300K. Expected newstest2014 BLEU after averaging the last 5 (base) or 20
(big) checkpoints, the paper's Table 2 (tokenized, compound-split, the paper's protocol):
base 27.3 / 38.1, big 28.4 / 41.8 (En-De / En-Fr). This project has not trained them yet;
docs/reproduce.md has the commands, the protocol and the cost.
"""

from transformer import config as config_lib

_DATASETS = {
  "en-de": ("wmt14_translate/de-en", 37000),  # shared BPE, about 37k tokens
  "en-fr": ("wmt14_translate/fr-en", 32000),  # 32k word pieces
}


def get_config(arg="base,en-de"):
  parts = [p.strip() for p in (arg or "base").split(",")]
  size = parts[0]
  direction = parts[1] if len(parts) > 1 else "en-de"
  if size not in ("base", "big") or direction not in _DATASETS or len(parts) > 2:
    raise ValueError(f"configs/wmt14.py: argument {arg!r} must be base|big[,en-de|,en-fr]")

  c = config_lib.base_config()
  c.dataset, c.vocab_size = _DATASETS[direction]
  c.direction = direction
  c.vocab_type = "bpe"
  c.max_len = 256
  c.tokens_per_batch = 25_000  # real tokens per side per update (x grad_accum_steps)
  c.eval_batch_size = 128
  c.num_train_steps = 100_000
  c.warmup_steps = 4000
  c.log_every_steps = 100
  c.eval_every_steps = 5000
  c.checkpoint_every_steps = 0  # time-based, as in the paper: every 10 minutes
  c.checkpoint_every_minutes = 10.0
  c.keep_checkpoints = 20

  m = c.model
  m.num_layers, m.d_model, m.d_ff, m.num_heads, m.d_k, m.d_v = 6, 512, 2048, 8, 64, 64
  m.dropout_rate = 0.1
  # The fastest measured on each platform (config.resolve_auto): on a GPU, bf16
  # activations and cuDNN's flash attention; on TPU (and CPU), float32 and einsum.
  m.dtype = "auto"
  m.attention_kernel = "auto"
  # Each layer compiled on its own (not scanned), saving its activations for the backward
  # pass (no recomputation). On a v5e-8 the TPU compiler's per-op profile puts base's step
  # at 17.7 ms this way against 23.6 ms scanned and recomputed (docs/performance.md,
  # "Changes to the step"): a scanned stack that saves its activations keeps them in
  # stacked buffers the compiler zero-fills before the loop, so the scanned form had to
  # recompute, and recomputing repeats a third of the layers' matmuls. The costs are
  # memory (base's step takes 2.6 GiB of a v5e chip's 16, big's 5.9) and a compile that
  # grows with N. For much deeper stacks, `model.scan_layers=true` with
  # `model.remat=full` keeps compile time flat in N.
  m.scan_layers = False
  m.remat = "none"
  # Dropout masks from XLA's RngBitGenerator rather than threefry: on TPU threefry's
  # hashing runs on the vector units inside the fusions that apply the masks, and the
  # per-op profile puts base's step 5% faster with rbg (docs/performance.md). Its bits
  # differ from threefry's, and each device draws its own part of a mask
  # (model/primitives.py: keep_mask), so they differ between meshes; a run is as
  # deterministic as before on the same mesh.
  c.dropout_rng_impl = "rbg"
  # Adam's moments and the update split over the data axis (ZeRO stage 1): on a v5e-8
  # the per-op profile puts base's step 4% faster (each chip updates an eighth of the
  # parameters, then gathers them) and its state per chip from 3x the parameters to
  # 1.25x (docs/performance.md). The same arithmetic, summed in another order.
  c.shard_optimizer_state = True
  # The pre-softmax projection and the loss fused, the whole target length as one chunk
  # (model/loss.py: fused_cross_entropy_sums): the softmax's denominator comes out of
  # the matmul that makes the hidden states' gradient, rather than a reduction over the
  # [rows, 37,000] logits. On a v5e-8 the per-op profile puts base's step 0.5 ms faster
  # (docs/performance.md). Equal to the unfused loss and gradients to f32 rounding.
  c.loss_chunk_len = c.max_len
  if size == "big":
    m.d_model, m.d_ff, m.num_heads = 1024, 4096, 16
    m.dropout_rate = 0.3 if direction == "en-de" else 0.1
    c.num_train_steps = 300_000
  return c
