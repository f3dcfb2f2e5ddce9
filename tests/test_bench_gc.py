"""The distributed benchmarks' garbage-collection schedule
(benchmarks.distributed.collection_schedule, torchtitan's gc_freq): automatic
collection off inside, generation 1 collected every N steps, Python's own
state back afterwards."""

import gc

import pytest

from transformer_engine_compile.benchmarks import distributed as D


@pytest.fixture
def collections(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation))
    return calls


def test_steps_collect_every_n_with_automatic_collection_off(collections):
    assert gc.isenabled()
    seen = []
    with D.collection_schedule(3) as schedule:
        step = schedule(lambda x: seen.append((x, gc.isenabled())) or x * 2)
        assert collections == [2]  # one full collection before the steps
        results = [step(i) for i in range(7)]
    assert results == [0, 2, 4, 6, 8, 10, 12]
    assert [enabled for _, enabled in seen] == [False] * 7
    assert collections == [2, 1, 1]  # before steps 3 and 6
    assert gc.isenabled()


def test_zero_leaves_python_collecting(collections):
    with D.collection_schedule(0) as schedule:
        step = schedule(lambda: gc.isenabled())
        assert step() is True and step() is True
    assert collections == []


def test_disabled_collection_stays_disabled_after(collections):
    gc.disable()
    try:
        with D.collection_schedule(2) as schedule:
            schedule(lambda: None)()
        assert not gc.isenabled()
    finally:
        gc.enable()
