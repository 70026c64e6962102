"""The lanes program (``SpmdRuntime(lanes=...)``): one shared body, no conditional.

Every tick runs the body's forward lane, then its backward lane, on every device; an
idle lane's writes are dropped. Its lowering must keep every dependency and the
schedule's device order, send each lane's messages one way, and scan the fill and the
drain as one-lane segments; its program must hold no conditional at all, and its loss
and gradients must equal ``jax.value_and_grad`` of the unpipelined model.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from models import MODELS, assert_matches

import jaxpipe as jp
from jaxpipe.runtime.spmd import SpmdRuntime
from jaxpipe.runtime.spmd.lowering.lanes import (
    B_LANE,
    F_LANE,
    assign_lanes,
    lane_offsets,
    lane_segments,
    lanes_refusal,
    lower_lanes,
)
from jaxpipe.runtime.spmd.program.hlo_census import census, loop_conditionals
from jaxpipe.schedule import load_schedule

SCHEDULES = {
    "gpipe": lambda: jp.GPipe(4, 8),
    "1f1b": lambda: jp.OneFOneB(4, 8),
    "interleaved": lambda: jp.Interleaved1F1B(2, 4, 2),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_lane_ticks_keep_dependencies_order_and_one_way_lanes(name):
    """Every action runs once, in its lane (F forward, B backward), at most one a lane,
    device and tick, in the device's order but for a forward moved ahead of a backward
    in its tick; a value from another device comes from an earlier tick, one from the
    device's own forward lane may be read by its backward lane in the same tick."""
    schedule = SCHEDULES[name]()
    ticks = assign_lanes(schedule)
    g = ticks.graph
    lane = ticks.step % 2
    assert (ticks.step // 2 == ticks.tick).all()
    assert list(lane) == [F_LANE if k == 0 else B_LANE for k in g.kinds]
    slots = set(zip(ticks.tick.tolist(), ticks.device.tolist(), lane.tolist(), strict=True))
    assert len(slots) == len(g.actions)
    for i, deps in enumerate(g.data_deps):
        for p in deps[deps >= 0]:
            if ticks.device[p] != ticks.device[i]:
                assert ticks.tick[p] < ticks.tick[i], (g.actions[p], g.actions[i])
            else:
                assert ticks.step[p] < ticks.step[i], (g.actions[p], g.actions[i])
    for d, actions in g.lists.items():
        index = [g.actions.index(a) for a in actions]
        assert list(ticks.tick[index]) == sorted(ticks.tick[index]), d
    assert lane_offsets(ticks, schedule.num_devices) is not None


def test_gpipe_lanes_run_no_masked_lane_in_the_fill_and_drain():
    """GPipe's forwards fill the pipe with no backward anywhere, and its backwards drain
    it with no forward left: the program scans those ticks with one lane; only the tick
    where the last stage turns runs both, so the lanes cost the schedule's own time."""
    schedule = jp.GPipe(4, 8)
    low = lower_lanes(schedule, {})
    segs = lane_segments(low.ticks)
    assert [s.lanes for s in segs] == [(F_LANE,), (F_LANE, B_LANE), (B_LANE,)]
    p, m = 4, 8
    assert [s.stop - s.start for s in segs] == [m + p - 2, 1, m + p - 2]
    assert segs[-1].stop == low.num_ticks
    # a forward-only lowering (evaluation) runs its forward lane alone
    fwd = lower_lanes(jp.schedule.forward.ForwardOnly(schedule), {})
    assert [s.lanes for s in lane_segments(fwd.ticks)] == [(F_LANE,)]


class _VGPipe(jp.Schedule):
    """GPipe over a V placement (stage ``s`` and ``2p - 1 - s`` on one device): the
    forwards go down and then back up, so the forward lane would send both ways."""

    def __init__(self, num_devices: int, num_microbatches: int) -> None:
        super().__init__(num_devices, num_microbatches, stages_per_device=2)

    def placement(self, stage: int) -> int:
        p = self.num_devices
        return stage if stage < p else 2 * p - 1 - stage

    def device_actions(self, device: int) -> list[jp.Action]:
        mine = [s for s in range(self.num_stages) if self.placement(s) == device]
        m = self.num_microbatches
        return ([jp.Action("F", s, i) for i in range(m) for s in mine]
                + [jp.Action("B", s, i) for i in range(m) for s in reversed(mine)])


def test_schedules_the_lanes_cannot_run_are_named():
    """A split backward (zero bubble), a V placement and stages of several bodies: each
    refused with its reason; ``lanes=True`` says it in a PipelineError."""
    zb = load_schedule("schedules/zero_bubble.py:ZeroBubbleH1")(4, 8)
    assert "I and W" in lanes_refusal(zb, [0] * 4, False)
    assert "I and W" in lanes_refusal(jp.OneFOneB(4, 8), [0] * 4, True)
    dualpipe = load_schedule("schedules/dualpipe_v.py:DualPipeV")(2, 4)
    assert "I and W" in lanes_refusal(dualpipe, [0] * 4, False)
    v = _VGPipe(4, 4)
    assert "both ways" in lanes_refusal(v, [0] * v.num_stages, False)
    assert "2 distinct bodies" in lanes_refusal(jp.OneFOneB(4, 8), [0, 1, 1, 1], False)
    loss_fn, params, batch = MODELS["mlp"](4, batch=16)  # the first stage reads the batch
    with pytest.raises(jp.PipelineError, match=r"lanes=True.*distinct bodies.*lanes='auto' "
                                               r"or False, or a schedule and cut whose stages "
                                               r"share one body"):
        jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((4,), ("pipe",)),
                    schedule=jp.GPipe(4, 4), runtime=SpmdRuntime(lanes=True))
    # stages that share one body, refused for the split: the fix is not a shared body
    loss_fn, params, batch = MODELS["tiny_lm"](8, batch=16, block_scale=0.3)
    with pytest.raises(jp.PipelineError, match=r"I and W.*or a schedule of F and B actions "
                                               r"only, with split_backward=False\.$"):
        jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((4,), ("pipe",)),
                    schedule=zb, runtime=SpmdRuntime(lanes=True))


