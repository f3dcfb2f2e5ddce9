"""Counter slots of the one-launch current-scaling kernel (kernels/grid_state.py):
which slot a traced call may bake into its graph, and when it may not."""

import torch

from transformer_engine_compile.dynamo import lowering
from transformer_engine_compile.kernels import grid_state, tracing

CPU = torch.device("cpu")


def _address(slot):
    lo, hi = slot
    assert 0 <= lo < 2 ** 31 and 0 <= hi < 2 ** 31  # inductor takes int32 scalars only
    return (hi << 31) | lo


def test_traced_calls_get_distinct_slots_of_the_pool_their_graph_names():
    base = grid_state.pool(CPU).data_ptr()
    with tracing.fast_kernels_traced(), grid_state.traced_pool(base):
        addresses = [_address(grid_state.slot(CPU)) for _ in range(3)]
    offsets = [a - base for a in addresses]
    assert len(set(offsets)) == 3
    for off in offsets:
        assert off % grid_state.SLOT_BYTES == 0
        assert grid_state.STREAM_SLOTS <= off // grid_state.SLOT_BYTES < grid_state.POOL_SLOTS


def test_traced_slots_cycle_through_the_traced_part_of_the_pool():
    seen = {grid_state._next_traced_slot()
            for _ in range(grid_state.POOL_SLOTS - grid_state.STREAM_SLOTS + 5)}
    assert seen == set(range(grid_state.STREAM_SLOTS, grid_state.POOL_SLOTS))


def test_no_slot_unless_the_graph_names_this_pool():
    """Without the address in the op's simple values (a pool made after
    Dynamo traced the call, or none named), the call keeps two launches."""
    base = grid_state.pool(CPU).data_ptr()
    with tracing.fast_kernels_traced():
        assert grid_state.slot(CPU) is None
        with grid_state.traced_pool(None):
            assert grid_state.slot(CPU) is None
        with grid_state.traced_pool(base + grid_state.SLOT_BYTES):
            assert grid_state.slot(CPU) is None
        with grid_state.traced_pool(base):
            assert grid_state.slot(CPU) is not None


def test_no_slot_under_aot_inductor():
    """AOTInductor's code leaves the process: no address may be baked in."""
    from torch._inductor.virtualized import V
    base = grid_state.pool(CPU).data_ptr()
    with tracing.fast_kernels_traced(), grid_state.traced_pool(base), \
            V.set_aot_compilation(True):
        assert grid_state.slot(CPU) is None


def test_pool_token_is_zero_where_calls_do_not_lower():
    assert lowering.pool_token("cpu", None) == 0
    assert grid_state.pool(CPU).count_nonzero() == 0
