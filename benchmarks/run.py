"""jaxpipe benchmark suite: the runner. Each section is a module of benchmarks/sections/.

    python benchmarks/run.py                    # every section, ~10+ min on a 2-core CPU
    python benchmarks/run.py --quick            # tiny model, a smoke test (the test suite runs it)
    python benchmarks/run.py --sections overhead,eval --out results/
    python benchmarks/run.py --devices 8 --out results/ --layers 16 --d-model 256

Runs on whatever backend JAX finds: CPU with ``--devices`` virtual devices by default
(single-threaded XLA pinned to one core, so one device = one core and ratios measure work,
not threading); on GPU/TPU the real devices, where it also reports TFLOP/s per device and
MFU, and sets the XLA flags the accelerator program wants (``jaxpipe/xla_flags.py``)
unless ``XLA_FLAGS`` names them. ``--program cpu|gpu|tpu`` builds that SPMD program
whatever the devices (default: the devices' platform), so both programs run on one
machine.

Sections (``--sections``, comma separated, default all) are the modules of
``benchmarks/sections/`` (see its ``__init__``: ORDER, FIELDS, run, and optionally summary
and plot), plus those in ``--more-sections DIR``; ``--list`` prints them. Writes
``<out>/benchmarks.json`` (everything), one ``<out>/<section>.json`` per section, PNG plots
and ``<out>/summary.md``. Timings are medians of repeated runs after warm-up; on a shared
machine they are noisy, so every timing also records the process CPU time (all threads).
"""

from __future__ import annotations

import os
import sys


def _preparse(argv: list[str]) -> None:
    """Before jax is imported: XLA flags (virtual devices, threads) and core pinning."""
    n, threads, cores = 8, "single", 1
    for i, a in enumerate(argv):
        if a == "--cores" and i + 1 < len(argv):
            cores = int(argv[i + 1])
        elif a.startswith("--cores="):
            cores = int(a.split("=", 1)[1])
        if a == "--devices" and i + 1 < len(argv):
            n = int(argv[i + 1])
        elif a.startswith("--devices="):
            n = int(a.split("=", 1)[1])
        elif a == "--threads" and i + 1 < len(argv):
            threads = argv[i + 1]
        elif a.startswith("--threads="):
            threads = a.split("=", 1)[1]
    from jaxpipe.xla_flags import cpu_devices, fast_cpu_compile  # (imports no jax)

    flags = cpu_devices(n)
    if "--quick" in argv:
        # the smoke run's tiny programs spend their time compiling, not running: in the MLIR
        # fusion emitters' fixed cost per program (106 -> 55 s without them) and in LLVM's
        # passes (40% of what is left); its figures mean nothing anyway
        flags = fast_cpu_compile()
        if "xla_backend_optimization_level" not in flags:
            flags += " --xla_backend_optimization_level=0"
    if threads == "single" and "xla_cpu_multi_thread_eigen" not in flags:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if repo not in sys.path:
            sys.path.insert(0, repo)
        from benchmarks.cpu_setup import with_flags  # (imports no jax)

        flags = with_flags(flags)  # last (see there)
    os.environ["XLA_FLAGS"] = flags.strip()
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_jaxpipe_xla_flags", os.path.join(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))), "jaxpipe", "xla_flags.py"))
    flags_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flags_module)  # (not via jaxpipe: that imports jax)
    # the accelerator attached, not the compilers installed (jaxpipe[aot] brings both
    # libtpu and the CUDA plugin to machines without either device)
    platform = flags_module.attached_platform()
    flags_module.cpu_unless_attached()
    # One core for the whole process (CPU runs): virtual devices then share it, so wall
    # time measures total work, like process CPU time, instead of how many of the
    # machine's cores p virtual devices happen to occupy.
    if cores > 0 and hasattr(os, "sched_setaffinity") and platform == "cpu":
        mine = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, set(mine[:cores]))
    # on GPU/TPU, the flags the accelerator program wants (jaxpipe/xla_flags.py)
    flags_module.apply(platform)


if __name__ == "__main__":
    _preparse(sys.argv[1:])
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxpipe as jp  # noqa: E402
from benchmarks.harness import Runner, Settings, default_settings, log  # noqa: E402
from benchmarks.sections import Section, discover  # noqa: E402

#: The sections whose pipelines ``--program`` builds (the others measure CPU-only
#: properties, run their own processes, or compile for their own targets).
PROGRAM_SECTIONS = frozenset({"baseline", "sweep", "scaling", "eval", "overhead", "remat"})


REPO = Path(__file__).resolve().parent.parent


