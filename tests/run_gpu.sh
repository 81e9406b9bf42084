#!/usr/bin/env bash
# The GPU check behind README "GPU and CUDA graphs": tests/test_gpu_cuda_graphs.py on a
# CUDA GPU (inductor and mode="reduce-overhead", a C++ extension built against the
# CUDA build of torch and a Python function, saved values changing every step).
#
#   bash tests/run_gpu.sh [PYTHON]
#
# PYTHON: an interpreter whose torch is a CUDA build of a supported release (tested
# plan: torch 2.14.1, `pip install torch==2.14.1 -e '.[test]'` in .venv-torch2.14);
# default .venv-torch2.14/bin/python, else python3. Needs pytest, numpy, hypothesis,
# g++ and ninja; installs nothing (GPU machines may have no network): the plugin is
# imported from src/. Writes gpu-log.txt and gpu-report.json to $OUT (or ./gpu-out).
# Exit status: pytest's, or 2 when this machine cannot run the check (and why).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${1:-}
if [ -z "$PY" ]; then
  if [ -x .venv-torch2.14/bin/python ]; then PY=.venv-torch2.14/bin/python; else PY=python3; fi
fi
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# Preflight: say exactly what is missing instead of 6 skipped tests.
PYTHONPATH="$PYTHONPATH" "$PY" - <<'EOF' 2>&1 | tee "$out/gpu-log.txt"
import sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA build {torch.version.cuda}")
if not torch.cuda.is_available():
    sys.exit("run_gpu.sh: torch sees no CUDA device; nothing to check here")
print(f"device: {torch.cuda.get_device_name()}")
try:
    import ca_dynsaved  # noqa: F401
except ImportError as e:  # UnsupportedTorchError: a release the plugin refuses
    sys.exit(f"run_gpu.sh: {e}")
import pytest, numpy, hypothesis  # noqa: F401,E401  (the suite's test dependencies)
EOF
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
  exit 2
fi

CA_DYNSAVED_GPU_REPORT="$out/gpu-report.json" \
  "$PY" -m pytest tests/test_gpu_cuda_graphs.py -v -rs -p no:cacheprovider 2>&1 | tee -a "$out/gpu-log.txt"
rc=${PIPESTATUS[0]}
[ -f "$out/gpu-report.json" ] && cat "$out/gpu-report.json"
exit "$rc"
