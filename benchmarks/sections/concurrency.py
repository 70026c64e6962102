"""Real concurrency on CPU: a p=2 pipeline over 2 processes x 1 device (jax.distributed, gloo).

Virtual CPU devices in one process measure executor overhead, not overlap. Here each
pipeline device is its own process with one single-threaded CPU device, pinned to its
own core, talking over loopback with gloo collectives; a third run does the same work
in one process on one core: jaxpipe with p=1 and plain JAX on one device, and the same
p=2 program on two virtual devices taking turns. The speed-up of the 2-process pipeline
over the 1-process runs, against the ideal ``2m / (m + 1)`` of a 2-stage pipeline with m
microbatches, says how much of the schedule's overlap is real. Against p=1 it also counts
what halving each device's working set does for the caches (on a CPU with 2 MiB of L2 a
core, 8 GPT blocks take 3x the time of 4 in one process); against the p=2 program on one
core, each device keeps its working set and only the overlap counts.

``run_concurrency(...)`` (used by ``benchmarks/run.py``) spawns the processes with a
timeout. Each role can also be run by hand::

    python benchmarks/sections/concurrency.py --role single --out /tmp/single.json
    python benchmarks/sections/concurrency.py --role worker --process-id 0 \
        --port 12355 --out /tmp/w0.json &
    python benchmarks/sections/concurrency.py --role worker --process-id 1 \
        --port 12355 --out /tmp/w1.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    """One pipeline device: run the p=2 pipeline; process 0 reports the timings."""
    from benchmarks.cpu_setup import pin_to_core

    core = pin_to_core(args.process_id if args.pin else None)
    import jax

    from jaxpipe import distributed as jpd

    jpd.initialize(f"127.0.0.1:{args.port}", 2, args.process_id,
                   initialization_timeout=args.init_timeout)
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxpipe as jp
    from benchmarks import common as C

    cfg = C.GPTConfig(**json.loads(args.config))
    m = args.microbatches
    params_local = C.init_params(cfg, jax.random.key(0), embed=False)
    batch_local = C.make_blocks_batch(cfg, m * args.mb_size)
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("pipe",), devices=devices)
    rep = NamedSharding(mesh, P())

    def global_replicated(x: Any) -> jax.Array:
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, rep, lambda idx: host[idx])

    params = jax.tree.map(global_replicated, params_local)
    batch = jax.tree.map(global_replicated, batch_local)
    loss_fn = C.blocks_loss(cfg)
    ref = float(jax.jit(C.plain_value_and_grad(loss_fn, m))(params_local, batch_local)[0])
    runs: dict[str, Any] = {}
    for spec in args.schedules.split(","):
        sched = jp.load_schedule(spec)(len(devices), m)
        t0 = time.perf_counter()
        pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=sched, cut="markers")
        build_s = time.perf_counter() - t0
        timings, compile_s = _time_programs(pipe, params, batch, args)
        loss, _ = timings.pop("_compiled_vg")(params, batch)
        runs[spec] = {"schedule": type(sched).__name__, "build_s": build_s,
                      "compile_s": compile_s,
                      "loss": float(np.asarray(loss.addressable_data(0))),
                      "num_ticks": int(pipe.inspect.executor.lowering.num_ticks),
                      **timings["resident"],
                      "value_and_grad": timings["value_and_grad"]}
        del pipe
    return {
        "process_id": args.process_id, "num_processes": jax.process_count(),
        "global_devices": len(devices), "core": core, "reference_loss": ref, "runs": runs,
        "ppermute_latency_s": _ppermute_latency(mesh, (args.mb_size, cfg.seq, cfg.d_model),
                                                cfg.dtype),
    }


def _time_programs(pipe: Any, params: Any, batch: Any, args: argparse.Namespace,
                   public: bool = True) -> tuple[dict[str, Any], float]:
    """Time the resident step and the public ``value_and_grad`` of ``pipe`` round-robin.

    ``resident``: parameters already in the stage layout (``Pipeline.shard``), stage-layout
    gradients out -- what a training loop runs (``train_step`` keeps them resident).
    ``value_and_grad``: the public call, user pytree in, gathered gradients out (compiled
    and timed only with ``public``; its compiled program is ``_compiled_vg``).
    """

    from benchmarks import common as C

    pbuf = pipe.shard(params)
    c_res, _, compile_s = C.compile_timed(pipe.inspect.staged_value_and_grad_fn, pbuf, batch)
    progs = {"resident": (c_res, (pbuf, batch))}
    if public:
        c_vg, _, _ = C.compile_timed(pipe.inspect.value_and_grad_fn, params, batch)
        progs["value_and_grad"] = (c_vg, (params, batch))
    timings = C.time_interleaved(progs, warmup=args.warmup, repeats=args.repeats)
    if public:
        timings["_compiled_vg"] = c_vg
    return timings, compile_s


def _ppermute_latency(mesh: Any, shape: tuple[int, ...], dtype: str, n: int = 50) -> float:
    """Seconds per ``ppermute`` of one activation message between the two processes."""
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    p = mesh.shape["pipe"]

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("pipe"), out_specs=P("pipe"))
    def ring(x: jax.Array) -> jax.Array:
        perm = [(i, (i + 1) % p) for i in range(p)]
        return lax.fori_loop(0, n, lambda _, y: lax.ppermute(y, "pipe", perm) + 1, x)

    x = jax.make_array_from_callback((p, *shape), NamedSharding(mesh, P("pipe")),
                                     lambda idx: np.zeros((1, *shape), dtype))
    jax.block_until_ready(ring(x))
    t0 = time.perf_counter()
    for _ in range(3):
        jax.block_until_ready(ring(x))
    return (time.perf_counter() - t0) / (3 * n)


def _single(args: argparse.Namespace) -> dict[str, Any]:
    """The same work in one process on one core: jaxpipe p=1 and plain JAX on one device,
    and the p=2 program with its two devices taking turns."""
    from benchmarks.cpu_setup import pin_to_core

    core = pin_to_core(0 if args.pin else None)
    import jax

    import jaxpipe as jp
    from benchmarks import common as C

    cfg = C.GPTConfig(**json.loads(args.config))
    m = args.microbatches
    params = C.init_params(cfg, jax.random.key(0), embed=False)
    batch = C.make_blocks_batch(cfg, m * args.mb_size)
    loss_fn = C.blocks_loss(cfg)
    mesh = jax.make_mesh((1,), ("pipe",), devices=jax.devices()[:1])
    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=jp.OneFOneB(1, m),
                       cut="markers")
    timings, compile_s = _time_programs(pipe, params, batch, args)
    timings.pop("_compiled_vg")
    out: dict[str, Any] = {"core": core,
                           "jaxpipe_p1": {"compile_s": compile_s, **timings["resident"],
                                          "value_and_grad": timings["value_and_grad"]}}
    compiled, _, compile_s = C.compile_timed(jax.jit(C.plain_value_and_grad(loss_fn, m)),
                                             params, batch)
    out["plain"] = {"compile_s": compile_s,
                    **C.time_compiled(compiled, params, batch, warmup=args.warmup,
                                      repeats=args.repeats)}
    # The 2-process program itself, its two devices taking turns on this one core: each
    # device's working set is the one it has in the 2-process run, so cache effects (a
    # half model fits caches a whole one misses) do not count as concurrency.
    mesh2 = jax.make_mesh((2,), ("pipe",), devices=jax.devices()[:2])
    out["one_core_p2"] = {}
    for spec in args.schedules.split(","):
        pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh2,
                           schedule=jp.load_schedule(spec)(2, m), cut="markers")
        timings, compile_s = _time_programs(pipe, params, batch, args, public=False)
        out["one_core_p2"][spec] = {"compile_s": compile_s, **timings["resident"]}
        del pipe
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# glibc returns freed blocks above its mmap threshold (at most 32 MiB) to the kernel, so a
# program whose temporaries exceed that (GPipe's m residual sets: ~165 MB here) gets fresh
# zero-filled pages on every call: ~90k minor faults and a quarter of a second of system
# time per step, on the pipeline and on plain JAX alike. Accelerator allocators (BFC) keep
# their pool; these settings make the CPU runs do the same (one arena, no mmap, no trim).
KEEP_FREED_PAGES = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0",
                    "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}


def _env(keep_freed_pages: bool = True, devices: int = 1) -> dict[str, str]:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from benchmarks.cpu_setup import with_flags

    env = dict(os.environ)
    # the parent's compile effort (the quick run's level 0 and emitter) carries over
    effort = re.findall(r"--xla_backend_optimization_level=\d+|--xla_cpu_use_fusion_emitters=\w+",
                        env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = with_flags(f"--xla_force_host_platform_device_count={devices}", *effort)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(x for x in (env.get("PYTHONPATH"), str(REPO)) if x)
    for k in KEEP_FREED_PAGES:
        env.pop(k, None)
    if keep_freed_pages:
        env.update(KEEP_FREED_PAGES)
    return env


DEFAULT_SCHEDULES = ("1f1b", "gpipe", "schedules/zero_bubble.py:ZeroBubbleH1")


def run_concurrency(config: dict[str, Any], microbatches: int, mb_size: int, *,
                    schedules: tuple[str, ...] = DEFAULT_SCHEDULES, warmup: int = 1,
                    repeats: int = 5, timeout: float = 300.0, pin: bool = True,
                    workdir: str | Path | None = None, retries: int = 1, runs: int = 1,
                    keep_freed_pages: bool = True) -> dict[str, Any]:
    """:func:`_run_concurrency_once` ``runs`` times; the figures are the run-wise medians.

    Each run spawns fresh processes (its own compile, its own timings), so the median over
    runs absorbs what one run's neighbours on the machine did. A run whose processes fail
    (e.g. the coordinator port was taken between choosing and binding it) is retried up to
    ``retries`` times; every failed attempt's error is kept in ``failed_attempts``.
    The returned dict is the median run's (by the headline ``fraction_of_ideal``), plus
    ``runs`` (each run's per-schedule fractions) and, per schedule, ``median_speedup`` and
    ``median_fraction_of_ideal``. ``keep_freed_pages`` (default) runs every process with
    :data:`KEEP_FREED_PAGES`, so no run pays the kernel to zero-fill its temporaries anew
    on each call.
    """
    import statistics

    if runs < 1:
        raise ValueError(f"runs={runs}: ask for at least one run")
    failed: list[dict[str, Any]] = []
    done: list[dict[str, Any]] = []
    base = Path(workdir) if workdir is not None else None
    for i in range(runs):
        for _ in range(retries + 1):
            res = _run_concurrency_once(
                config, microbatches, mb_size, schedules=schedules, warmup=warmup,
                repeats=repeats, timeout=timeout, pin=pin, keep_freed_pages=keep_freed_pages,
                workdir=None if base is None else base / f"run{i}")
            if res["error"] is None:
                done.append(res)
                break
            failed.append({"error": res["error"], "log_tail": res.get("log_tail", "")})
        else:
            res["failed_attempts"] = failed
            return res  # a run that keeps failing: report it rather than a partial median
    done.sort(key=lambda r: r["fraction_of_ideal"])
    out = done[(len(done) - 1) // 2]
    out["failed_attempts"] = failed
    out["keep_freed_pages"] = keep_freed_pages
    keys = ("speedup", "fraction_of_ideal", "speedup_vs_one_core",
            "fraction_of_ideal_vs_one_core")
    out["runs"] = [{spec: {k: v[k] for k in keys} for spec, v in r["per_schedule"].items()}
                   for r in done]
    for spec, v in out["per_schedule"].items():
        for k in keys:
            v[f"median_{k}"] = statistics.median(r[spec][k] for r in out["runs"])
    return out


def _run_concurrency_once(config: dict[str, Any], microbatches: int, mb_size: int, *,
                          schedules: tuple[str, ...], warmup: int, repeats: int,
                          timeout: float, pin: bool, keep_freed_pages: bool,
                          workdir: str | Path | None) -> dict[str, Any]:
    """Spawn the 2-process pipeline and the 1-process run; return timings and speed-ups.

    ``schedules`` are ``jp.load_schedule`` specs (relative paths from the repo root), all
    run by the same two processes; the first one is the headline. Returns a dict with
    ``two_process`` (process 0's report: per-schedule timings, loss vs the plain-JAX
    reference, gloo ppermute latency), ``single`` (jaxpipe p=1 and plain JAX in one
    process), ``per_schedule`` (speed-up over the 1-process jaxpipe p=1, fraction of the
    ideal 2m/(m+1), and the lock-step bound of that schedule), and the headline
    ``speedup`` / ``ideal`` / ``fraction_of_ideal``; on failure ``error`` holds the reason
    and ``log_tail`` the end of the processes' output.
    """
    import tempfile

    workdir = Path(workdir or tempfile.mkdtemp(prefix="jaxpipe_conc_"))
    workdir.mkdir(parents=True, exist_ok=True)
    schedules = tuple(x for x in schedules
                      if ":" not in x or (REPO / x.split(":")[0]).exists())
    common = ["--config", json.dumps(config), "--microbatches", str(microbatches),
              "--schedules", ",".join(schedules),
              "--mb-size", str(mb_size), "--warmup", str(warmup), "--repeats", str(repeats)]
    if not pin:
        common.append("--no-pin")
    script = str(Path(__file__).resolve())
    result: dict[str, Any] = {"microbatches": microbatches, "mb_size": mb_size,
                              "ideal": 2 * microbatches / (microbatches + 1), "pinned": pin,
                              "two_process": None, "single": None, "speedup": None,
                              "speedup_vs_plain": None, "fraction_of_ideal": None,
                              "schedules": list(schedules), "per_schedule": {},
                              "error": None}
    port = _free_port()
    logs = [workdir / f"worker{i}.log" for i in range(2)]
    outs = [workdir / f"worker{i}.json" for i in range(2)]
    procs = []
    t0 = time.perf_counter()
    for i in range(2):
        with open(logs[i], "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, script, "--role", "worker", "--process-id", str(i),
                 "--port", str(port), "--out", str(outs[i]), *common],
                env=_env(keep_freed_pages), stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    try:
        for pr in procs:
            pr.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
    except subprocess.TimeoutExpired:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
                pr.wait()
        result["error"] = f"2-process run timed out after {timeout:.0f}s"
    codes = [pr.returncode for pr in procs]
    if result["error"] is None and any(codes):
        result["error"] = f"2-process run failed with exit codes {codes}"
    if result["error"] is not None:
        result["log_tail"] = "\n".join(
            f"--- worker {i}\n" + logs[i].read_text()[-3000:] for i in range(2))
        return result
    result["two_process"] = json.loads(outs[0].read_text())
    single_out = workdir / "single.json"
    try:
        proc = subprocess.run(
            [sys.executable, script, "--role", "single", "--out", str(single_out), *common],
            env=_env(keep_freed_pages, devices=2), cwd=REPO, capture_output=True, text=True,
            timeout=timeout)
    except subprocess.TimeoutExpired:
        result["error"] = f"1-process run timed out after {timeout:.0f}s"
        return result
    if proc.returncode:
        result["error"] = f"1-process run failed with exit code {proc.returncode}"
        result["log_tail"] = (proc.stdout + proc.stderr)[-3000:]
        return result
    single = json.loads(single_out.read_text())
    result["single"] = single
    import jaxpipe as jp

    for spec, run in result["two_process"]["runs"].items():
        speedup = single["jaxpipe_p1"]["median_s"] / run["median_s"]
        vs_one_core = single["one_core_p2"][spec]["median_s"] / run["median_s"]
        bound = lockstep_bound(2, microbatches, schedule=jp.load_schedule(
            str(REPO / spec) if ":" in spec else spec)(2, microbatches))
        vg2, vg1 = run["value_and_grad"], single["jaxpipe_p1"]["value_and_grad"]
        result["per_schedule"][spec] = {
            "median_s": run["median_s"], "cpu_median_s": run["cpu_median_s"],
            "value_and_grad_median_s": vg2["median_s"],
            "speedup_value_and_grad": vg1["median_s"] / vg2["median_s"],
            "speedup": speedup, "speedup_vs_plain": single["plain"]["median_s"] / run["median_s"],
            "fraction_of_ideal": speedup / result["ideal"],
            "speedup_vs_one_core": vs_one_core,
            "fraction_of_ideal_vs_one_core": vs_one_core / result["ideal"],
            "fraction_of_lockstep_ideal": speedup / bound["lockstep_ideal"], **bound}
    head = result["per_schedule"][schedules[0]]
    result["speedup"] = head["speedup"]
    result["speedup_vs_plain"] = head["speedup_vs_plain"]
    result["fraction_of_ideal"] = head["fraction_of_ideal"]
    result["lockstep_ideal"] = head["lockstep_ideal"]
    return result


def lockstep_bound(p: int, m: int, f_cost: float = 1.0, b_cost: float = 2.0,
                   schedule: Any = None, split_backward: bool = False) -> dict[str, Any]:
    """Best speed-up the lowered SPMD program can reach (default 1F1B) with F:B = 1:2.

    ``lockstep_ideal`` = total work / the lowered program's makespan under the sync
    model of :mod:`jaxpipe.runtime.spmd.lowering.sync` (devices run their steps back to back and
    wait only where a ``ppermute`` is active, for its source and target), with the
    backward unsplit as the runtime runs it on CPU (``split_backward=True``: as on
    accelerators).
    ``free_ideal`` is the schedule run as soon as inputs are ready (``Schedule.simulate``
    with the same costs). Neither counts the transfers themselves.
    """
    import jaxpipe as jp
    from jaxpipe.runtime.spmd.lowering import lower
    from jaxpipe.runtime.spmd.lowering.sync import sync_report

    sched = schedule if schedule is not None else jp.OneFOneB(p, m)
    cost = {"F": f_cost, "B": b_cost, "I": b_cost / 2, "W": b_cost / 2}
    total = sum(cost[a.kind] for d in range(sched.num_devices)
                for a in sched.device_actions(d))
    rep = sync_report(sched, lower(sched, {}, split_backward=split_backward), cost)
    return {"lockstep_ideal": total / rep.lowered_makespan,
            "free_ideal": total / rep.async_makespan, "cost_model": cost,
            "sync_model": "waits only at active ppermutes (source and target)",
            "split_backward": split_backward}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["worker", "single", "both"], default="both")
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--port", type=int, default=12355)
    ap.add_argument("--config", default="{}", help="GPTConfig fields as JSON")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES),
                    help="comma-separated jp.load_schedule specs")
    ap.add_argument("--mb-size", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--init-timeout", type=int, default=120)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--no-pin", dest="pin", action="store_false")
    ap.add_argument("--runs", type=int, default=3,
                    help="fresh 2-process + 1-process runs; figures are their medians")
    ap.add_argument("--glibc-default", dest="keep_freed_pages", action="store_false",
                    help="run with glibc's default allocator settings (freed temporaries "
                         "go back to the kernel and are zero-filled anew on every call)")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args(argv)
    if args.role == "both":
        res = run_concurrency(json.loads(args.config), args.microbatches, args.mb_size,
                              schedules=tuple(args.schedules.split(",")), warmup=args.warmup,
                              repeats=args.repeats, timeout=args.timeout,
                              pin=args.pin, runs=args.runs,
                              keep_freed_pages=args.keep_freed_pages)
    else:
        if str(REPO) not in sys.path:
            sys.path.append(str(REPO))
        res = _worker(args) if args.role == "worker" else _single(args)
    text = json.dumps(res, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0 if res.get("error") is None else 1


# ------------------------------------------------------------ the section in benchmarks/run.py
ORDER = 50
CPU_ONLY = True  # gloo processes on CPU; elsewhere the runner records why it did not run
FIELDS = ("microbatches", "ideal", "speedup", "fraction_of_ideal", "two_process", "single",
          "per_schedule", "error", "settings")


@dataclass(frozen=True)
class ConcurrencySettings:
    """The concurrency section's own sizes (recorded in its result under ``"settings"``)."""

    m: int = 8  # microbatches
    mb: int = 8  # bigger microbatches: per-tick compute must dwarf gloo latency
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    timeout: float = 300.0
    runs: int = 3  # fresh process sets; the figures are their medians

    @classmethod
    def for_run(cls, quick: bool) -> ConcurrencySettings:
        """A full run's values, or the smoke test's (``--quick``)."""
        if quick:
            return cls(m=4, mb=2, schedules=("1f1b",), timeout=120.0, runs=1)
        return cls()


def run(r: Any) -> dict[str, Any]:
    """2 processes x 1 device (gloo) against one process; logs under ``<out>/concurrency_logs``."""
    from benchmarks.harness import log, section_settings

    s = r.s
    own = section_settings(s, "concurrency", ConcurrencySettings.for_run)
    res = run_concurrency(s.model.asdict(), own.m, own.mb, schedules=own.schedules,
                          warmup=s.warmup, repeats=s.repeats, timeout=own.timeout,
                          workdir=r.out / "concurrency_logs", runs=own.runs)
    res["settings"] = asdict(own)
    if res.get("error"):
        log(f"concurrency: {res['error']}")
        return res
    for spec, v in res["per_schedule"].items():
        log(f"concurrency {spec}: speedup {v['median_speedup_vs_one_core']:.2f} over the "
            f"same program on one core, {v['median_speedup']:.2f} over p=1, vs ideal "
            f"{res['ideal']:.2f} ({v['median_fraction_of_ideal_vs_one_core']:.2f} / "
            f"{v['median_fraction_of_ideal']:.2f} of ideal, medians of "
            f"{len(res['runs'])} runs; lock-step bound {v['lockstep_ideal']:.2f})")
    return res


def summary(cc: dict[str, Any]) -> str:
    from benchmarks.harness import fmt

    if not cc.get("per_schedule"):
        return f"**Real concurrency**: {cc.get('error')}"
    single = cc["single"]
    lines = [f"**Real concurrency** (2 processes x 1 device, gloo, p=2, "
             f"m={cc['microbatches']}, {cc['mb_size']} seq/microbatch, resident step; "
             f"1 process: jaxpipe p=1 {single['jaxpipe_p1']['median_s'] * 1e3:.0f} ms, "
             f"plain JAX {single['plain']['median_s'] * 1e3:.0f} ms; gloo ppermute "
             f"{cc['two_process']['ppermute_latency_s'] * 1e3:.2f} ms)", "",
             "| schedule | 2-proc ms | speed-up over the p=2 program on one core | "
             "over p=1 | ideal 2m/(m+1) | fraction of ideal (one core / p=1) | "
             "lock-step bound | speed-up, public value_and_grad |",
             "|---|---|---|---|---|---|---|---|"]
    for spec, v in cc["per_schedule"].items():
        lines.append(f"| {spec.split(':')[-1]} | {v['median_s'] * 1e3:.0f} | "
                     f"{v['median_speedup_vs_one_core']:.2f} | "
                     f"{v['median_speedup']:.2f} | {cc['ideal']:.2f} | "
                     f"{v['median_fraction_of_ideal_vs_one_core']:.2f} / "
                     f"{v['median_fraction_of_ideal']:.2f} | {v['lockstep_ideal']:.2f} | "
                     f"{fmt(v.get('speedup_value_and_grad'))} |")
    return "\n".join(lines)


def plot(cc: dict[str, Any], save: Any) -> None:
    import matplotlib.pyplot as plt

    if not cc.get("speedup"):
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    single = cc["single"]["jaxpipe_p1"]["median_s"]
    vals = [1.0, cc["speedup"], cc["ideal"], cc["speedup_vs_plain"]]
    ax.bar(["1 process\n(jaxpipe p=1)", "2 processes\n(gloo, p=2)", "ideal\n2m/(m+1)",
            "2 proc vs\nplain JAX"], vals)
    ax.set_ylabel("speed-up")
    ax.set_title(f"Real concurrency, m={cc['microbatches']} "
                 f"(1-proc step {1e3 * single:.0f} ms)")
    save(fig, "concurrency.png")


if __name__ == "__main__":
    sys.exit(main())
