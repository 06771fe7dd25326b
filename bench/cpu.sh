#!/usr/bin/env bash
# The CPU measurements of docs/performance.md, one after another; it prints how long it
# took at the end. Run it on an otherwise idle machine.
#
#   bash bench/cpu.sh                 # writes bench/results/cpu.jsonl and prints a table
#
# Each line of cpu.jsonl is one `python -m transformer.tools.bench --json` record with a
# `label` naming the run.
set -uo pipefail
cd "$(dirname "$0")/.."
# The repository's environment (make install), unless PYTHON names another.
PY=${PYTHON:-.venv/bin/python}
FAILED_ROWS=0
RESULTS=${OUT:-bench/results}
mkdir -p "$RESULTS"
LOG="$RESULTS/cpu.jsonl"
: > "$LOG"

run() {  # run LABEL CONFIG [FLAGS...]
  local label=$1 config=$2
  shift 2
  echo "== $label" >&2
  "$PY" -m transformer.tools.bench --config "$config" --json --label "$label" "$@" >> "$LOG" ||
    { echo "{\"name\": \"failed\", \"label\": \"$label\"}" >> "$LOG"; FAILED_ROWS=$((FAILED_ROWS + 1)); }
}

# The training step of Transformer-base: 16 sentences of 64 source and 64 target tokens,
# f32, dropout 0.1, label smoothing 0.1, Adam; configs/wmt14.py scans its layers, so
# base is scanned and base-unscanned is the other layer mode; then one change at a time.
BASE=(configs/wmt14.py:base --batch_tokens=1024 --seq_len=64 --steps=5 --warmup=1
      --only=train_step)
run base "${BASE[@]}"
run base-unscanned "${BASE[@]}" --config.model.scan_layers=false
# glibc's allocator defaults: freed step buffers go back to the OS (transformer/host_memory.py).
TRANSFORMER_RETAIN_FREED_MEMORY=0 run base-glibc_default "${BASE[@]}"
run base-unsafe_rbg "${BASE[@]}" --config.dropout_rng_impl=unsafe_rbg
run base-attention_xla "${BASE[@]}" --config.model.attention_kernel=xla
run base-remat_full "${BASE[@]}" --config.model.remat=full

# Cached beam search of Transformer-base (beam 4, alpha 0.6, early stopping off): 16
# random sentences of 32 source tokens, 64 output tokens each, in both layer modes.
BEAM=(configs/wmt14.py:base --only=beam_search --decode_batch=16 --decode_source_len=32
      --decode_steps=64)
run beam-base "${BEAM[@]}"
run beam-base-unscanned "${BEAM[@]}" --config.model.scan_layers=false

# Compile time against depth, with and without scan (a small batch: compile dominates).
for layers in 2 12; do
  for scan in false true; do
    run "compile-N$layers-scan_$scan" configs/wmt14.py:base --batch_tokens=256 --seq_len=64 \
        --steps=1 --warmup=0 --only=train_step --config.model.num_layers=$layers \
        --config.model.scan_layers=$scan
  done
done

# Transformer-big on CPU with a small batch, and the embedded default end to end.
run big configs/wmt14.py:big --batch_tokens=256 --seq_len=64 --steps=3 --warmup=1 \
    --only=train_step
run default configs/default.py --steps=5 --warmup=1
# The step `make train` runs: the default's packed batches hold 17 rows of 64 (its
# tokens_per_batch of 1,024 counts real tokens, docs/data.md).
run default-train-shape configs/default.py --batch_tokens=1088 --steps=20 --warmup=2 \
    --only=train_step
# train.py's loop against the bare step on the same batches (bare, loop, bare), with
# freed host memory kept and with glibc's defaults.
run default-train_loop configs/default.py --only=train_loop
TRANSFORMER_RETAIN_FREED_MEMORY=0 run default-train_loop-glibc_default configs/default.py \
    --only=train_loop

"$PY" - "$LOG" <<'PY'
import json, sys
for line in open(sys.argv[1]):
  r = json.loads(line)
  if r["name"] == "failed":
    print(f"{r['label']:>22}  FAILED (see the log above)")
  elif r["name"] == "peak":
    print(f"{r['label']:>22}  peak {r['peak_flops_per_sec'] / 1e9:,.1f} GFLOP/s")
  else:
    parts = [r["name"]]
    if r.get("compile_s") is not None:
      parts.append(f"compile {r['compile_s']:.1f} s")
    if r.get("step_time_s") is not None:
      parts.append(f"{1e3 * r['step_time_s']:,.0f} ms")
    if r.get("tokens_per_sec"):
      parts.append(f"{r['tokens_per_sec']:,.0f} tokens/s")
    if r.get("host_page_faults_per_step") is not None:
      parts.append(f"{r['host_page_faults_per_step']:,.0f} page faults/step")
    if r.get("sentences_per_sec"):
      parts.append(f"{r['sentences_per_sec']:,.2f} sentences/s")
    if r.get("mfu") is not None:
      parts.append(f"MFU {100 * r['mfu']:.1f}%")
    if r.get("efficiency") is not None:
      parts.append(f"loop {r['loop_steps_per_sec']:.2f} against bare "
                   f"{r['bare_steps_per_sec']:.2f} steps/s ({100 * r['efficiency']:.0f}%)")
    print(f"{r['label']:>22}  " + ", ".join(parts))
PY
echo "bench/cpu.sh took $((SECONDS / 60))m$((SECONDS % 60))s" >&2
if [ "$FAILED_ROWS" != 0 ]; then
  echo "error: $FAILED_ROWS runs of bench/cpu.sh failed (FAILED above)" >&2
  exit 1
fi
