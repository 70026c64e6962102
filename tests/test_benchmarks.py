"""Benchmarks: the SPMD GPipe baseline is correct, and ``run.py --quick`` completes.

No timing is asserted anywhere: speed and memory are what the benchmark *reports*.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import common as C
from benchmarks.baselines import spmd_gpipe as B

REPO = Path(__file__).resolve().parent.parent


def _stage_fn(cfg: C.GPTConfig):
    def stage(sp, x):
        for k in range(jax.tree.leaves(sp)[0].shape[0]):
            x = C.block(jax.tree.map(lambda a, k=k: a[k], sp), x, cfg.n_heads)
        return x

    return stage


def _mse(y, t):
    return jnp.mean(jnp.square(y - t))


@pytest.mark.parametrize(("p", "m", "remat"), [(2, 2, False), (2, 6, False), (4, 8, False),
                                               (4, 4, True)])
def test_spmd_gpipe_matches_value_and_grad(p: int, m: int, remat: bool) -> None:
    cfg = C.GPTConfig(d_model=16, n_heads=2, n_layers=4, seq=4)
    params = C.init_params(cfg, jax.random.key(1), embed=False)
    batch = C.make_blocks_batch(cfg, 2 * m, seed=3)
    loss_fn = C.blocks_loss(cfg)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)  # mean of mbs

    mesh = jax.make_mesh((p,), ("pipe",), devices=jax.devices()[:p])
    vg = B.spmd_gpipe_value_and_grad(_stage_fn(cfg), _mse, mesh, m, remat=remat)
    xs = batch["x"].reshape(m, 2, *batch["x"].shape[1:])
    loss, grads = vg(B.stack_stages(params["blocks"], p), xs, batch["y"].reshape(xs.shape))

    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    got = B.unstack_stages(grads)
    assert len(got) == cfg.n_layers
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref_grads["blocks"]), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_spmd_gpipe_uses_ppermute_not_gathers() -> None:
    """The baseline moves activations with collective-permutes only (no all-gather)."""
    cfg = C.GPTConfig(d_model=16, n_heads=2, n_layers=2, seq=4)
    params = C.init_params(cfg, jax.random.key(0), embed=False)
    m, p = 4, 2
    batch = C.make_blocks_batch(cfg, 2 * m)
    mesh = jax.make_mesh((p,), ("pipe",), devices=jax.devices()[:p])
    vg = B.spmd_gpipe_value_and_grad(_stage_fn(cfg), _mse, mesh, m)
    xs = batch["x"].reshape(m, 2, *batch["x"].shape[1:])
    hlo = vg.lower(B.stack_stages(params["blocks"], p), xs, xs).compile().as_text()
    assert "collective-permute" in hlo
    assert "all-gather" not in hlo


def test_spmd_gpipe_rejects_uneven_microbatches() -> None:
    mesh = jax.make_mesh((4,), ("pipe",), devices=jax.devices()[:4])
    with pytest.raises(ValueError, match="multiple of the 4 stages"):
        B.spmd_gpipe_loss(lambda w, x: x, _mse, mesh, 6)


def test_plain_value_and_grad_is_mean_over_microbatches() -> None:
    cfg = C.GPTConfig(vocab=32, d_model=16, n_heads=2, n_layers=2, seq=4)
    params = C.init_params(cfg, jax.random.key(0))
    batch = C.make_gpt_batch(cfg, 8)
    loss_fn = C.gpt_loss(cfg)
    loss, grads = jax.jit(C.plain_value_and_grad(loss_fn, 4))(params, batch)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)


def test_run_quick_completes_with_every_field(tmp_path: Path) -> None:
    out = tmp_path / "results"
    # the smoke run's own XLA:CPU level (0), not the one conftest gives this process
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_backend_optimization_level="))
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run.py"), "--quick", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, "XLA_FLAGS": flags},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from benchmarks.harness import RUN_FIELDS
    from benchmarks.sections import baseline, discover, remat, sweep

    res = json.loads((out / "benchmarks.json").read_text())
    sections = discover()
    assert {"overhead", "baseline", "sweep", "scaling", "concurrency", "remat", "lowering",
            "step", "compile", "sharded", "eval"} <= set(sections)
    for name, sec in sections.items():
        assert name in res, name
        missing = [f for f in sec.fields if f not in res[name]]
        assert not missing, (name, missing)
        assert (out / f"{name}.json").exists()
    assert {"backend", "num_devices", "quick", "config", "duration_s"} <= set(res["meta"])
    # the shared settings in meta, each section's own in its result
    assert {"p", "mb", "warmup", "repeats"} <= set(res["meta"]["settings"])
    assert res["overhead"]["settings"] == {"m": res["overhead"]["microbatches"],
                                           "mb": res["overhead"]["mb_size"]}
    assert res["sweep"]["settings"]["factor"] == res["sweep"]["microbatches_per_p"]
    assert res["remat"]["settings"]["model"]["seq"] == 16
    ov = res["overhead"]
    assert ov["ratios"]["p1"]["wall"] > 0
    for run in [ov["plain"], *ov["jaxpipe"].values()]:
        assert {"median_s", "cpu_median_s", "compile_s", "memory"} <= set(run)
    for row in res["baseline"]["rows"]:
        assert set(baseline.ROW_FIELDS) <= set(row)
        for run in [row["spmd_gpipe"], *row["jaxpipe"].values()]:
            assert set(RUN_FIELDS) <= set(run), set(RUN_FIELDS) - set(run)
            assert run["memory"]["total_bytes"] > 0
    names = {row["schedule"] for row in res["sweep"]["rows"]}
    assert {"GPipe", "1F1B", "Interleaved1F1B"} <= names
    for row in res["sweep"]["rows"]:
        assert set(sweep.ROW_FIELDS) <= set(row)
    assert len(res["scaling"]["rows"]) >= 2
    cc = res["concurrency"]
    assert cc["error"] is None, cc.get("log_tail")
    two = cc["two_process"]
    for run in two["runs"].values():  # the 2-process pipeline computes the right loss
        assert run["loss"] == pytest.approx(two["reference_loss"], rel=1e-5)
    assert set(cc["per_schedule"]) == set(two["runs"])
    rm = res["remat"]  # recomputation under a budget: every configuration measured
    assert rm["error"] is None
    assert {row["name"] for row in rm["rows"]} >= {"auto", "full", "uniform", "none"}
    for row in rm["rows"]:
        assert set(remat.ROW_FIELDS) <= set(row), set(remat.ROW_FIELDS) - set(row)
        assert row["compiled_bytes"] > 0 and row["flops_per_step"] > 0
    auto = next(row for row in rm["rows"] if row["name"] == "auto")
    assert auto["predicted_fits"] and auto["step_vs_auto_cpu"] == 1.0
    assert res["headline"]["memory_1f1b_vs_baseline_m4p"] is not None
    assert set(res["meta"]["plots"]) >= {"overhead.png", "baseline.png", "scaling.png"}
    summary = (out / "summary.md").read_text()  # every section that summarizes does
    for title in ("Executor overhead", "SPMD GPipe", "Schedule sweep", "Evaluation",
                  "Lowered efficiency", "Compile time"):
        assert title in summary, title


TOY_SECTION = """
import jax
import jax.numpy as jnp

