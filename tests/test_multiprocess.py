"""Multi-process pipelines: ``python -m jaxpipe.launch`` + ``jax.distributed`` on loopback.

2 processes x 2 virtual CPU devices, one p=4 1F1B pipeline across both processes: the
loss and gradients equal the unpipelined model computed here in one process, a few
train steps match optax on the unpipelined model, an orbax checkpoint written by both
processes resumes bit-identically, and both processes exit 0. A
configuration that differs between processes fails with a clear error, well before the
timeout. Every subprocess runs under a timeout, so nothing here can hang the suite.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxpipe import distributed as jpd
from jaxpipe import launch as jpl
from jaxpipe.transport_threads import idle_transport_threads

WORKER = Path(__file__).parent / "support" / "mp_worker.py"
LAUNCH_TIMEOUT = 100  # the launcher kills everything after this (exit 124)
RUN_TIMEOUT = LAUNCH_TIMEOUT + 30  # and this kills the launcher itself


def _worker_module():
    spec = importlib.util.spec_from_file_location("jaxpipe_mp_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _launch(*args: str, nproc: int = 2, devices: int = 2, timeout: float = LAUNCH_TIMEOUT,
            run_timeout: float = RUN_TIMEOUT) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "jaxpipe.launch", "--nproc", str(nproc),
           "--devices-per-proc", str(devices), "--timeout", str(timeout), *args]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=run_timeout,
                          cwd=Path(__file__).parents[1])
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def _check_against_unpipelined(got, loss_fn, params, batch, m, tx, steps) -> None:
    """The workers' results (``report`` in mp_worker.py) against the unpipelined model in
    this process: loss and gradients, ``steps`` train steps of ``tx``, and the resumed
    checkpoint's next loss (bit-identical to the original's)."""

    def full_loss(p, b):  # the pipeline's loss: mean of per-microbatch losses
        mbs = [jax.tree.map(lambda x, i=i: x.reshape(m, -1, *x.shape[1:])[i], b)
               for i in range(m)]
        return jnp.mean(jnp.stack([loss_fn(p, mb) for mb in mbs]))

    loss, grads = jax.value_and_grad(full_loss)(params, batch)
    np.testing.assert_allclose(got["loss"], loss, rtol=1e-5)
    ref = jax.tree.leaves(grads)
    assert len(ref) == sum(k.startswith("grad_") for k in got.files)
    for i, g in enumerate(ref):
        np.testing.assert_allclose(got[f"grad_{i}"], g, rtol=1e-5, atol=1e-7)

    # train_step across processes == optax on the unpipelined model
    opt, p, losses = tx.init(params), params, []
    for _ in range(steps):
        val, g = jax.value_and_grad(full_loss)(p, batch)
        upd, opt = tx.update(g, opt, p)
        p = optax.apply_updates(p, upd)
        losses.append(val)
    np.testing.assert_allclose(got["train_losses"], np.stack(losses), rtol=1e-5)
    for i, x in enumerate(jax.tree.leaves(p)):
        np.testing.assert_allclose(got[f"trained_{i}"], x, rtol=1e-5, atol=1e-6)

    # orbax checkpoint written by both processes, restored, one more step: bit-identical
    original, resumed = got["resumed"]
    assert np.isfinite(original) and original.tobytes() == resumed.tobytes()


def _run_worker(mode: str, out: Path) -> dict:
    """Run ``mp_worker.py mode`` on 2 processes; both must finish; its saved results."""
    rc, log, _ = _launch(str(WORKER), mode, str(out))
    assert rc == 0, log
    assert "[0] process 0/2 done" in log and "[1] process 1/2 done" in log, log
    return np.load(out)


@pytest.mark.parametrize("mode", ["ok", "accelerator", "interleaved"])
def test_two_processes_match_unpipelined(tmp_path, mode):
    """The CPU program and the accelerator program (its every-tick permutes between the
    processes, over gloo), and an interleaved schedule's CPU program with a body per
    chunk (``share_bodies="auto"`` where devices run concurrently): exact, trained,
    restored."""
    got = _run_worker(mode, tmp_path / "result.npz")
    w = _worker_module()
    params, batch = w.make_model()
    _check_against_unpipelined(got, w.loss_fn, params, batch, w.M, optax.sgd(w.LR),
                               w.TRAIN_STEPS)
    assert (tmp_path / "result.npz.ckpt" / "state").is_dir()
    if sys.platform == "linux":  # initialize gave gloo's polling thread SCHED_IDLE
        idle = json.loads((tmp_path / "result.npz.idle.json").read_text())
        assert idle["idle"] >= 1 and idle["in_epoll"] == idle["idle"], idle


@pytest.mark.parametrize("mode", ["sharded", "sharded-explicit"])
def test_two_processes_tensor_parallel_stages(tmp_path, mode):
    """pipe 2 (across the processes) x model 2 (inside each), Auto or Explicit axes
    (sharding in types): exact, trained, restored."""
    got = _run_worker(mode, tmp_path / "sharded.npz")
    w = _worker_module()
    params, batch = w.make_tp_model()
    _check_against_unpipelined(got, w.tp_loss_fn, params, batch, w.M, w.tp_optimizer(),
                               w.TRAIN_STEPS)


@pytest.mark.parametrize(("mode", "what", "field"), [
    # process 1 builds its schedule with another num_microbatches
    ("mismatch", "the pipeline", "num_microbatches: process 0: 4, process 1: 2"),
    # process 1 initialises its train state with Adam, process 0 with SGD
    ("optimizer-mismatch", "pipe.init", "optimizer_state: process 0:"),
])
def test_a_difference_across_processes_fails_clearly(tmp_path, mode, what, field):
    """Every process says what differs, well before the timeout (the programs, or the
    train steps, would never match, and hang)."""
    rc, log, elapsed = _launch(str(WORKER), mode, str(tmp_path / "never.npz"))
    assert rc not in (0, jpl.TIMEOUT_EXIT), log
    assert elapsed < LAUNCH_TIMEOUT, log
    assert f"PipelineError: {what} differs across processes" in log, log
    assert field in log, log
    assert not (tmp_path / "never.npz").exists()


# ----------------------------------------------------------------------------- launcher
def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_launcher_sets_environment_and_prefixes_output(tmp_path):
    script = _script(tmp_path, """
        import json, os, sys
        keys = ["JAXPIPE_COORDINATOR_ADDRESS", "JAXPIPE_NUM_PROCESSES", "JAXPIPE_PROCESS_ID",
                "JAX_PLATFORMS", "XLA_FLAGS"]
        print("env", json.dumps([os.environ[k] for k in keys] + sys.argv[1:]))
    """)
    rc, log, _ = _launch(script, "a", "--b", nproc=3, devices=2, timeout=30, run_timeout=60)
    assert rc == 0, log
    lines = sorted(line for line in log.splitlines() if line[:1] == "[" and " env [" in line)
    assert len(lines) == 3, log
    addrs = set()
    for i, line in enumerate(lines):
        prefix, rest = line.split(" env ", 1)
        assert prefix == f"[{i}]"
        addr, n, pid, plat, flags, *args = json.loads(rest)
        addrs.add(addr)
        assert (n, pid, plat) == ("3", str(i), "cpu")
        assert addr.startswith("127.0.0.1:") and int(addr.rsplit(":", 1)[1]) > 0
        assert flags.split().count("--xla_force_host_platform_device_count=2") == 1
        assert "--xla_force_host_platform_device_count=8" not in flags  # replaced, not added
        assert args == ["a", "--b"]
    assert len(addrs) == 1  # one coordinator for all


def test_launcher_stops_all_on_first_failure(tmp_path):
    script = _script(tmp_path, """
        import os, sys, time
        if os.environ["JAXPIPE_PROCESS_ID"] == "1":
            print("failing", flush=True)
            sys.exit(3)
        time.sleep(120)
    """)
    rc, log, elapsed = _launch(script, timeout=100, run_timeout=60)
    assert rc == 3, log
    assert "[launch] process 1 exited with code 3" in log
    assert elapsed < 30


def test_an_exception_in_one_process_stops_the_run_at_once(tmp_path):
    """Process 1 raises while process 0 waits in a collective: process 1 exits at once
    with code 1 (not minutes later, from JAX's shutdown barrier, after process 0 gave
    up) and the launcher stops process 0 and returns that code."""
    script = _script(tmp_path, """
        import jax
        from jaxpipe import distributed as jpd
        jpd.initialize()
        from jax.experimental import multihost_utils
        if jax.process_index() == 1:
            raise ValueError("boom in process 1")
        multihost_utils.sync_global_devices("never")
    """)
    rc, log, elapsed = _launch(script, devices=1, timeout=100, run_timeout=120)
    assert rc == 1, log
    assert "ValueError: boom in process 1" in log, log
    assert "[launch] process 1 exited with code 1" in log, log
    assert elapsed < 60, log


def test_launcher_timeout_kills_everything(tmp_path):
    script = _script(tmp_path, """
        import time
        print("started", flush=True)
        time.sleep(120)
    """)
    rc, log, elapsed = _launch(script, timeout=2, run_timeout=60)
    assert rc == jpl.TIMEOUT_EXIT, log
    assert "[launch] timeout after 2 s" in log
    assert log.count("started") == 2
    assert elapsed < 30


def test_launcher_usage_errors():
    assert jpl.worker_env({"XLA_FLAGS": "--foo --xla_force_host_platform_device_count=8"},
                          process_id=1, nproc=2, address="127.0.0.1:1",
                          devices_per_proc=4)["XLA_FLAGS"] == (
        "--foo --xla_force_host_platform_device_count=4")
    with pytest.raises(SystemExit):
        jpl.main(["--nproc", "0", "x.py"])
    with pytest.raises(SystemExit):
        jpl.main(["--nproc", "2"])  # no script


# ----------------------------------------------------------------------------- initialize
def test_initialize_without_configuration(monkeypatch):
    for key in (jpd.ENV_COORDINATOR, jpd.ENV_NUM_PROCESSES, jpd.ENV_PROCESS_ID,
                "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(jpd, "_cluster_detected", lambda: False)
    assert jpd.initialize() is False  # single process: nothing to do
    with pytest.raises(jpd.PipelineError, match="no multi-process configuration"):
        jpd.initialize(require=True)
    with pytest.raises(jpd.PipelineError, match="together"):
        jpd.initialize("127.0.0.1:1234")  # address without count and id
    with pytest.raises(jpd.PipelineError, match="transport_threads='low'"):
        jpd.initialize(transport_threads="low")


@pytest.mark.skipif(sys.platform != "linux", reason="SCHED_IDLE and /proc are Linux's")
def test_polling_threads_started_with_the_backend_get_sched_idle():
    """What initialize does to gloo's event loop, on stand-ins: of the threads a CPU
    backend's start creates, the one waiting in epoll gets SCHED_IDLE; the others keep
    their policy, and another backend's start changes nothing."""
    import select
    import threading

    stop = threading.Event()
    threads: dict[str, threading.Thread] = {}

    def poller():
        ep = select.epoll()
        while not stop.is_set():
            ep.poll(0.01)

    def start(cpu: bool):
        threads["poll"] = threading.Thread(target=poller, daemon=True)
        threads["sleep"] = threading.Thread(target=stop.wait, daemon=True)
        for t in threads.values():
            t.start()
        return cpu

    try:
        # another backend (a TPU or GPU host): its threads are not gloo's, left alone
        assert idle_transport_threads(lambda: start(cpu=False)) == []
        assert os.sched_getscheduler(threads["poll"].native_id) == os.SCHED_OTHER
        got = idle_transport_threads(lambda: start(cpu=True))
        assert got == [threads["poll"].native_id]
        assert os.sched_getscheduler(got[0]) == os.SCHED_IDLE
        assert os.sched_getscheduler(threads["sleep"].native_id) == os.SCHED_OTHER
    finally:
        stop.set()