def run_section(sec: Section, r: Runner) -> dict[str, Any]:
    """``sec.run(r)``, checked: its result has every field it declares."""
    if sec.cpu_only and jax.default_backend() != "cpu":
        return {**{k: None for k in sec.fields},
                "error": f"CPU-only section (on {jax.default_backend()})"}
    res = sec.run(r)
    missing = [f for f in sec.fields if f not in res]
    if missing:
        raise KeyError(f"benchmark section {sec.name!r} returned no {missing}, which its "
                       "FIELDS declares; return them (None where not measured) or drop "
                       "them from FIELDS")
    return res


def make_plots(results: dict[str, Any], sections: dict[str, Section], out: Path) -> list[str]:
    """PNG figures of the sections that draw one; returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[str] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    for name, sec in sections.items():
        if sec.plot is not None and results.get(name):
            sec.plot(results[name], save)
    return written


def markdown_summary(res: dict[str, Any], sections: dict[str, Section]) -> str:
    """Markdown of a results dict (written to ``<out>/summary.md``)."""
    meta = res["meta"]
    duration = meta.get("duration_s")
    parts = [f"Backend {meta['backend']} ({meta['device_kind']}), {meta['num_devices']} "
             f"devices, {meta.get('cores_used')} core(s) used of {meta['cpu_count']}; "
             f"model {meta['config']}; suite took "
             f"{'n/a' if duration is None else f'{duration:.0f}'} s."]
    for name, sec in sections.items():
        if sec.summary is not None and res.get(name):
            parts.append(sec.summary(res[name]))
    return "\n\n".join(parts) + "\n"


def _headline(res: dict[str, Any], s: Settings) -> dict[str, Any]:
    ov = res.get("overhead") or {}
    ratios = ov.get("ratios", {})
    h: dict[str, Any] = {
        "overhead_p1": ratios.get("p1"), f"overhead_p{s.p}": ratios.get(f"p{s.p}"),
        "overhead_p4": ratios.get("p4"), "memory_1f1b_vs_baseline_m4p": None,
        "temp_1f1b_vs_baseline_m4p": None, "step_1f1b_vs_baseline_m4p": None,
        "step_gpipe_vs_baseline_m4p": None, "concurrency_speedup": None,
        "concurrency_ideal": None, "concurrency_fraction_of_ideal": None,
    }
    for row in (res.get("baseline") or {}).get("rows", []):
        if row["m"] == 4 * s.p:
            h["memory_1f1b_vs_baseline_m4p"] = row["memory_ratio"]["1F1B"]
            h["temp_1f1b_vs_baseline_m4p"] = row["temp_ratio"]["1F1B"]
            h["step_1f1b_vs_baseline_m4p"] = row["step_ratio"]["1F1B"]
            h["step_gpipe_vs_baseline_m4p"] = row["step_ratio"]["GPipe"]
    cc = res.get("concurrency") or {}
    h["concurrency_speedup"] = cc.get("speedup")
    h["concurrency_ideal"] = cc.get("ideal")
    h["concurrency_fraction_of_ideal"] = cc.get("fraction_of_ideal")
    per = cc.get("per_schedule") or {}
    if per:
        best = max(per, key=lambda k: per[k]["speedup"])
        h["concurrency_best"] = {"schedule": best, **{k: per[best][k] for k in (
            "speedup", "fraction_of_ideal", "fraction_of_ideal_vs_one_core",
            "lockstep_ideal")}}
    return h


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    return str(x)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the suite; returns the results dict (also written to ``<out>/benchmarks.json``)."""
    ap = argparse.ArgumentParser(description="jaxpipe benchmark suite",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny model, a smoke test")
    ap.add_argument("--devices", type=int, default=8,
                    help="virtual CPU devices (before jax starts) / real devices to use")
    ap.add_argument("--threads", choices=["single", "multi"], default="single",
                    help="CPU: single-threaded XLA (default) or XLA's own thread pool")
    ap.add_argument("--cores", type=int, default=1,
                    help="CPU: pin this process to this many cores (0: no pinning)")
    ap.add_argument("--out", default="results", help="directory for JSON and PNG")
    ap.add_argument("--sections", default=None,
                    help="comma-separated subset of the sections (default: all; --list)")
    ap.add_argument("--more-sections", action="append", default=[], metavar="DIR",
                    help="also load the section modules in DIR (repeatable)")
    ap.add_argument("--list", action="store_true", help="print the sections and exit")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--d-model", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--dtype", default=None, help="parameter/activation dtype, e.g. bfloat16")
    ap.add_argument("--mb-size", type=int, default=None,
                    help="sequences per microbatch (overhead, baseline, sweep, scaling)")
    ap.add_argument("--p", type=int, default=None, help="main pipeline size (default 4)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--no-plots", dest="plots", action="store_false")
    ap.add_argument("--program", choices=("auto", "cpu", "gpu", "tpu"), default="auto",
                    help="the SPMD program to build (SpmdRuntime(backend=...)); auto: the "
                    "devices' platform. On a GPU, run once with each to compare them")
    ap.add_argument("--summarize", metavar="JSON", default=None,
                    help="only print the markdown summary of an existing benchmarks.json")
    args = ap.parse_args(argv)
    sections = discover(args.more_sections)
    if args.list:
        for name, sec in sections.items():
            print(f"{name:12s} {(sec.run.__module__)}")
        return {}
    if args.summarize:
        res = json.loads(Path(args.summarize).read_text())
        print(markdown_summary(res, sections), end="")
        return res

    s = default_settings(args.quick)
    over = {k: v for k, v in {"n_layers": args.layers, "d_model": args.d_model,
                              "n_heads": args.heads, "seq": args.seq, "vocab": args.vocab,
                              "dtype": args.dtype}.items() if v is not None}
    s.model = replace(s.model, **over)
    if args.mb_size:
        s.mb = args.mb_size
        s.extra["overhead"] = {"mb": args.mb_size}  # (OverheadSettings.mb, see there)
    if args.p:
        s.p = args.p
    s.repeats = args.repeats or s.repeats
    s.warmup = s.warmup if args.warmup is None else args.warmup
    s.plots = args.plots
    s.program = args.program
    s.sections = (tuple(sections) if args.sections is None
                  else tuple(x for x in args.sections.split(",") if x))
    bad = set(s.sections) - set(sections)
    if bad:
        ap.error(f"unknown sections {sorted(bad)}; choose from {', '.join(sections)}")
    ndev = min(args.devices, len(jax.devices()))
    if s.p > ndev:
        s.p = max(1, ndev)
    s.p_big = min(s.p_big, ndev)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    results: dict[str, Any] = {"meta": {
        "backend": jax.default_backend(), "device_kind": dev.device_kind,
        "num_devices": ndev, "jax_version": jax.__version__, "jaxpipe_version": jp.__version__,
        "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "cores_used": (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                       else None),
        "machine": f"{platform.machine()} {platform.processor()}".strip(),
        "quick": s.quick, "config": s.model.asdict(),
        # the shared settings; each section records its own under its "settings"
        "settings": {k: v for k, v in s.__dict__.items() if k not in ("model", "extra")},
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "started": time.strftime("%F %T"),
        "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "duration_s": None,
        "note": ("CPU virtual devices run one program per device on the same cores: wall "
                 "time measures executor overhead, not pipeline overlap (see concurrency). "
                 "Timings are medians after warm-up on a possibly shared machine."),
    }}
    if s.program != "auto":  # say where --program does not apply, rather than drop it
        own = sorted(set(s.sections) - PROGRAM_SECTIONS)
        results["meta"]["program_not_applied"] = own
        if own:
            log(f"--program {s.program} builds the pipelines of "
                f"{sorted(set(s.sections) & PROGRAM_SECTIONS)}; {own} build the devices' own "
                "program")
    r = Runner(s, out)
    log(f"backend {jax.default_backend()} x{ndev}, model {s.model}, sections {s.sections}")
    chosen = {name: sec for name, sec in sections.items() if name in s.sections}
    for name, sec in chosen.items():
        t0 = time.perf_counter()
        results[name] = run_section(sec, r)
        results[name]["section_s"] = time.perf_counter() - t0
        results[name]["loadavg_after"] = os.getloadavg() if hasattr(os, "getloadavg") else None
        (out / f"{name}.json").write_text(json.dumps(results[name], indent=2,
                                                     default=_json_default))
        log(f"{name} done in {results[name]['section_s']:.0f}s")
    results["headline"] = _headline(results, s)
    results["meta"]["duration_s"] = time.perf_counter() - t_start
    if s.plots:
        results["meta"]["plots"] = make_plots(results, chosen, out)
    (out / "benchmarks.json").write_text(json.dumps(results, indent=2, default=_json_default))
    (out / "summary.md").write_text(markdown_summary(results, chosen))
    log("headline: " + json.dumps(results["headline"], default=_json_default))
    log(f"wrote {out}/benchmarks.json in {results['meta']['duration_s']:.0f}s")
    return results


if __name__ == "__main__":
    main()
    # the concurrency subprocesses are gone; exit without waiting on XLA thread teardown
    sys.stdout.flush()
    os._exit(0)
