#!/usr/bin/env bash
# FP8 accuracy: benchmarks/fp8_accuracy.yaml (a llama-1b-shaped model on one GPU) trained with bf16
# GEMMs and with each fp8 recipe, same init and data, once per seed; each run's metrics.jsonl lands in
# $OUT/seed<SEED>/<mode>/.
#   OUT=/tmp/fp8acc SEEDS="1234 4321" bash benchmarks/fp8_accuracy.sh [--key=value trainer overrides ...]
#   python benchmarks/fp8_accuracy_plot.py /tmp/fp8acc/seed* --png fp8_accuracy.png   # tables + curves
# SEEDS (default "1234 4321"): the seed sets the init and the data order. One run's fp8-vs-bf16 gap
# at 1,000 steps moved by about 5% between seeds (docs/fp8.md, "Accuracy at scale"), so judge a recipe
# on the mean over seeds. MODES (default "off rowwise tensorwise delayed") selects the runs; overrides apply to
# every run (e.g. a smaller model: --model.n_layer=4 --model.n_embd=256 ...). Each run's full log:
# $OUT/seed<SEED>/<mode>/log.txt.
# PEERS (default none; e.g. "bf16 torchao-tensorwise torchao-rowwise") adds runs of the plain-PyTorch
# Llama peer, benchmarks/fp8_accuracy_peer.py --mode <peer> (torchao's float8 needs torchao and a GPU),
# same config, init, data and overrides, into $OUT/seed<SEED>/<peer>/; the plot compares torchao's with its bf16.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tpflash-fp8-accuracy}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=$(command -v python3 || command -v python)
for seed in ${SEEDS:-1234 4321}; do
  dir=$OUT/seed$seed
  for mode in ${MODES:-off rowwise tensorwise delayed}; do
    mkdir -p "$dir/$mode"
    rm -f "$dir/$mode/metrics.jsonl"  # the trainer appends; one run per directory
    echo "== seed $seed, fp8=$mode ==" >&2
    "$PY" -m tpflash.train --config benchmarks/fp8_accuracy.yaml --seed="$seed" --model.fp8="$mode" \
        --log.dir="$dir/$mode" "$@" > "$dir/$mode/log.txt" 2>&1
    echo "exit $?" >> "$dir/$mode/log.txt"
    grep -E "^layout|\[eval\]|tokens/s per GPU|^error|Error|^exit" "$dir/$mode/log.txt" >&2
  done
  for peer in ${PEERS:-}; do
    mkdir -p "$dir/$peer"  # the peer starts its metrics.jsonl afresh
    echo "== seed $seed, peer $peer ==" >&2
    "$PY" benchmarks/fp8_accuracy_peer.py --mode "$peer" --out "$dir/$peer" --seed="$seed" "$@" \
        > "$dir/$peer/log.txt" 2>&1
    echo "exit $?" >> "$dir/$peer/log.txt"
    grep -E "^same-model|^layout|\[eval\]|tokens/s per GPU|^error|Error|^exit" "$dir/$peer/log.txt" >&2
  done
done