def test_lanes_turned_down_leave_a_program_built_for_it():
    """Lanes wanted (weights split over 'model') but turned down (the first stage reads
    the batch: two bodies): the pipeline is cut and built again without them, so the
    accelerator program splits its backwards into I and W (split_backward="auto" split
    none for the lanes) and the cut budgets the switch program's peaks; the plan still
    says why, and the numbers are exact."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 2), ("pipe", "model"))
    ks = jax.random.split(jax.random.key(0), 6)
    host = [jax.random.normal(k, (16, 16)) / 4 for k in ks[:4]]
    params = [jax.device_put(w, NamedSharding(mesh, P(None, "model"))) for w in host]
    batch = {"x": jax.random.normal(ks[4], (16, 16)), "y": jax.random.normal(ks[5], (16, 16))}

    def loss_fn(params, b):
        h = b["x"] * 2.0  # the first stage computes on the batch: not the others' body
        for w in params:
            h = jp.boundary(jax.numpy.tanh(h @ w))
        return jax.numpy.mean((h - b["y"]) ** 2)

    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=jp.OneFOneB(2, 4),
                       cut="markers", runtime=SpmdRuntime(backend="gpu"))
    ex = pipe.inspect.executor
    assert not ex.lanes and "distinct bodies" in ex.lanes_refused
    assert "lanes not used" in str(pipe.plan)
    assert {a.kind for a in ex.lowering.actions} >= {"I", "W"}
    assert list(pipe.inspect.cut_report.in_flight) == [2, 1]  # 1F1B's, not the lanes' 3, 1
    assert_matches(pipe.value_and_grad(params, batch),
                   jax.value_and_grad(loss_fn)(host, batch))


@functools.cache
def _lanes_pipe(name: str, backend: str):
    schedule = SCHEDULES[name]()
    layers = 2 * schedule.num_stages  # two blocks a stage: the first and last share them
    loss_fn, params, batch = MODELS["tiny_lm"](layers, batch=2 * schedule.num_microbatches,
                                               block_scale=0.3)
    mesh = jax.make_mesh((schedule.num_devices,), ("pipe",))
    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=schedule,
                       runtime=SpmdRuntime(backend=backend, lanes=True))
    return pipe, loss_fn, params, batch


@pytest.mark.parametrize(("name", "backend"), [("gpipe", "cpu"), ("1f1b", "gpu"),
                                               ("interleaved", "cpu")])
def test_lanes_are_exact_and_hold_no_conditional(name, backend):
    """tiny_lm (an embedding and a tied head around the blocks: the first and last
    stages' prologue and epilogue run on every device, counted on their own): loss,
    gradients and the evaluation loss equal jax.value_and_grad's; the compiled program
    holds no conditional in its tick loops (one per segment; the parameters' moves into
    the stage layout around them pick by device)."""
    pipe, loss_fn, params, batch = _lanes_pipe(name, backend)
    assert pipe.inspect.executor.lanes and len(pipe.inspect.executor.bodies) == 1
    got = pipe.value_and_grad(params, batch)
    want_loss, want = jax.value_and_grad(loss_fn)(params, batch)
    assert_matches(got, (want_loss, want))
    np.testing.assert_allclose(pipe.loss(params, batch), want_loss, rtol=1e-5)
    text = pipe.inspect.value_and_grad_fn.lower(params, batch).compile().as_text()
    loops, conditionals = loop_conditionals(text)
    segs = pipe.inspect.executor._step.tick_loop.segments
    assert loops >= sum(s.stop - s.start > 1 for s in segs)  # (one tick: inlined)
    assert conditionals == 0
    assert census(text).permutes >= 1
    if pipe.schedule.stages_per_device == 1:  # the cutter budgeted the lanes' own peaks
        assert (list(pipe.inspect.cut_report.in_flight)
                == list(pipe.inspect.executor.lowering.residual_peak))
