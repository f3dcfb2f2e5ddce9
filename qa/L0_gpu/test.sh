#!/usr/bin/env bash
# GPU test set: run on a CUDA machine.  Runs the whole suite there (this is
# also where the torch version of the GPU image, e.g. 2.11, is covered) with
# the GPU-only tests under tests/gpu enabled, and fails if CUDA is missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python - <<'PY'
import torch, sys
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"device {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
sys.exit(0 if torch.cuda.is_available() else "qa/L0_gpu needs a CUDA device")
PY
# every cached Triton launch is checked against kernel[grid] (triton_launch.py)
export TE_COMPILE_CHECK_LAUNCH=1
# TESTS picks a part (e.g. TESTS="tests/gpu"): cold (no inductor cache, the native
# extension unbuilt) the whole suite takes over 10 minutes on one H200
python -m pytest -n "${PYTEST_WORKERS:-8}" -q -p no:cacheprovider -rfEs ${TESTS:-tests} "$@"
