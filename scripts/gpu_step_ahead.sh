#!/usr/bin/env bash
# One GPU (nvidia-h100-x1): does letting the host issue a step while the GPU still runs the one
# before help the eager step? Run from the repo root with the old tree at $OLD (gpu_ab.sh says how).
#   1. the trainer (python -m tpflash.train), gpt-1.3b at tp=1, 4 x 2048 tokens per step: the old
#      tree (a host sync per step) and this one (none), eager; then this one with cuda_graphs=on;
#      each run's tokens/s at steps 20-40 (the first 20 hold compilation and warm-up)
#   2. bench_e2e's tp=1 table, whose rows now also give the ms per step one step ahead
# Output under $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
OLD=${OLD:?set OLD to the old tree}
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

trainer() {  # tree tag extra-args...
  local tree=$1 tag=$2; shift 2
  PYTHONPATH=$tree timeout 100 python3 -m tpflash.train --config configs/gpt-1.3b.yaml --tp=1 \
    --data.path=@stdlib --data.include='*.py' --data.format=text --data.tokenizer=byte --data.max_bytes=20000000 \
    --model.vocab_size=50304 --train.batch_size=4 --train.micro_batch_size=4 --train.warmup_steps=5 \
    --train.steps=40 --train.eval_interval=1000 --train.eval_batches=1 --checkpoint.dir= --log.interval=10 \
    --log.progress=lines --log.dir="$OUT/run_$tag" "$@" 2>&1 | grep -E "^layout|^\[train\]|Error|error" | sed "s/^/$tag /"
}
echo "== 1/2 trainer, gpt-1.3b tp=1 =="
(cd "$OLD" && trainer "$OLD" old-eager)
trainer . new-eager
trainer . new-graphs --cuda_graphs=on

echo "== 2/2 bench_e2e tp=1 =="
timeout 270 python3 scripts/bench_e2e.py --tp 1 --models gpt-1.3b --steps 10 --warmup 3 --no-comm-probe \
  --impls tpflash-graphs,plain-compile,tpflash,plain --results "$OUT/table.jsonl" 2>&1 | grep -v "^\[bench_e2e\]   "

echo "== again, if time is left: trainer old and new, eager =="
(cd "$OLD" && trainer "$OLD" old-eager-2)
trainer . new-eager-2
