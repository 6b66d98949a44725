#!/usr/bin/env bash
# A plain install works for a newcomer: in a fresh venv with only a CPU torch and `pip install .`
# (no extras, so no Triton, transformers or pytest), tpflash imports, `tpflash-train` answers,
# the packaged configs resolve by name, the trainer runs a few steps of the demo config on 2 CPU
# ranks, and scripts/tp_example.py passes on 2 ranks. About a minute after the downloads.
# Set TPFLASH_CHECK_DIR to keep the venv and the build there (default: a temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WORK="${TPFLASH_CHECK_DIR:-$(mktemp -d)}"
mkdir -p "$WORK"
trap '[ -n "${TPFLASH_CHECK_DIR:-}" ] || rm -rf "$WORK"' EXIT

echo "[check_install] fresh venv in $WORK/venv" >&2
python3 -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
"$PY" -m pip install -q torch==2.13.0
# Install from a copy of the tree: pip builds in the source directory (build/, *.egg-info), and
# the tree being checked may be in use. Non-editable, as a user would install it.
mkdir -p "$WORK/src"
tar -C "$REPO" --exclude=./.git --exclude=./.venv --exclude=./runs --exclude=./build \
    --exclude='*.egg-info' --exclude='__pycache__' -cf - . | tar -C "$WORK/src" -xf -
"$PY" -m pip install -q "$WORK/src"

# Outside the tree, so that `import tpflash` finds the installed package and not ./tpflash.
cd "$WORK"
export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""
"$PY" - <<'PY'
import importlib.util
import torch
import tpflash
assert "site-packages" in tpflash.__file__, tpflash.__file__
has_triton = importlib.util.find_spec("triton") is not None
# a CPU torch brings no Triton, and tpflash must not have asked for it (CUDA torch builds bring it)
assert torch.version.cuda or not has_triton, "the plain install pulled in Triton"
print(f"[check_install] import tpflash: ok ({tpflash.__file__}; triton {'present' if has_triton else 'absent'})")
PY
"$WORK/venv/bin/tpflash-train" --help | head -1
"$WORK/venv/bin/tpflash-train" --config demo --print-config > /dev/null
echo "[check_install] tpflash-train --help and --config demo: ok" >&2
"$WORK/venv/bin/torchrun" --standalone --nproc_per_node=2 -m tpflash.train --config demo \
    --train.steps=2 --data.max_bytes=200000 --train.eval_interval=0 --log.sample_tokens=0 \
    --checkpoint.dir="$WORK/run/ckpt" --log.dir="$WORK/run" --log.progress=lines
echo "[check_install] the trainer (demo config, tp=2, 2 steps): ok" >&2
"$WORK/venv/bin/torchrun" --standalone --nproc_per_node=2 "$REPO/scripts/tp_example.py"
echo "[check_install] scripts/tp_example.py on 2 ranks: ok" >&2
