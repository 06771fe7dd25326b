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
  # cuDNN needs an NVIDIA GPU: on a CPU its rows run XLA's attention through the same
  # interface (transformer/model/attention_kernels.py).
  FUSED_ATTENTION=xla
else
  # The paper's batch: about 25,000 target tokens, here 96 sentences of 256 tokens.
  SIZE="--batch_tokens=24576 --seq_len=256 --steps=20 --warmup=3 --decode_batch=64
        --decode_steps=96"
  LIMIT=150
  FUSED_ATTENTION=cudnn
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

# The rows a user needs first come first: base and big, each in float32 (the configs' default)
# and in mixed precision (bf16 activations; f32 parameters, optimizer, softmax statistics and
# loss), all with the WMT configs' scanned, rematerialized layers. Then the variants: cuDNN's
# flash attention, and no rematerialization (a GPU of 141 GB holds big's activations).
BF16=--config.model.dtype=bfloat16
run base-f32 configs/wmt14.py:base --only=train_step
run base-bf16 configs/wmt14.py:base "$BF16" --only=train_step
run big-f32 configs/wmt14.py:big --only=train_step
run big-bf16 configs/wmt14.py:big "$BF16" --only=train_step,beam_search
run big-bf16-cudnn configs/wmt14.py:big "$BF16" --config.model.attention_kernel=$FUSED_ATTENTION \
    --only=train_step
run big-bf16-noremat configs/wmt14.py:big "$BF16" --config.model.remat=none --only=train_step
run base-bf16-cudnn configs/wmt14.py:base "$BF16" --config.model.attention_kernel=$FUSED_ATTENTION \
    --only=train_step

"$PY" - "$LOG" <<'PY'
import json, sys
for line in open(sys.argv[1]):
  r = json.loads(line)
  if r["name"] == "failed":
    print(f"{r['label']:>16}  FAILED (see the log above)")
  elif r["name"] == "skipped":
    print(f"{r['label']:>16}  skipped (past BUDGET_S)")
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