import jaxpipe as jp
from benchmarks.harness import compile_program, mesh

ORDER = 5
FIELDS = ("p", "loss", "temp_bytes")


def run(r):
    p = r.s.p
    params = {"w": jnp.ones((4 * p, 8, 8))}
    batch = jnp.ones((2 * p, 8))

    def loss_fn(params, x):
        for w in params["w"]:
            x = jp.boundary(jnp.tanh(x @ w))
        return jnp.mean(x ** 2)

    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh(p),
                       schedule=jp.OneFOneB(p, 2 * p))
    compiled, info = compile_program(pipe.inspect.value_and_grad_fn, (params, batch))
    loss, _ = compiled(params, batch)
    return {"p": p, "loss": float(loss), "temp_bytes": info["memory"]["temp_bytes"]}


def summary(res):
    return f"**Toy**: p={res['p']}, loss {res['loss']:.4f}"


def plot(res, save):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.bar(["temp"], [res["temp_bytes"]])
    save(fig, "toy.png")
"""


def test_a_section_is_one_file(tmp_path: Path) -> None:
    """A new section is one module (here in a folder given with --more-sections): the
    runner finds it, runs it in its ORDER, checks its FIELDS, and writes its JSON, its
    summary and its plot."""
    from benchmarks import run as R

    folder = tmp_path / "more"
    folder.mkdir()
    (folder / "toy.py").write_text(TOY_SECTION)
    out = tmp_path / "results"
    res = R.main(["--quick", "--sections", "toy", "--more-sections", str(folder),
                  "--out", str(out)])
    assert res["toy"]["p"] == 2 and res["toy"]["temp_bytes"] > 0
    assert json.loads((out / "toy.json").read_text())["loss"] == res["toy"]["loss"]
    assert "**Toy**: p=2" in (out / "summary.md").read_text()
    assert res["meta"]["plots"] == ["toy.png"] and (out / "toy.png").exists()

    (folder / "broken.py").write_text("ORDER = 1\nFIELDS = ('x',)\n"
                                     "def run(r):\n    return {}\n")
    with pytest.raises(KeyError, match="'broken' returned no \\['x'\\]"):
        R.main(["--quick", "--sections", "broken", "--more-sections", str(folder),
                "--out", str(out)])
    (folder / "broken.py").write_text("FIELDS = ()\n")
    with pytest.raises(TypeError, match="does not define ORDER, run"):
        R.main(["--list", "--more-sections", str(folder)])


def test_a_section_owns_its_settings() -> None:
    """A section's sizes come from its module (full run or --quick), with the run's
    overrides for it in ``Settings.extra`` (``run.py --mb-size`` sets overhead's ``mb``)."""
    from benchmarks.harness import default_settings, section_settings
    from benchmarks.sections.overhead import OverheadSettings

    s = default_settings(quick=True)
    assert section_settings(s, "overhead", OverheadSettings.for_run) == OverheadSettings(4, 2)
    s.extra["overhead"] = {"mb": 3}
    assert section_settings(s, "overhead", OverheadSettings.for_run) == OverheadSettings(4, 3)
    assert OverheadSettings.for_run(quick=False) == OverheadSettings(m=8, mb=4)


def test_remat_tradeoff_measures_every_policy() -> None:
    """benchmarks/probes/remat_tradeoff.py: one row per (p, policy), ratios to the first policy;
    saving only matmul outputs stores fewer residual leaves than saving all."""
    from benchmarks.probes import remat_tradeoff as RT

    res = RT.measure([2], ["none", "dots"], layers=2, d_model=32)
    none, dots = res["rows"]
    assert (none["remat"], dots["remat"]) == ("none", "dots")
    assert none["xla_s_ratio"] == 1.0 and dots["step_s"] > 0 and dots["temp_bytes"] > 0
    assert sum(dots["residual_leaves"]) < sum(none["residual_leaves"])
    # the fused last stage (p=1: the only stage) against separate F and B steps
    off, on = RT.measure([1], ["none"], layers=2, d_model=32, fuses=(False, True))["rows"]
    assert (off["fused_stages"], on["fused_stages"]) == ([], [0])
    assert on["temp_bytes"] < off["temp_bytes"]


def test_late_delivery_prices_the_lowering_as_the_sync_model_does() -> None:
    """benchmarks/probes/late_delivery.py's what-if starts from the library's sync model: with
    every message exchanged at the end of its tick it gives the lowered makespan
    (transfers included), a tick-late exchange where the reader has slack is never slower,
    and its "late" ticks put every reader two ticks after another device's writer."""
    import jaxpipe as jp
    from benchmarks.probes import late_delivery as LD
    from jaxpipe.runtime.spmd.lowering import expand, lower
    from jaxpipe.runtime.spmd.lowering.sync import lowered_makespan, split_cost
    from jaxpipe.schedule.simulate import resolve_costs

    cost = resolve_costs(None)
    dualpipe = jp.load_schedule(str(REPO / "schedules" / "dualpipe_v.py:DualPipeV"))
    for sched in (jp.OneFOneB(4, 8), dualpipe(4, 8)):
        run, split = expand(sched, True)
        graph, c = run.graph(), split_cost(cost, split)
        ticks = LD.reader_ticks(graph, 1)
        low = lower(sched, {}, split_backward=True)
        for transfer in (0.0, 0.3):
            now = LD.makespan(graph, ticks, c, transfer, "none")
            assert now == pytest.approx(lowered_makespan(low, cost, transfer))
            assert LD.makespan(graph, ticks, c, transfer, "slack") <= now + 1e-9
        late = LD.reader_ticks(graph, 2)
        for k in range(len(graph.actions)):
            for q in graph.data_deps[k]:
                if q >= 0 and graph.devices[q] != graph.devices[k]:
                    assert late[k] >= late[q] + 2


def test_step_overhead_takes_medians_across_processes() -> None:
    from benchmarks.sections.step import RATIOS, across_processes

    def run(x: float) -> dict:
        row = {"B_cpu_s": x, **{k: 2 * x for k in RATIOS["split_backward"]}}
        return {"p1_overhead": {"model": "mlp", **{k: x for k in RATIOS["p1_overhead"]}},
                "split_backward": {"rows": {"mlp": row}}}

    out = across_processes([run(1.0), run(3.0), run(1.5)])
    assert out["processes"] == 3
    assert out["p1_overhead"]["ratio_cpu"] == 1.5
    assert out["p1_overhead"]["ratio_cpu_runs"] == [1.0, 3.0, 1.5]
    row = out["split_backward"]["rows"]["mlp"]
    assert row["ratio_cpu"] == 3.0 and row["same_tick_ratio_cpu_runs"] == [2.0, 6.0, 3.0]
    assert row["B_cpu_s"] == 1.0  # not a ratio: the first process's


def test_first_call_probe_reads_xla_phases_from_its_trace() -> None:
    """benchmarks/probes/first_call.py --xla-phases reads XLA's own trace events: a program
    with a fused elementwise op compiles at least one kernel, and each phase is a part of
    XLA's compile (a jaxlib that renames the events fails here, not silently reads 0). In a
    process of XLA's default flags, as the probe's are: the suite's elemental emitter
    (tests/conftest.py) builds kernels without the fusion emitters' events."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, jax, jax.numpy as jnp\n"
            "from benchmarks.probes.first_call import xla_trace\n"
            "x = jnp.ones((16, 16))\n"
            "print(json.dumps(xla_trace(jax.jit(lambda a: jnp.tanh(a @ a) * 2.0 + a)"
            ".lower(x))))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, "JAX_PLATFORMS": "cpu"}, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["num_kernels"] >= 1 and len(r["kernel_names"]) == r["num_kernels"]
    assert r["xla"] > 0 and r["llvm"] > 0
    for phase in ("hlo_passes", "kernels", "llvm", "emit"):
        assert 0 <= r[phase] <= r["xla"] * 2  # kernels: thread-seconds over two threads


@pytest.mark.parametrize("scanned", [False, True], ids=["unrolled", "scanned"])
def test_first_call_floor_is_a_real_pipeline(scanned: bool) -> None:
    """benchmarks/probes/first_call_floor.py's hand-written pipeline, whose compile time is
    the floor the closing notes cite, computes what jax.value_and_grad does (stored
    activations and the backward written out by hand; recomputation under jax.vjp)."""
    import jax
    import numpy as np

    from benchmarks.probes.first_call import model
    from benchmarks.probes.first_call_floor import floor_pipeline

    L, m = 4, 2
    params, batch, loss = model(L, m, scanned, width=8, rows=4)
    want = jax.value_and_grad(lambda p: sum(
        loss(p, jax.tree.map(lambda a, i=i: a[4 * i:4 * (i + 1)], batch))
        for i in range(m)) / m)(params)
    for gating, stored in (("while", True), ("masked", False)):
        f, mesh, _, _ = floor_pipeline(L, m, 2, gating, scanned, stored=stored)
        with jax.set_mesh(mesh):
            got = jax.jit(f)(params, batch)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


def test_peer_comparison_finds_the_steps_collectives_in_the_profile() -> None:
    """benchmarks/baselines/torch_pipelining.py --profile-steps reads the collectives' time
    from XLA:CPU's thunk events: a program of one ppermute and one psum, run 3 steps, is
    found as 3 permutes and 3 all-reduces a device (a jaxlib that renames the events fails
    here, not silently reads 0)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from benchmarks.baselines.torch_pipelining import _in_collectives

    mesh = jax.make_mesh((2,), ("pipe",), devices=jax.devices()[:2])

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("pipe"), out_specs=P())
    def run(x):
        y = jax.lax.ppermute(x, "pipe", [(0, 1), (1, 0)])
        return jax.lax.psum(jnp.sum(y * y), "pipe")

    x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, P("pipe")))
    jax.block_until_ready(run(x))
    out = _in_collectives(lambda: jax.block_until_ready(run(x)), 3)
    assert set(out) == {"permute", "all_reduce"}
    (t_p, n_p), (t_a, n_a) = out["permute"], out["all_reduce"]
    assert n_p == n_a == 3 * 2  # one event a device a step
    assert t_p > 0 and t_a > 0
