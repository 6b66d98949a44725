# Sourced by scripts/*.sh: make and activate .venv (unless a venv is active) with torch and tpflash.
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
# TPFLASH_PLAIN=1 (the demo): tpflash alone, the plain install without Triton, transformers or
# pytest; otherwise tpflash[test], which every other script is covered by.
if [ -n "${TPFLASH_PLAIN:-}" ]; then
  needs="tpflash, yaml" spec="." what="tpflash"
else
  needs="tpflash, pytest, triton, yaml, transformers, safetensors" spec=".[test]" what="tpflash[test]"
fi
if ! python -c "import $needs" 2>/dev/null; then
  echo "[tpflash] installing $what (editable)" >&2
  python -m pip install -q -e "$spec"
fi
