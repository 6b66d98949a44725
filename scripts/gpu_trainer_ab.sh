#!/usr/bin/env bash
# One GPU (nvidia-h100-x1): the optimizer end of a step alone (scripts/bench_clipped_step.py), then
# the trainer, an older tree ($OLD; gpu_ab.sh says how to make it) against this one, alternating
# for $ROUNDS rounds (default 3) of $STEPS steps (default 60) logged every $LOG (default 20).
# Extra arguments go to both trainers. Output under $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
OLD=${OLD:?set OLD to the old tree}
export STEPS=${STEPS:-60} LOG=${LOG:-20}
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== optimizer end of a step =="
timeout 120 python3 scripts/bench_clipped_step.py
echo "== trainer, gpt-1.3b tp=1: old, new, alternating =="
for round in $(seq 1 "${ROUNDS:-3}"); do
  bash scripts/gpu_trainer.sh "$OLD" "old-$round" "$@"
  bash scripts/gpu_trainer.sh . "new-$round" "$@"
done
