"""The schedule gallery in ``schedules/``: user-style schedules written only against
``import jaxpipe as jp``.

For every gallery schedule: it validates on a grid of (p, m) it supports, fails with
a clear ``ScheduleError`` where it does not, has the simulated bubble and memory its
paper promises, and runs on the SPMD runtime with loss and gradients equal to
``jax.value_and_grad`` of the unpipelined loss.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpipe as jp

ROOT = Path(__file__).resolve().parents[1]
GALLERY = ROOT / "schedules"


def load(spec: str) -> type[jp.Schedule]:
    return jp.load_schedule(str(GALLERY / spec))


Eager1F1B = load("eager_1f1b.py:Eager1F1B")
LoopedBFS = load("looped_bfs.py:LoopedBFS")
ZeroBubbleH1 = load("zero_bubble.py:ZeroBubbleH1")
DualPipeV = load("dualpipe_v.py:DualPipeV")
VHalf = load("v_half.py:VHalf")

GALLERY_CLASSES = [Eager1F1B, LoopedBFS, ZeroBubbleH1, DualPipeV, VHalf]


def min_microbatches(cls: type[jp.Schedule], p: int) -> int:
    """The smallest m each schedule supports (DualPipeV: 2p; the rest: 1)."""
    return 2 * p if cls is DualPipeV else 1


# ---------------------------------------------------------------------------- public API


def test_gallery_files_use_only_the_public_api():
    """A user writes these files: they may import ``jaxpipe`` (and the standard library)
    but no ``jaxpipe.<submodule>``, and only touch names ``jaxpipe`` exports."""
    public = set(dir(jp))
    files = sorted(GALLERY.glob("*.py"))
    assert {f.name for f in files} >= {
        "eager_1f1b.py",
        "looped_bfs.py",
        "zero_bubble.py",
        "dualpipe_v.py",
        "v_half.py",
    }
    for path in files:
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), f"{path.name} needs a module docstring"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.module and not node.module.startswith("jaxpipe"), (
                    f"{path.name}: 'from {node.module} import ...' reaches into jaxpipe internals"
                )
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name == "jaxpipe" or not alias.name.startswith("jaxpipe"), (
                        f"{path.name}: 'import {alias.name}' reaches into jaxpipe internals"
                    )
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "jp"
            ):
                assert node.attr in public and node.attr not in {
                    "schedule",
                    "runtime",
                    "lower",
                    "stages",
                    "trace",
                }, f"{path.name}: jp.{node.attr} is not a public schedule-level name"


# ------------------------------------------------------------------------------ validity


@pytest.mark.parametrize("cls", GALLERY_CLASSES, ids=lambda c: c.__name__)
def test_validates_on_supported_grid(cls):
    for p in range(1, 7):
        for m in range(min_microbatches(cls, p), min_microbatches(cls, p) + 2 * p + 3):
            sched = cls(p, m)
            sched.validate()
            acts = sched.actions()
            # Every (stage, mb) has one F and a backward; split ones have I and W.
            kinds = [a.kind for a in sum(acts.values(), [])]
            n_units = sched.num_stages * m
            assert kinds.count("F") == n_units
            assert kinds.count("B") + kinds.count("I") == n_units
            assert kinds.count("I") == kinds.count("W")


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: Eager1F1B(4, 8, stages_per_device=2), ["Eager1F1B", "stages_per_device=1"]),
        (lambda: ZeroBubbleH1(4, 8, stages_per_device=2), ["ZeroBubbleH1", "stages_per_device=1"]),
        (lambda: DualPipeV(4, 7), ["DualPipeV", "m=7", "2*p=8"]),
        (lambda: DualPipeV(2, 3), ["DualPipeV", "m=3", "2*p=4"]),
        (lambda: DualPipeV(4, 8, stages_per_device=3), ["DualPipeV", "2 stages per device"]),
        (lambda: VHalf(4, 8, stages_per_device=1), ["VHalf", "2 stages per device"]),
        (lambda: LoopedBFS(0, 8), ["num_devices"]),
    ],
    ids=[
        "eager-v2",
        "zbh1-v2",
        "dualpipev-m7",
        "dualpipev-m3",
        "dualpipev-v3",
        "vhalf-v1",
        "loopedbfs-p0",
    ],
)
def test_unsupported_configurations_raise_clear_errors(make, words):
    with pytest.raises(jp.ScheduleError) as err:
        make()
    for word in words:
        assert word in str(err.value), f"{word!r} not in {err.value}"


# ---------------------------------------------------------------------- orders and shapes


def test_eager_1f1b_warmup_and_memory():
    p, m = 4, 8
    sched = Eager1F1B(p, m)
    for d in range(p):
        acts = sched.device_actions(d)
        first_b = next(i for i, a in enumerate(acts) if a.kind == "B")
        # 2(p-1-d) warm-up forwards, then the steady state starts with a forward.
        assert first_b == min(2 * (p - 1 - d), m) + 1
    t, base = sched.simulate(), jp.OneFOneB(p, m).simulate()
    assert t.peak_in_flight == [min(2 * (p - 1 - d) + 1, m) for d in range(p)]
    assert t.makespan == base.makespan  # communication is free in the simulator
    assert Eager1F1B(2, 8).device_actions(1) == jp.OneFOneB(2, 8).device_actions(1)


def test_looped_bfs_order_and_bubble():
    p, m = 4, 8
    sched = LoopedBFS(p, m)
    acts = [str(a) for a in sched.device_actions(1)]
    assert acts[:m] == [f"1F{k}" for k in range(m)] and acts[m] == "5F0"
    assert acts[2 * m : 2 * m + 2] == ["5B7", "5B6"] and acts[-1] == "1B0"
    t = sched.simulate()
    assert t.peak_in_flight == [2 * m] * p
    assert t.bubble_fraction < jp.GPipe(p, m).simulate().bubble_fraction
    assert t.bubble_fraction == pytest.approx(
        jp.Interleaved1F1B(p, m, stages_per_device=2).simulate().bubble_fraction
    )
    # its repr builds the schedule it describes (v=1 read as the class's default v=2)
    assert repr(LoopedBFS(p, m, 1)).endswith("stages_per_device=1)")
    assert repr(sched).endswith("stages_per_device=2)")
    assert repr(jp.OneFOneB(p, m)) == "OneFOneB(num_devices=4, num_microbatches=8)"


def test_zero_bubble_h1_idle_is_a_third_of_1f1b():
    # Costs F = I = W = 1, B = 2 (the defaults).
    for p, m in [(4, 8), (8, 32), (2, 4), (4, 16)]:
        zb, base = ZeroBubbleH1(p, m).simulate(), jp.OneFOneB(p, m).simulate()
        assert zb.idle_time <= Fraction(2, 5) * base.idle_time
        # The paper: (p-1)(F+B-2W) per device vs 1F1B's (p-1)(F+B): exactly 1/3.
        assert zb.idle_time == p * (p - 1) * 1 and base.idle_time == p * (p - 1) * 3
        assert np.isclose(float(zb.idle_time), zb.bubble_fraction * float(zb.makespan) * p)
        # Memory: never above 1F1B's peak (device 0), which it equals.
        assert max(zb.peak_in_flight) <= max(base.peak_in_flight)
        assert zb.peak_in_flight[0] == base.peak_in_flight[0] == p
    acts = ZeroBubbleH1(4, 8).actions()
    assert not any(a.kind == "B" for a in sum(acts.values(), []))  # every backward split


def test_dualpipe_v_placement_memory_and_bubble():
    for p in range(1, 7):
        for m in (2 * p, 2 * p + 1, 4 * p):
            sched = DualPipeV(p, m)
            for d in range(p):
                assert sched.device_stages(d) == [d, 2 * p - 1 - d]
            t = sched.simulate()
            # Half-size stages: 2 of its stage-microbatches make one of 1F1B's.
            # DeepSeek's table: DualPipeV activation memory PP + 1 (1F1B: PP).
            assert max(t.peak_in_flight) == 2 * p + 1
            assert Fraction(max(t.peak_in_flight), 2) <= p + 1
            if p > 1:
                assert t.bubble_fraction < jp.OneFOneB(p, m).simulate().bubble_fraction / 3


def test_dualpipe_v_turn_is_a_local_hand_off():
    """Stages p-1 and p share device p-1: the 2m messages across the turn (m activations
    down, m cotangents back) stay on that device; every other edge is a ppermute."""
    from jaxpipe.runtime.spmd.lowering import lower

    p, m = 4, 8
    lowered = lower(DualPipeV(p, m), {})
    local = [msg for msg in lowered.messages if msg.src == msg.dst]
    assert len(local) == 2 * m
    assert {msg.src for msg in local} == {p - 1}
    assert sorted(lowered.perm_offsets) == [1, p - 1]  # +1 and -1 only


def test_v_half_memory_and_bubble():
    for p in range(2, 9):
        m = 4 * p
        t, base = VHalf(p, m).simulate(), jp.OneFOneB(p, m).simulate()
        assert max(t.peak_in_flight) == p + 2 - p % 2  # half-size stage-microbatches
        # In 1F1B stage-microbatches: (p + 2) / 2, below 1F1B's p from p = 3 on.
        assert Fraction(max(t.peak_in_flight), 2) <= max(base.peak_in_flight)
        if p >= 3:
            assert Fraction(max(t.peak_in_flight), 2) < max(base.peak_in_flight)
        assert t.bubble_fraction < base.bubble_fraction


# ------------------------------------------------------------------------------- runtime


def _mlp(n_layers: int, batch: int, width: int = 4):
    keys = jax.random.split(jax.random.PRNGKey(n_layers + batch), n_layers + 2)
    params = [
        {
            "w": jax.random.normal(keys[i], (width, width)) / np.sqrt(width),
            "b": jnp.full((width,), 0.01 * (i + 1)),
        }
        for i in range(n_layers)
    ]
    batch_ = {
        "x": jax.random.normal(keys[-2], (batch, width)),
        "y": jax.random.normal(keys[-1], (batch, width)),
    }
    return params, batch_


def _loss(params, mb):
    h = mb["x"]
    for i, layer in enumerate(params):
        if i:
            h = jp.boundary(h)  # one marker between layers: one layer per stage
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    return jnp.mean((h - mb["y"]) ** 2)


RUNTIME_CASES = [
    (cls, p, m)
    for cls, ms in [
        (Eager1F1B, lambda p: (p, 2 * p + 1)),
        (LoopedBFS, lambda p: (2, p + 1)),
        (ZeroBubbleH1, lambda p: (p - 1, 2 * p)),
        (DualPipeV, lambda p: (2 * p, 2 * p + 1)),
        (VHalf, lambda p: (1, p + 1)),
    ]
    for p in (2, 4)
    for m in ms(p)
]


@pytest.mark.parametrize(
    "cls, p, m", RUNTIME_CASES, ids=[f"{c.__name__}-p{p}-m{m}" for c, p, m in RUNTIME_CASES]
)
def test_runs_on_spmd_runtime_exactly(cls, p, m):
    sched = cls(p, m)
    params, batch = _mlp(sched.num_stages, batch=2 * m)
    pipe = jp.pipeline(
        _loss, params, batch, mesh=jax.make_mesh((p,), ("pipe",)), schedule=sched, cut="markers"
    )
    loss, grads = pipe.value_and_grad(params, batch)
    # Equal microbatches of a mean loss: the microbatch mean is the full-batch loss.
    ref_loss, ref_grads = jax.value_and_grad(_loss)(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------- CLI


def _cli(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("jaxpipe")
    cmd = [exe] if exe else [sys.executable, "-m", "jaxpipe.tools.cli"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [*cmd, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_cli_simulates_gallery_schedule(tmp_path):
    proc = _cli("simulate", "schedules/zero_bubble.py:ZeroBubbleH1", "-p", "4", "-m", "8")
    assert proc.returncode == 0, proc.stderr
    assert "0I0" in proc.stdout and "0W7" in proc.stdout
    assert "makespan        27" in proc.stdout
    assert "bubble fraction 0.1111" in proc.stdout

    plot = tmp_path / "zb.png"
    proc = _cli(
        "simulate", "schedules/dualpipe_v.py:DualPipeV", "-p", "4", "-m", "8", "--plot", str(plot)
    )
    assert proc.returncode == 0, proc.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    proc = _cli("simulate", "schedules/dualpipe_v.py:DualPipeV", "-p", "4", "-m", "6")
    assert proc.returncode == 2 and "m=6 < 2*p=8" in proc.stderr


def test_docs_table_matches_the_simulator():
    """The table in docs/custom_schedules.md is what ``schedules/table.py`` prints now."""
    sys.path.insert(0, str(GALLERY))
    try:
        import table
    finally:
        sys.path.remove(str(GALLERY))
    docs = (ROOT / "docs" / "custom_schedules.md").read_text()
    for p, m in [(4, 8), (8, 32)]:
        assert table.markdown(p, m) in docs, f"docs table for p={p}, m={m} is stale"


def test_docs_example_runs(tmp_path, monkeypatch):
    """The ```python blocks of docs/custom_schedules.md, run in order, as a user would."""
    import re

    monkeypatch.chdir(tmp_path)  # the example writes a plot
    docs = (ROOT / "docs" / "custom_schedules.md").read_text()
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", docs, re.S):
        exec(compile(block, "docs/custom_schedules.md", "exec"), namespace)  # noqa: S102
    assert (tmp_path / "split_1f1b.png").exists()
    assert namespace["timeline"].peak_in_flight == [4, 3, 2, 1]
    np.testing.assert_allclose(namespace["loss"], namespace["ref_loss"], rtol=1e-5)
    for g, r in zip(
        jax.tree.leaves(namespace["grads"]), jax.tree.leaves(namespace["ref_grads"]), strict=True
    ):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
    namespace["MyV"](3, 4).validate()
