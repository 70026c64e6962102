"""The SPMD lowering, step by step: ticks, messages, liveness-sized buffers, the table."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from random_schedules import schedules
from split_schedule import DeferredW1F1B

import jaxpipe as jp
from jaxpipe.runtime.spmd.lowering import (
    IDLE,
    Pool,
    allocate,
    assign_ticks,
    branch_id,
    list_messages,
    lower,
)
from jaxpipe.schedule import ACTION_KINDS


def _sizes(schedule, a=3, b=2, h=1):
    """Per pool, per stage, elements per dtype (distinct per stage, two dtypes)."""
    S = schedule.num_stages
    return {
        Pool.RESIDUAL_A: [{"float32": a + s, "int32": 1} for s in range(S)],
        Pool.RESIDUAL_B: [{"float32": b * (s + 1)} for s in range(S)],
        Pool.HANDOFF: [{"float32": h + s % 2} for s in range(S)],
    }


def _decode(branch: int, num_stages: int) -> tuple[str, int]:
    k, s = divmod(branch - 1, num_stages)
    return ACTION_KINDS[k], s


def _check_lowering(schedule):
    when = assign_ticks(schedule)
    D = schedule.num_devices
    # every action once, on its device, one action per (device, tick), device order kept
    assert set(when) == {a for acts in schedule.actions().values() for a in acts}
    for d, acts in schedule.actions().items():
        ticks = [when[a][1] for a in acts]
        assert all(when[a][0] == d for a in acts)
        assert ticks == sorted(ticks) and len(set(ticks)) == len(ticks)
    messages = list_messages(schedule, when)
    S, m = schedule.num_stages, schedule.num_microbatches
    assert len(messages) == 2 * (S - 1) * m  # a carry and a cotangent per stage boundary
    for msg in messages:
        assert msg.read > msg.sent if msg.src != msg.dst else msg.read >= msg.sent
        assert (msg.src, msg.dst) == (schedule.placement(msg.producer.stage),
                                      schedule.placement(msg.consumer.stage))

    sizes = _sizes(schedule)
    alloc = allocate(schedule, when, messages, sizes)
    # no two values that are live at once share storage (times are (start, end])
    for d in range(D):
        live = []
        for (pool, unit, k), off in alloc.pool_offset.items():
            if schedule.placement(unit[0]) != d or sizes[pool][unit[0]].get(k, 0) == 0:
                continue
            kinds = {a.kind: t for a, (_, t) in when.items() if (a.stage, a.microbatch) == unit}
            start = kinds[pool.writer]
            end = max([kinds[r] for r in pool.readers if r in kinds] or [start])
            live.append((k, start, end, off, off + sizes[pool][unit[0]][k]))
        for i, (k1, s1, e1, lo1, hi1) in enumerate(live):
            assert hi1 <= alloc.storage[k1]
            for k2, s2, e2, lo2, hi2 in live[i + 1:]:
                if k1 == k2 and s1 < e2 and s2 < e1:
                    assert hi1 <= lo2 or hi2 <= lo1
    assert list(alloc.residual_peak) == list(schedule.simulate().peak_in_flight)

    low = lower(schedule, sizes)
    t = low.table
    # rows decode back to exactly the schedule's actions
    seen = set()
    for step in range(t.num_steps):
        for d in range(D):
            b = int(t.branch[step, d])
            if b == IDLE:
                continue
            kind, stage = _decode(b, S)
            assert branch_id(kind, stage, S) == b
            seen.add(jp.Action(kind, stage, int(t.microbatch[step, d])))
    assert seen == set(when)
    # every message arrives where its reader looks for it
    for msg in messages:
        slot = t.in_slot[msg.read, msg.dst]
        if msg.src == msg.dst:
            assert t.local_dst[msg.sent, msg.src] == slot
        else:
            j = low.perm_offsets.index((msg.dst - msg.src) % D)
            assert t.exchange[msg.sent, j]
            assert t.recv_slot[msg.sent, msg.dst, j] == slot
    return low


@pytest.mark.parametrize("make", [
    lambda: jp.GPipe(4, 8), lambda: jp.OneFOneB(4, 8), lambda: jp.OneFOneB(3, 2),
    lambda: jp.Interleaved1F1B(2, 4, stages_per_device=2), lambda: DeferredW1F1B(4, 6),
])
def test_lowering_steps_builtin(make):
    _check_lowering(make())


@settings(max_examples=40, deadline=None)
@given(schedules())
def test_lowering_steps_random_schedules(schedule):
    _check_lowering(schedule)


def test_storage_and_inbox_follow_the_schedule_not_m():
    small, big = (lower(jp.OneFOneB(4, m), _sizes(jp.OneFOneB(4, m))) for m in (8, 32))
    assert small.storage == big.storage and small.num_inbox == big.num_inbox
    g8, g32 = (lower(jp.GPipe(4, m), _sizes(jp.GPipe(4, m))) for m in (8, 32))
    assert g32.storage["int32"] == 4 * g8.storage["int32"]


def test_split_frees_input_only_residuals_at_i():
    """With I/W split, RESIDUAL_A is freed at I: storage is below the unsplit total."""
    sched = DeferredW1F1B(4, 8)
    sizes = _sizes(sched, a=50, b=1, h=1)
    low = lower(sched, sizes)
    no_early_free = {"float32": 0}
    for d in range(4):
        peak = low.residual_peak[d]
        per_set = max(sizes[Pool.RESIDUAL_A][s]["float32"] + sizes[Pool.RESIDUAL_B][s]["float32"]
                      for s in sched.device_stages(d))
        no_early_free["float32"] = max(no_early_free["float32"], peak * per_set)
    assert low.storage["float32"] < no_early_free["float32"]


def test_table_is_a_pytree_of_int_arrays():
    import jax

    low = lower(jp.OneFOneB(2, 4), _sizes(jp.OneFOneB(2, 4)))
    leaves = jax.tree.leaves(low.table)
    assert all(isinstance(x, np.ndarray) for x in leaves)
    assert all(x.shape[0] == low.table.num_steps for x in leaves)
    assert jnp.asarray(low.table.branch).dtype == jnp.int32
