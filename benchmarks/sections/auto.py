"""schedule="auto" against measurement: does it pick the fastest candidate?

    python benchmarks/sections/auto.py                # 4 devices in one process
    python benchmarks/sections/auto.py --processes 2  # 2 processes, one core each

Either 4 virtual CPU devices in one process, single-threaded XLA, pinned to one core
(devices take turns, so a step's time is all the work the program does plus its
per-tick cost), or (``--processes 2``) 2 processes of one device each, each pinned to
its own core, gloo between them (``python -m jaxpipe.launch``; devices run together,
so the bubble and the exchanges show). Three models:

- an MLP stack (16 tanh layers of width 512, batch 256);
- the GPT-like model of benchmarks/common.py (8 blocks, width 128, seq 32, vocab 256);
- the same with a heavy head (vocab 8192: the last stage's matmul and softmax dominate).

For each, every candidate ``jp.Auto()`` ranks (1F1B, GPipe, interleaved 1F1B with 2 and
4 chunks, and the gallery's zero-bubble ``ZeroBubbleH1``, m = 16) is built and its
``value_and_grad`` timed (round-robin medians). Per model: the predicted and measured
times, Spearman's rank correlation between them, and the auto choice's measured time over
the best measured; first with the default constants (per tick, per stored byte a tick),
then with ``jaxpipe calibrate``'s measured on this machine in the same process(es). The
quick run (the test suite's smoke run) records the section as skipped:
``tests/test_auto.py`` checks the choice. TPU and GPU targets:
``benchmarks/sections/aot.py --schedules Auto``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

ORDER = 135
FIELDS = ("devices", "rows")
DEVICES = 4
MICROBATCHES = 16
#: Auto's families here: the built-ins and the gallery's zero-bubble schedule (a class
#: a user would pass), loaded by path as a user would.
GALLERY = ("schedules/zero_bubble.py:ZeroBubbleH1",)


def _models() -> list[tuple[str, Any, Any, Any]]:
    import jax
    import jax.numpy as jnp

    import jaxpipe as jp
    from benchmarks import common as C

    width, layers = 512, 16
    keys = jax.random.split(jax.random.key(0), layers + 2)
    mlp_params = [jax.random.normal(k, (width, width)) / width ** 0.5 for k in keys[:layers]]
    mlp_batch = {"x": jax.random.normal(keys[-2], (256, width)),
                 "y": jax.random.normal(keys[-1], (256, width))}

    def mlp_loss(params, batch):
        h = batch["x"]
        for w in params:
            h = jp.boundary(jnp.tanh(h @ w))
        return jnp.mean((h - batch["y"]) ** 2)

    out = [("mlp 16x512", mlp_loss, mlp_params, mlp_batch)]
    for name, vocab in (("gpt 8 blocks", 256), ("gpt heavy head (vocab 8192)", 8192)):
        cfg = C.GPTConfig(vocab=vocab, d_model=128, n_layers=8, seq=32)
        out.append((name, C.gpt_loss(cfg), C.init_params(cfg, jax.random.key(1)),
                    C.make_gpt_batch(cfg, 64)))
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties share their mean rank); 1.0 for fewer than 2."""
    import numpy as np

    def ranks(x: list[float]) -> np.ndarray:
        x = np.asarray(x, np.float64)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=np.float64)
        for v in np.unique(x):  # ties: their mean rank
            r[x == v] = r[x == v].mean()
        return r

    if len(a) < 2:
        return 1.0
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return 1.0 if (ra == rb).all() else 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def _families() -> tuple:
    import jaxpipe as jp
    from jaxpipe.api.auto import FAMILIES

    return (*FAMILIES, *(jp.load_schedule(str(REPO / g)) for g in GALLERY))


def _predicted(loss_fn: Any, params: Any, batch: Any, mesh: Any) -> tuple[dict, dict, Any]:
    """Every candidate ``jp.Auto()`` ranks: predicted time and verdict, by key."""
    import jaxpipe as jp

    auto = jp.pipeline(loss_fn, params, batch, mesh=mesh,
                       schedule=jp.Auto(microbatches=MICROBATCHES, families=_families()))
    found = {f"{c.family} v={c.chunks}": c for c in auto.inspect.auto_choice.candidates
             if c.schedule is not None and c.time is not None}
    return ({k: c.time for k, c in found.items()}, {k: c.verdict for k, c in found.items()},
            {k: c.schedule for k, c in found.items()})


def _ranking(predicted: dict, verdict: dict, measured: dict) -> dict[str, Any]:
    keys = list(measured)
    chosen = next(k for k in keys if verdict[k] == "chosen")
    best = min(keys, key=measured.__getitem__)
    return {"spearman": spearman([predicted[k] for k in keys], [measured[k] for k in keys]),
            "chosen": chosen, "best_measured": best,
            "chosen_over_best": measured[chosen] / measured[best],
            "best_in_predicted_top3": best in sorted(keys, key=predicted.__getitem__)[:3]}


def _mesh(devices: int) -> Any:
    import jax

    return jax.make_mesh((devices,), ("pipe",), devices=jax.devices()[:devices])


