#!/usr/bin/env bash
# Every GPU measurement of docs/performance.md in one call; it prints how long it took.
#
#   pip install -e '.[cuda]' && bash bench/gpu.sh          # writes bench/results/gpu.jsonl
#   SMOKE=1 bash bench/gpu.sh                              # tiny sizes: checks the script on CPU
#   BUDGET_S=420 bash bench/gpu.sh                         # starts no row after 420 s
#
# Each line of gpu.jsonl is one `python -m transformer.tools.bench --json` record with a
# `label` naming the run. A run that fails or times out is logged and the rest go on.
set -uo pipefail
cd "$(dirname "$0")/.."
# The repository's environment (make install), unless PYTHON names another.
PY=${PYTHON:-.venv/bin/python}
FAILED_ROWS=0
RESULTS=${OUT:-bench/results}
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu.jsonl"
: > "$LOG"

if [ "${SMOKE:-0}" = 1 ]; then
  # One layer of width 64 and a 512-token vocabulary: the same commands, in seconds.
  SIZE="--batch_tokens=256 --seq_len=32 --steps=2 --warmup=1 --decode_batch=2 --decode_steps=40
        --config.model.num_layers=1 --config.model.d_model=64 --config.model.d_ff=128
        --config.model.num_heads=2 --config.model.d_k=32 --config.model.d_v=32
        --config.vocab_size=512"
  LIMIT=300
  TEST_PLATFORMS=cpu
else
  # The paper's batch: about 25,000 target tokens, here 96 sentences of 256 tokens.
  SIZE="--batch_tokens=24576 --seq_len=256 --steps=20 --warmup=3 --decode_batch=64
        --decode_steps=96"
  LIMIT=150
  TEST_PLATFORMS=cuda,cpu
fi

# BUDGET_S: seconds after which the rows not yet started are skipped (and logged as such),
# so that a lease of fixed length still returns every row it ran. 0: no budget.
BUDGET_S=${BUDGET_S:-0}

run() {  # run LABEL CONFIG [FLAGS...]
  local label=$1 config=$2
  shift 2
  if [ "$BUDGET_S" != 0 ] && [ "$SECONDS" -ge "$BUDGET_S" ]; then
    echo "== $label: skipped, past BUDGET_S=$BUDGET_S s" >&2
    echo "{\"name\": \"skipped\", \"label\": \"$label\"}" >> "$LOG"
    return
  fi
  echo "== $label" >&2
  # shellcheck disable=SC2086
  if ! timeout "$LIMIT" "$PY" -m transformer.tools.bench --config "$config" --json --label "$label" \
      $SIZE "$@" >> "$LOG"; then
    { echo "{\"name\": \"failed\", \"label\": \"$label\"}" >> "$LOG"; FAILED_ROWS=$((FAILED_ROWS + 1)); }
  fi
}

# First, cuDNN's attention against the einsum path on this GPU (padding, packing, the
# causal mask; forward and gradient): the kernel that `auto` picks on NVIDIA GPUs. On a
# CPU (SMOKE=1) these tests skip. Not captured (-s): a process that aborts still shows why.
echo "== cudnn tests" >&2
if ! JAX_PLATFORMS=$TEST_PLATFORMS timeout "$LIMIT" "$PY" -m pytest -q -s -p no:cacheprovider -rs \
    tests/test_model_attention_kernels.py -k cudnn >&2; then
  echo "{\"name\": \"failed\", \"label\": \"cudnn-tests\"}" >> "$LOG"
  FAILED_ROWS=$((FAILED_ROWS + 1))
fi

# The configs as they are (model.dtype and model.attention_kernel "auto": bf16 and cuDNN's
# flash attention on an NVIDIA GPU), then each choice undone: float32 (which also takes
# the einsum attention: cuDNN's is 16-bit only), bf16 with the einsum attention, and
# big without rematerialization (a GPU of 141 GB holds its activations).
run base configs/wmt14.py:base --only=train_step
run big configs/wmt14.py:big --only=train_step,beam_search
run base-f32 configs/wmt14.py:base --config.model.dtype=float32 --only=train_step
run big-f32 configs/wmt14.py:big --config.model.dtype=float32 --only=train_step
BF16_EINSUM="--config.model.dtype=bfloat16 --config.model.attention_kernel=einsum"
run base-bf16-einsum configs/wmt14.py:base $BF16_EINSUM --only=train_step
run big-bf16-einsum configs/wmt14.py:big $BF16_EINSUM --only=train_step
run big-noremat configs/wmt14.py:big --config.model.remat=none --only=train_step

"$PY" - "$LOG" <<'PY'
import json, sys
for line in open(sys.argv[1]):
  r = json.loads(line)
  if r["name"] == "failed":
    print(f"{r['label']:>16}  FAILED (see the log above)")
  elif r["name"] == "skipped":
    print(f"{r['label']:>16}  skipped (past BUDGET_S)")
  elif r["name"] == "train_step":
    mfu = f"MFU {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else ""
    print(
      f"{r['label']:>16}  {r['name']:<14} {1e3 * r['step_time_s']:>8.1f} ms "
      f"{r['tokens_per_sec']:>12,.0f} tokens/s  {mfu:<10} {r['dtype']}, {r['attention_kernel']}"
    )
  elif r["name"] != "peak":
    mfu = f"MFU {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else ""
    step = f"{1e3 * r['step_time_s']:.1f} ms" if r.get("step_time_s") is not None else ""
    tokens = f"{r['tokens_per_sec']:,.0f} tokens/s" if r.get("tokens_per_sec") else ""
    print(f"{r['label']:>16}  {r['name']:<14} {step:>11} {tokens:>18}  {mfu}")
PY
echo "bench/gpu.sh took $((SECONDS / 60))m$((SECONDS % 60))s" >&2
if [ "$FAILED_ROWS" != 0 ]; then
  echo "error: $FAILED_ROWS runs of bench/gpu.sh failed (FAILED above)" >&2
  exit 1
fi
