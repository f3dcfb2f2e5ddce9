#!/usr/bin/env bash
# 2- or 4-GPU tensor/sequence-parallel run (NCCL).  Every column/row x SP case of
# tests/tp_harness.py, bf16 and every recipe (DelayedScaling included), compiled fullgraph in default
# and reduce-overhead mode: compiled == eager TP bit for bit, one graph, no
# graph break, and TP == the single-device layer (bf16 exactly, quantized
# within the documented tolerance); te.LayerNormLinear column (+SP) against
# one device; FSDP2 training (tests/fsdp_harness.py).  Then the docs'
# torchrun example.
# Fails without 2 CUDA devices.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
NPROC="${NPROC:-2}"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"  # never NVLink multicast on shared hosts
python - "$NPROC" <<'PY'
import sys, torch
n = torch.cuda.device_count()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {n} x "
      f"{torch.cuda.get_device_name(0) if n else 'no GPU'}")
sys.exit(0 if n >= int(sys.argv[1]) else f"qa/L1_distributed needs {sys.argv[1]} CUDA devices")
PY
run() { python -m torch.distributed.run --standalone --nproc_per_node "$NPROC" "$@"; }
# MODES / extra harness arguments (e.g. --parallel row:1 --recipes bf16) pick a
# subset; with a cold inductor cache (a fresh machine) the steps one after the
# other take over 10 minutes on 2 H200s; PARALLEL=1 runs them side by side
# (each its own torchrun, all ranks sharing the GPUs: about 2 minutes on 4 H200s)
# and fails if any fails
steps=(tp tp_ragged layernorm_linear fsdp fsdp2d demo)
step() {
  case "$1" in
    tp) run tests/tp_harness.py --device cuda --modes ${MODES:-default reduce-overhead} "${@:2}" ;;
    # a ragged token count (2 x 100: no multiple of any block) with sequence parallelism
    tp_ragged) run tests/tp_harness.py --device cuda --modes ${MODES:-default reduce-overhead} \
                 --parallel column:1 row:1 --seq 100 "${@:2}" ;;
    # te.LayerNormLinear column-parallel, with and without SP, every recipe
    layernorm_linear) (cd tests && run test_layernorm_linear.py) ;;
    # FSDP2 (fully_shard per layer + root) over LayerNormLinear, Linear and
    # LayerNormMLP: quantized weight all-gather == high-precision gather ==
    # per-layer compiled (inductor), bit for bit; one process within the format's
    # error; gathered bytes; DelayedScaling scales identical on every rank
    fsdp) run tests/fsdp_harness.py --device cuda ;;
    # 2-D (tensor parallel x FSDP2) on a 2 x 2 mesh: only with 4 GPUs
    fsdp2d) if [ "$NPROC" -ge 4 ]; then
              python -m torch.distributed.run --standalone --nproc_per_node 4 tests/fsdp2d_harness.py --device cuda
            fi ;;
    demo) for recipe in bf16 fp8_current; do
            run -m transformer_engine_compile.demos.parallel --recipe "$recipe" --steps 5
          done ;;
  esac
}
if [ "${PARALLEL:-0}" = 1 ]; then
  logs=$(mktemp -d)
  for s in "${steps[@]}"; do (step "$s" "$@" > "$logs/$s.log" 2>&1) & pids+=($!); done
  failed=()
  for i in "${!steps[@]}"; do wait "${pids[$i]}" || failed+=("${steps[$i]}"); done
  for s in "${steps[@]}"; do echo "== $s"; cat "$logs/$s.log"; done
  if [ "${#failed[@]}" -gt 0 ]; then echo "qa/L1_distributed: failed: ${failed[*]}"; exit 1; fi
else
  for s in "${steps[@]}"; do step "$s" "$@"; done
fi
echo "qa/L1_distributed: passed"
