# Sourced by scripts/*.sh: make and activate .venv with torch and tpflash installed.
# torch==2.13.0 is installed only where no torch is importable (a bare `pip install torch`
# would pull a multi-GB CUDA build on a CPU machine).
if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -x .venv/bin/python ]; then
    echo "[tpflash] creating .venv" >&2
    python3 -m venv .venv
  fi
  source .venv/bin/activate
fi
if ! python -c "import torch" 2>/dev/null; then
  echo "[tpflash] installing torch==2.13.0 (CPU)" >&2
  python -m pip install -q torch==2.13.0
fi
if ! python -c "import tpflash, pytest, triton, yaml, transformers, safetensors" 2>/dev/null; then
  echo "[tpflash] installing tpflash[test] (editable)" >&2
  python -m pip install -q -e ".[test]"
fi
