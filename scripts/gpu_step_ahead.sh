#!/usr/bin/env bash
# One GPU (nvidia-h100-x1): does letting the host issue a step while the GPU still runs the one
# before help the eager step? Run from the repo root with the old tree at $OLD (gpu_ab.sh says how).
#   1. the trainer (python -m tpflash.train), gpt-1.3b at tp=1, 4 x 2048 tokens per step: the old
#      tree (a host sync per step) and this one (none), eager; then this one with cuda_graphs=on;
#      each run's tokens/s per 10 steps (steps 1-10 hold compilation and warm-up)
#   2. bench_e2e's tp=1 table, whose rows now also give the ms per step one step ahead
# Output under $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
OLD=${OLD:?set OLD to the old tree}
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

trainer() { bash scripts/gpu_trainer.sh "$@"; }  # tree tag extra-args...
echo "== 1/2 trainer, gpt-1.3b tp=1 =="
trainer "$OLD" old-eager
trainer . new-eager
trainer . new-graphs --cuda_graphs=on

echo "== 2/2 bench_e2e tp=1 =="
timeout 270 python3 scripts/bench_e2e.py --tp 1 --models gpt-1.3b --steps 10 --warmup 3 --no-comm-probe \
  --impls tpflash-graphs,plain-compile,tpflash,plain --results "$OUT/table.jsonl" 2>&1 | grep -v "^\[bench_e2e\]   "

echo "== again, if time is left: trainer old and new, eager =="
trainer "$OLD" old-eager-2
trainer . new-eager-2
