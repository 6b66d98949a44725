#!/usr/bin/env bash
# FP8 accuracy: benchmarks/fp8_accuracy.yaml (a llama-1b-shaped model on one GPU) trained with bf16
# GEMMs and with each fp8 recipe, same init and data; each run's metrics.jsonl lands in $OUT/<mode>/.
#   OUT=/tmp/fp8acc bash benchmarks/fp8_accuracy.sh [--key=value trainer overrides ...]
#   python benchmarks/fp8_accuracy_plot.py /tmp/fp8acc --png fp8_accuracy.png   # table + curves
# MODES (default "off rowwise tensorwise") selects the runs; overrides apply to every run (e.g. a
# smaller model: --model.n_layer=4 --model.n_embd=256 ...). Each run's full log: $OUT/<mode>/log.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tpflash-fp8-accuracy}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=$(command -v python3 || command -v python)
for mode in ${MODES:-off rowwise tensorwise}; do
  mkdir -p "$OUT/$mode"
  rm -f "$OUT/$mode/metrics.jsonl"  # the trainer appends; one run per directory
  echo "== fp8=$mode ==" >&2
  "$PY" -m tpflash.train --config benchmarks/fp8_accuracy.yaml --model.fp8="$mode" --log.dir="$OUT/$mode" "$@" \
      > "$OUT/$mode/log.txt" 2>&1
  echo "exit $?" >> "$OUT/$mode/log.txt"
  grep -E "^layout|\[eval\]|tokens/s per GPU|^error|Error|^exit" "$OUT/$mode/log.txt" >&2
done