def test_single_process_helpers():
    mesh = jax.make_mesh((2, 2), ("data", "pipe"), devices=jax.devices()[:4])
    b = jpd.global_batch({"x": np.arange(8.0).reshape(4, 2)}, mesh)
    assert b["x"].sharding.spec == jax.sharding.PartitionSpec(("data",))
    r = jpd.replicate({"w": np.ones(3)}, mesh)
    assert r["w"].sharding.is_fully_replicated
    np.testing.assert_array_equal(jpd.fetch(b)["x"], np.arange(8.0).reshape(4, 2))
    if os.environ.get(jpd.ENV_NUM_PROCESSES) is None:
        assert jax.process_count() == 1


def test_the_config_summary_covers_what_the_loss_returns():
    """check_consistent compares config_summary across processes: pipelines differing
    only in has_aux, the aux leaves or the reduction differ there (two processes that
    disagreed on them crashed in gloo or hung, or each reported another loss)."""
    import jaxpipe as jp

    w = [jnp.eye(4) for _ in range(2)]
    batch = {"x": jnp.ones((8, 4))}

    def loss(p, b, aux=0):
        h = jp.boundary(jnp.tanh(b["x"] @ p[0])) @ p[1]
        value = jnp.mean(h ** 2)
        return (value, {"h": h[:, :aux]}) if aux else value

    mesh = jax.make_mesh((2,), ("pipe",), devices=jax.devices()[:2])

    def summary(fn, **kw):
        pipe = jp.pipeline(fn, w, batch, mesh=mesh, schedule=jp.GPipe(2, 2), cut="markers",
                           **kw)
        return jpd.config_summary(pipe)

    plain = summary(loss)
    summaries = [summary(lambda p, b: loss(p, b, 1), has_aux=True),
                 summary(lambda p, b: loss(p, b, 2), has_aux=True),
                 summary(loss, reduction="sum")]
    for other in summaries:
        assert {k for k in plain if plain[k] != other[k]} == {"loss"}
    assert summaries[0]["loss"] != summaries[1]["loss"]


def test_overlap_probe_runs(tmp_path):
    """benchmarks/probes/overlap_probe.py (ppermute beside compute, 2 processes) runs and
    writes its medians; a smoke run, its ratios are for benchmarks/README.md."""
    rc, out, _ = _launch("benchmarks/probes/overlap_probe.py", "--ticks", "2", "--heavy", "2",
                         "--light", "1", "--message", "64", "--repeats", "1",
                         "--out", str(tmp_path), devices=1)
    assert rc == 0, out[-2000:]
    res = json.loads((tmp_path / "overlap_probe.json").read_text())
    assert set(res["median_s"]) == {"nocomm", "sync", "async"}
    assert all(t > 0 for t in res["median_s"].values())