def _model_row(name: str, loss_fn: Any, params: Any, batch: Any, repeats: int,
               devices: int) -> dict[str, Any]:
    import jaxpipe as jp
    from benchmarks import common as C
    from jaxpipe.distributed import replicate

    mesh = _mesh(devices)
    # on the mesh once: a timed call moves nothing (several processes: the same values)
    params, batch = replicate((params, batch), mesh)
    predicted, verdict, schedules = _predicted(loss_fn, params, batch, mesh)
    runs = {k: (jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=s).value_and_grad,
                (params, batch)) for k, s in schedules.items()}
    times = C.time_interleaved(runs, warmup=1, repeats=repeats)
    measured = {k: times[k]["median_s"] for k in runs}
    return {"model": name, "microbatches": MICROBATCHES,
            "candidates": [{"candidate": k, "predicted": predicted[k],
                            "measured_s": measured[k], "verdict": verdict[k]} for k in runs],
            **_ranking(predicted, verdict, measured)}


def measure(quick: bool = False, devices: int = DEVICES) -> dict[str, Any]:
    """Rank with the default constants, then with ``jaxpipe calibrate``'s measured on this
    machine (kept in a temporary file, not the user's)."""
    import tempfile
    from unittest import mock

    import jax

    res: dict[str, Any] = {"devices": devices, "processes": jax.process_count(),
                           "rows": []}
    if quick:
        res["skipped"] = "full run only (the choice's checks: tests/test_auto.py)"
        return res
    if len(jax.devices()) < devices:
        res["skipped"] = f"needs {devices} devices, have {len(jax.devices())}"
        return res
    from jaxpipe.runtime.spmd import calibrate as cal
    from jaxpipe.tools.calibrate import measure as calibrate

    with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(
            os.environ, {"JAXPIPE_CALIBRATION": str(Path(tmp) / "calibration.json")}):
        models = _models()
        for name, loss_fn, params, batch in models:  # the defaults: nothing kept yet
            res["rows"].append(_model_row(name, loss_fn, params, batch, repeats=5,
                                          devices=devices))
        kept = calibrate(devices)
        cal.save(kept)
        res["calibration"] = {"flops_per_s": kept.flops_per_s,
                              "tick_overhead_flops": kept.tick_overhead_flops,
                              "stored_byte_tick_flops": kept.stored_byte_tick_flops}
        mesh = _mesh(devices)
        for row, (_, loss_fn, params, batch) in zip(res["rows"], models, strict=True):
            predicted, verdict, _ = _predicted(loss_fn, params, batch, mesh)
            measured = {c["candidate"]: c["measured_s"] for c in row["candidates"]}
            for c in row["candidates"]:
                c["predicted_calibrated"] = predicted[c["candidate"]]
            row["calibrated"] = _ranking(predicted, verdict, measured)
    return res


def run(r: Any) -> dict[str, Any]:
    return measure(r.s.quick)


def summary(res: dict[str, Any]) -> str:
    if not res["rows"]:
        return f"**schedule='auto'**: {res.get('skipped', 'no rows')}"
    return "\n".join(
        f"**auto on {r['model']}** (p={res['devices']}, {res.get('processes', 1)} "
        f"process(es), m={r['microbatches']}): chose "
        f"{r['chosen']}, measured best {r['best_measured']}, chosen / best "
        f"{r['chosen_over_best']:.3f}, Spearman {r['spearman']:.2f} (calibrated: chose "
        f"{r['calibrated']['chosen']}, Spearman {r['calibrated']['spearman']:.2f})"
        for r in res["rows"])


def _launch(processes: int, out: str) -> int:
    """This script as ``processes`` processes of one device each (``jaxpipe.launch``)."""
    cmd = [sys.executable, "-m", "jaxpipe.launch", "--nproc", str(processes),
           "--devices-per-proc", "1", "--timeout", "1800", __file__, "--worker",
           "--out", out]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(x for x in (os.environ.get("PYTHONPATH"),
                                                      str(REPO)) if x)}
    return subprocess.call(cmd, env=env, cwd=REPO)


def _pin_to_process_core() -> None:
    """One core per process (process ``i`` on the ``i``-th core), single-threaded XLA."""
    from benchmarks.cpu_setup import SINGLE_THREAD_FLAGS, pin_to_core

    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SINGLE_THREAD_FLAGS}"
    from jaxpipe.distributed import ENV_PROCESS_ID  # (after the flags: it imports jax)

    pin_to_core(int(os.environ.get(ENV_PROCESS_ID, "0")))


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    from benchmarks.common import write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None,
                    help="results folder (default: results/auto, results/auto_2proc)")
    ap.add_argument("--processes", type=int, default=1,
                    help="processes of one device each (1: 4 devices in one process)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    results = REPO / "benchmarks" / "results"
    if args.processes > 1:
        sys.exit(_launch(args.processes, args.out or str(results / "auto_2proc")))
    if args.worker:
        import jax

        from jaxpipe.distributed import initialize

        initialize(require=True)
        res = measure(devices=jax.process_count())
        if jax.process_index() != 0:
            return None
    else:
        res = measure()
    for r in res["rows"]:
        for c in r["candidates"]:
            print(f"  {r['model']:>28} {c['candidate']:>16}  predicted {c['predicted']:.4g}"
                  f" (calibrated {c['predicted_calibrated']:.4g})  measured "
                  f"{c['measured_s'] * 1e3:8.2f} ms  {c['verdict']}")
    print(summary(res))
    write_json(args.out or str(results / "auto"), "auto.json", res)
    return res


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from benchmarks.cpu_setup import single_core_cpu

    if "--worker" in sys.argv:
        _pin_to_process_core()
    elif "--processes" not in sys.argv:
        single_core_cpu(devices=DEVICES)
    main()
