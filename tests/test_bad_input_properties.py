"""Property tests: whatever a user passes, jaxpipe answers with its own error or works.

Each property draws arbitrary values for one kind of input (``jp.Cut`` fields, a batch
at call time, a step key, a schedule's action lists, ``jp.boundary`` leaves) and asserts
that the only possible failure is jaxpipe's own exception type with a message, never a
TypeError/AttributeError/IndexError from deep inside the library. None of them compiles
anything.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxpipe as jp

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

anything = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 10**12), st.floats(allow_nan=True),
    st.text(max_size=5), st.lists(st.integers(-2, 6), max_size=4),
    st.tuples(st.integers(0, 5), st.integers(0, 5)), st.just(math.inf),
    st.just(object()), st.just([1.5, 2]), st.just({"a": 1}),
)


@SETTINGS
@given(indices=anything, objective=anything, memory_budget=anything, time_slack=anything,
       opt=anything, profile=anything, workspace=anything, model=anything)
def test_cut_fields(indices, objective, memory_budget, time_slack, opt, profile, workspace,
                    model):
    try:
        cut = jp.Cut(indices=indices, objective=objective, memory_budget=memory_budget,
                     time_slack=time_slack, optimizer_bytes_per_param_byte=opt,
                     profile=profile, workspace_residual_sets=workspace, memory_model=model)
    except jp.CutError as err:
        assert str(err).startswith("Cut.") and "got" in str(err)
        return
    # what was accepted is well-formed
    assert cut.objective in ("time", "memory") and isinstance(cut.profile, bool)
    assert cut.indices is None or all(isinstance(i, int) and i >= 0 for i in cut.indices)
    assert cut.memory_budget is None or cut.memory_budget > 0
    assert not math.isnan(cut.time_slack) and cut.time_slack >= 0


def _loss(params, mb):
    h = jp.boundary(jnp.tanh(mb["x"] @ params["w"][0]))
    return jnp.mean((jnp.tanh(h @ params["w"][1]) - mb["y"]) ** 2)


@pytest.fixture(scope="module")
def pipe():
    params = {"w": [jnp.eye(4), jnp.eye(4)]}
    batch = {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 4))}
    return jp.pipeline(_loss, params, batch, mesh=jax.make_mesh((2,), ("pipe",),
                       devices=jax.devices()[:2]), schedule=jp.GPipe(2, 4))


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
leaves = st.one_of(
    st.builds(lambda s, dt: np.zeros(s, dt), shapes,
              st.sampled_from([np.float32, np.int32, np.float16, bool])),
    st.just("text"), st.just(None), st.floats(), st.just(jax.random.key(0)),
)
batches = st.one_of(
    st.dictionaries(st.sampled_from(["x", "y", "z"]), leaves, max_size=3),
    st.lists(leaves, max_size=2), leaves,
)


@SETTINGS
@given(batch=batches)
def test_batch_at_call(pipe, batch):
    try:
        leaves = pipe.inspect.check_batch(batch)
    except jp.PipelineError as err:
        assert "batch" in str(err)
        return
    assert [np.shape(x) for x in leaves] == [(8, 4), (8, 4)]


@SETTINGS
@given(key=st.one_of(anything, st.just(jax.random.key(1)), st.just(jax.random.PRNGKey(1)),
                     st.just(jax.random.split(jax.random.key(1), 2)),
                     st.just(jax.random.key(1, impl="rbg")), st.just(np.zeros(2, np.uint32))))
def test_step_key(key):
    from jaxpipe.api.inputs import check_key

    dtype = jax.random.key(0).dtype
    try:
        out = check_key(key, True, dtype, "call")
    except jp.PipelineError as err:
        assert "key" in str(err)
        return
    assert out.dtype == dtype and out.shape == ()


action_like = st.one_of(
    st.builds(jp.Action, st.sampled_from("FBIW"), st.integers(0, 3), st.integers(0, 3)),
    st.sampled_from(["0F0", None, 3, "x"]),
)


@SETTINGS
@given(lists=st.lists(st.one_of(st.none(), st.integers(), st.lists(action_like, max_size=6)),
                      min_size=2, max_size=2))
def test_schedule_action_lists(lists):
    class Drawn(jp.Schedule):
        def device_actions(self, device):
            return lists[device]

    try:
        Drawn(2, 2).validate()
    except jp.ScheduleError as err:
        assert "device" in str(err) or "device_actions" in str(err)


@SETTINGS
@given(tree=st.recursive(st.one_of(leaves, st.just(jnp.ones(2))),
                         lambda t: st.lists(t, max_size=3) | st.dictionaries(
                             st.sampled_from("ab"), t, max_size=2), max_leaves=4))
def test_boundary_leaves(tree):
    try:
        out = jp.boundary(tree)
    except TypeError as err:
        assert "jp.boundary marks arrays" in str(err)
        return
    assert jax.tree.structure(out) == jax.tree.structure(tree)
