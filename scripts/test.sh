#!/usr/bin/env bash
# Run the test suite on this machine (CPU: gloo ranks, Triton in interpreter mode).
# Creates/uses .venv, installs torch==2.13.0 only where no torch is importable, then the
# package with its test extra, then runs pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
python -m pytest tests -q -p no:cacheprovider "$@"
