#!/usr/bin/env bash
# The GPU check behind README "GPU and CUDA graphs": tests/test_gpu_cuda_graphs.py on a
# CUDA GPU (inductor and mode="reduce-overhead", a C++ extension built there against
# the CUDA build of torch, and a Python function, saved values changing every step),
# then the self-check (python -m ca_dynsaved selfcheck) on the same torch.
#
#   bash tests/run_gpu.sh [PYTHON]
#
# PYTHON: an interpreter whose torch is a CUDA build of a supported release (2.11 to
# 2.15); default python3, targeted as torch 2.11.0+cu130 on Python 3.12 with pytest,
# numpy, hypothesis, g++, ninja and nvcc beside it. Installs nothing (a GPU machine
# may have no network) and needs nothing but the
# repo: the plugin is imported from src/, the test extension is built into
# .ext_build/ on first use (about 25 s). Writes gpu-log.txt and gpu-report.json to
# $OUT (or ./gpu-out). Exit status: pytest's (or the self-check's when pytest
# passed), or 2 when this machine cannot run the check (and why).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${1:-python3}
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
"$PY" -m ca_dynsaved selfcheck --build-dir ".ext_build/selfcheck-$("$PY" -c 'import torch; print(torch.__version__)')" 2>&1 | tee -a "$out/gpu-log.txt"
check=${PIPESTATUS[0]}
if [ "$rc" -eq 0 ]; then rc=$check; fi
exit "$rc"
