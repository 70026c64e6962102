"""``python -m jaxpipe.launch``: run a script as N local processes of one JAX program.

A development launcher for multi-process pipelines on one machine (loopback, CPU).
It starts ``--nproc`` copies of the script and tells each, through environment
variables read by :func:`jaxpipe.distributed.initialize`, where the coordinator is
(``127.0.0.1:<free port>``), how many processes there are and which one it is; each
process gets ``--devices-per-proc`` virtual CPU devices (``XLA_FLAGS``) and the gloo
CPU collectives, so ``jax.devices()`` lists ``nproc * devices_per_proc`` global devices.

Usage::

    python -m jaxpipe.launch --nproc 2 --devices-per-proc 2 train.py --steps 10
    python -m jaxpipe.launch --nproc 2 -m mypkg.train         # run a module

Every output line is prefixed with the process index (``[0] ...``, ``[1] ...``). If a
process fails, the others are killed and the launcher exits with that process's exit
code; if ``--timeout`` seconds pass first, all are killed and it exits with 124. A
multi-process JAX program whose processes disagree otherwise waits in a collective
forever, so a timeout is a good idea in tests and CI.

On a real cluster do not use this launcher: start one process per host (or per
accelerator) with your scheduler and call ``jaxpipe.distributed.initialize()``, which
falls back to JAX's SLURM / Open MPI / Kubernetes / Cloud TPU auto-detection (see
docs/multihost.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from jaxpipe.distributed import (
    ENV_COORDINATOR,
    ENV_INIT_TIMEOUT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

__all__ = ["free_port", "launch", "main", "worker_env"]

#: Exit code when --timeout expires (as coreutils ``timeout``).
TIMEOUT_EXIT = 124
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def worker_env(base: dict[str, str], *, process_id: int, nproc: int, address: str,
               devices_per_proc: int, init_timeout: int | None = None) -> dict[str, str]:
    """The environment of worker ``process_id``: ``base`` plus the launcher's variables.

    Sets ``JAXPIPE_COORDINATOR_ADDRESS``, ``JAXPIPE_NUM_PROCESSES``,
    ``JAXPIPE_PROCESS_ID``, ``JAX_PLATFORMS=cpu``, unbuffered Python output, and
    replaces any ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS``.
    """
    env = dict(base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_FLAG)]
    env["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_FLAG}={devices_per_proc}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    env[ENV_COORDINATOR] = address
    env[ENV_NUM_PROCESSES] = str(nproc)
    env[ENV_PROCESS_ID] = str(process_id)
    if init_timeout is not None:
        env[ENV_INIT_TIMEOUT] = str(init_timeout)
    return env


def _pump(stream: IO[bytes], out: IO[str], prefix: str, lock: threading.Lock) -> None:
    """Copy ``stream`` to ``out`` line by line, each line prefixed."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            out.write(f"{prefix}{line}\n")
            out.flush()
    stream.close()


def _kill_all(procs: list[subprocess.Popen], grace: float = 3.0) -> None:
    """SIGTERM each still-running worker's process group, then SIGKILL after ``grace``."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # the worker leads its own session (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # killed by signal N -> 128 + N, as a shell does


def launch(command: Sequence[str], *, nproc: int, devices_per_proc: int = 1,
           port: int | None = None, timeout: float | None = None,
           host: str = "127.0.0.1", stdout: IO[str] | None = None,
           stderr: IO[str] | None = None) -> int:
    """Run ``command`` (argv after ``python``) as ``nproc`` processes; return an exit code.

    0 if every process exited 0; otherwise the first failing process's code (the others
    are killed), or 124 if ``timeout`` seconds passed first.
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if devices_per_proc < 1:
        raise ValueError(f"--devices-per-proc must be >= 1, got {devices_per_proc}")
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    address = f"{host}:{port or free_port(host)}"
    init_timeout = None if timeout is None else max(1, int(timeout))
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []

    def say(msg: str) -> None:
        with lock:
            err.write(f"[launch] {msg}\n")
            err.flush()

    try:
        for i in range(nproc):
            env = worker_env(os.environ, process_id=i, nproc=nproc, address=address,
                             devices_per_proc=devices_per_proc, init_timeout=init_timeout)
            p = subprocess.Popen([sys.executable, *command], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True)
            procs.append(p)
            for stream, sink in ((p.stdout, out), (p.stderr, err)):
                t = threading.Thread(target=_pump, args=(stream, sink, f"[{i}] ", lock),
                                     daemon=True)
                t.start()
                pumps.append(t)
        deadline = None if timeout is None else time.monotonic() + timeout
        code = 0
        while True:
            rcs = [p.poll() for p in procs]
            failed = [(i, rc) for i, rc in enumerate(rcs) if rc not in (None, 0)]
            if failed:
                i, rc = failed[0]
                say(f"process {i} exited with code {rc}; stopping the others")
                code = _exit_code(rc)
                break
            if all(rc == 0 for rc in rcs):
                break
            if deadline is not None and time.monotonic() > deadline:
                running = [i for i, rc in enumerate(rcs) if rc is None]
                say(f"timeout after {timeout:g} s; killing processes {running}")
                code = TIMEOUT_EXIT
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        say("interrupted; killing all processes")
        code = 130
    finally:
        _kill_all(procs)
        for t in pumps:
            t.join(timeout=2.0)
    return code


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m jaxpipe.launch",
        description="Run a JAX script as N local processes (loopback, CPU, gloo collectives).",
    )
    ap.add_argument("--nproc", type=int, required=True, help="number of processes")
    ap.add_argument("--devices-per-proc", type=int, default=1,
                    help="virtual CPU devices per process (default 1)")
    ap.add_argument("--port", type=int, default=None,
                    help="coordinator port on 127.0.0.1 (default: a free one)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="kill everything and exit 124 after this many seconds")
    ap.add_argument("-m", dest="module", default=None,
                    help="run a module (like python -m) instead of a script")
    ap.add_argument("script", nargs="?", help="the script to run in every process")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    ap = _parser()
    ns = ap.parse_args(argv)
    if ns.module is not None:
        command = ["-m", ns.module, *([ns.script] if ns.script else []), *ns.args]
    elif ns.script is not None:
        command = [ns.script, *ns.args]
    else:
        ap.error("give a script to run (or -m module)")
    try:
        return launch(command, nproc=ns.nproc, devices_per_proc=ns.devices_per_proc,
                      port=ns.port, timeout=ns.timeout)
    except ValueError as e:
        ap.error(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
