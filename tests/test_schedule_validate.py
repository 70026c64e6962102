"""Every validation rule, each with a deliberately broken test-local schedule."""

import pytest

from jaxpipe.schedule import Action, OneFOneB, Schedule, ScheduleError


class Listed(Schedule):
    """A schedule given as explicit per-device lists of "2F0"-style strings."""

    def __init__(self, p, m, lists, v=1, placement=None):
        super().__init__(p, m, v)
        self._lists = lists
        self._placement = placement

    def placement(self, stage):
        return self._placement(stage) if self._placement else super().placement(stage)

    def device_actions(self, device):
        return [Action.parse(x) if isinstance(x, str) else x for x in self._lists[device]]


def one_f_one_b_lists(p, m):
    return {d: [str(a) for a in OneFOneB(p, m).device_actions(d)] for d in range(p)}


def broken(edit, p=2, m=2, **kw):
    lists = one_f_one_b_lists(p, m)
    edit(lists)
    return Listed(p, m, lists, **kw)


def check(schedule, *words):
    with pytest.raises(ScheduleError) as err:
        schedule.validate()
    msg = str(err.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    # simulate() validates first, so it raises the same error
    with pytest.raises(ScheduleError):
        schedule.simulate()
    return msg


def test_reference_lists_are_valid():
    Listed(2, 2, one_f_one_b_lists(2, 2)).validate()
    assert one_f_one_b_lists(2, 2) == {0: ["0F0", "0F1", "0B0", "0B1"],
                                       1: ["1F0", "1B0", "1F1", "1B1"]}


def test_stage_on_wrong_device():
    s = broken(lambda L: L[0].append("1F0"))
    check(s, "device 0", "1F0", "not placed on this device", "device 1")


def test_missing_forward():
    s = broken(lambda L: L[1].remove("1F1"))
    check(s, "device 1", "1F1", "missing F")


def test_duplicate_forward():
    s = broken(lambda L: L[0].insert(2, "0F1"))
    check(s, "device 0", "0F1", "duplicate")


def test_missing_backward():
    s = broken(lambda L: L[0].remove("0B1"))
    check(s, "device 0", "0B1", "missing backward", "0I1")


def test_duplicate_backward():
    s = broken(lambda L: L[1].append("1B0"))
    check(s, "device 1", "1B0", "duplicate")


def test_backward_before_forward_same_device():
    def edit(L):
        L[1] = ["1B0", "1F0", "1F1", "1B1"]

    check(broken(edit), "device 1", "1B0", "backward before forward", "1F0")


def test_input_grad_before_forward():
    def edit(L):
        L[1] = ["1I0", "1F0", "1W0", "1F1", "1B1"]

    check(broken(edit), "device 1", "1I0", "backward before forward")


def test_w_without_i():
    def edit(L):
        L[1] = ["1F0", "1W0", "1F1", "1B1"]

    check(broken(edit), "device 1", "1W0", "W without I")


def test_i_without_w():
    def edit(L):
        L[1] = ["1F0", "1I0", "1F1", "1B1"]

    check(broken(edit), "device 1", "1I0", "I without W", "1W0")


def test_b_mixed_with_i_w():
    def edit(L):
        L[1] = ["1F0", "1B0", "1I0", "1W0", "1F1", "1B1"]

    check(broken(edit), "device 1", "1I0", "B mixed with I/W", "1B0")


def test_w_before_its_i():
    def edit(L):
        L[1] = ["1F0", "1W0", "1I0", "1F1", "1B1"]

    check(broken(edit), "device 1", "1W0", "W before its I", "1I0")


def test_microbatch_out_of_range():
    s = broken(lambda L: L[0].append("0F2"))
    check(s, "device 0", "0F2", "microbatch index out of range", "0..1")


def test_stage_out_of_range():
    s = broken(lambda L: L[1].append("3F0"))
    check(s, "device 1", "3F0", "stage index out of range", "0..1")


def test_placement_out_of_range():
    s = Listed(2, 1, {0: ["0F0", "0B0"], 1: ["1F0", "1B0"]}, placement=lambda st: st * 2)
    check(s, "placement(1)", "device 2", "out of range")


def test_placement_not_an_int():
    s = Listed(2, 1, {0: ["0F0", "0B0"], 1: ["1F0", "1B0"]}, placement=lambda st: "gpu0")
    check(s, "placement(0)", "'gpu0'", "not a device index")


def test_non_action_entry():
    s = Listed(1, 1, {0: [Action("F", 0, 0), ("B", 0, 0)]})
    check(s, "device 0", "tuple", "Action objects")


def test_cross_device_deadlock():
    # device 0 waits at 0B0 for 1B0, but device 1 first waits at 1F1 for 0F1,
    # which device 0 only runs after 0B0: a cycle.
    def edit(L):
        L[0] = ["0F0", "0B0", "0F1", "0B1"]
        L[1] = ["1F1", "1F0", "1B0", "1B1"]

    msg = check(broken(edit), "deadlock", "device 0", "0B0", "1B0", "device 1", "1F1", "0F1",
                "dependency cycle")
    assert "stuck at action 0B0 waiting for 1B0 (on device 1)" in msg
    assert "stuck at action 1F1 waiting for 0F1 (on device 0)" in msg


def test_valid_split_and_v_placement_schedule():
    # V placement: device 0 holds stages 0 and 3, device 1 holds 1 and 2; split backward.
    lists = {
        0: ["0F0", "0F1", "3F0", "3I0", "3W0", "3F1", "3I1", "3W1", "0I0", "0I1", "0W0", "0W1"],
        1: ["1F0", "2F0", "1F1", "2F1", "2B0", "1B0", "2B1", "1B1"],
    }
    s = Listed(2, 2, lists, v=2, placement=lambda st: min(st, 3 - st))
    s.validate()
    t = s.simulate()
    assert len(t.events) == sum(len(v) for v in lists.values())


def test_pipeline_validates_simulates_and_compiles_its_schedule_once(monkeypatch):
    """A default ``jp.pipeline`` build checks, simulates and compiles the schedule once:
    the cutter, the plan and the lowering share the results (at p=64, m=512 each pass
    takes about a second)."""
    import jax
    import jax.numpy as jnp

    import jaxpipe as jp
    from jaxpipe.schedule import base, graph

    calls = {"validate": 0, "simulate": 0, "build_graph": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(Schedule, "validate", counted("validate", Schedule.validate))
    monkeypatch.setattr(Schedule, "simulate", counted("simulate", Schedule.simulate))
    monkeypatch.setattr(base, "build_graph", counted("build_graph", graph.build_graph))

    def loss(params, batch):
        h = batch
        for w in params:
            h = jp.boundary(jnp.tanh(h @ w))
        return jnp.mean(h**2)

    params = [jnp.full((4, 4), 0.1 * (i + 1), jnp.float32) for i in range(4)]
    batch = jnp.ones((8, 4), jnp.float32)
    pipe = jp.pipeline(loss, params, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                       schedule=jp.OneFOneB(2, 4))
    pipe.value_and_grad(params, batch)
    str(pipe.plan)
    assert calls == {"validate": 1, "simulate": 1, "build_graph": 1}
