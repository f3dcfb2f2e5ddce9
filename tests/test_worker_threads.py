"""The test run itself: under ``pytest -n N`` every worker's torch runs on
its share of the cores (``conftest.py``)."""

import os

import pytest
import torch


def test_each_worker_runs_torch_on_its_share_of_the_cores():
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        pytest.skip("one test process: torch keeps its default thread count")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = max(1, cores // workers)
    assert torch.get_num_threads() == share
