"""FSDP2 (``fully_shard``) with te layers on CPU: 2 gloo processes per test.

The training cases live in fsdp_harness.py (shared with the 2-GPU NCCL run
in qa/L1_distributed).  Worker functions are module level so that
``torch.multiprocessing.spawn`` can pickle them.
"""

import pytest
import torch

import fsdp_harness as F
import tp_harness as H

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch built without torch.distributed")


def cases_worker(group, names, backend):
    for name in names:
        F.run_case(group, name, torch.device("cpu"), backend)


@pytest.mark.parametrize("names", [("fp8_current",), ("fp8_block",), ("bf16", "delayed"),
                                   ("mxfp8", "nvfp4")], ids="-".join)
def test_fsdp_training_equals_single_process(names):
    """Quantized gather == high-precision gather == compiled, bit for bit;
    single process within the format's error; bytes; delayed scales."""
    H.spawn(cases_worker, names, "aot_eager")
