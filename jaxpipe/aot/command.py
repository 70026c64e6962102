"""``jaxpipe compile``: size a pipelined run for an accelerator before you have one.

    jaxpipe compile --target tpu:v5e:2x4 examples/gpt.py
    jaxpipe compile --target gpu:h200:8 --mesh pipe=4,data=2 examples/gpt.py -- --layers 48

``MODEL`` is ``path/to/file.py[:function]`` (default function ``aot_pipeline``):
``function(mesh, *args) -> Pipeline | (Pipeline, optimizer)`` builds the pipeline on the
compile-only ``mesh`` it is given (from shapes: ``jax.ShapeDtypeStruct`` s or
``nnx.eval_shape``), ``args`` being what follows ``--`` on the command line. The command
compiles the program (``--program``, default the train step with the returned optimizer,
else Adam) and prints the plan and :class:`~jaxpipe.aot.report.CompileReport`: memory per
device beside the cutter's prediction and the device's capacity, whether it fits, the
tick loop's census and the compile time. Exit code 0 when it fits, 1 when it does not
(compiled and too large, or no cut within the target's memory: ``cut="auto"``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def _run_compile(args: argparse.Namespace) -> int:
    from jaxpipe.xla_flags import cpu_unless_attached

    # Compile-only devices need no backend; without a GPU the CUDA plugin cannot start
    # and would then register nothing (a no-op if JAX started already).
    cpu_unless_attached()
    from jaxpipe.aot.report import compile_report
    from jaxpipe.aot.targets import target

    t0 = time.perf_counter()
    tgt = target(args.target)
    mesh = tgt.mesh(_parse_mesh(args.mesh, tgt.num_devices))
    build = _load(args.model)
    t1 = time.perf_counter()
    model_args = list(args.model_args)
    if model_args[:1] == ["--"]:
        model_args = model_args[1:]
    from jaxpipe.cut import CutError

    try:
        made = build(mesh, *model_args)
    except CutError as err:  # cut="auto" found no cut within the target's memory
        if "infeasible" not in str(err):
            raise
        why = " ".join(str(err).split())
        if "from Cut.memory_budget" in why:  # the model file's own budget, not the target's
            print(f"jaxpipe compile: no cut within the memory budget the model sets "
                  f"(jp.Cut(memory_budget=...), not the memory of {args.target}): {why}")
        else:
            print(f"jaxpipe compile: DOES NOT FIT on {tgt.describe()}: {why}")
        return 1
    pipe, optimizer = made if isinstance(made, tuple) else (made, None)
    if not hasattr(pipe, "lower"):
        raise ValueError(f"{args.model} returned {type(pipe).__name__}; it must return a "
                         "jaxpipe Pipeline, or (pipeline, optimizer)")
    t2 = time.perf_counter()
    print(pipe.plan)
    report = compile_report(pipe, args.program,
                            optimizer=optimizer if args.program == "train_step" else None)
    report.extra["build pipeline"] = f"{t2 - t1:.2f} s (target {t1 - t0:.2f} s)"
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "mesh": dict(mesh.shape), "model": args.model,
                       **report.to_dict()}, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 1 if report.fits is False else 0


def _parse_mesh(text: str | None, devices: int) -> dict[str, int]:
    if not text:
        return {"pipe": devices}
    out: dict[str, int] = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name.strip() or not size.strip().isdigit():
            raise ValueError(f"--mesh expects name=size,... (e.g. pipe=4,data=2), got {text!r}")
        if name.strip() in out:
            raise ValueError(f"--mesh names axis {name.strip()!r} twice ({text!r}); name "
                             "each axis once")
        out[name.strip()] = int(size)
    return out


def _load(spec: str) -> Any:
    """``path.py[:function]`` -> the function (default ``aot_pipeline``)."""
    import importlib.util

    path, _, name = spec.partition(":")
    name = name or "aot_pipeline"
    if not path.endswith(".py") or not os.path.isfile(path):
        raise ValueError(f"MODEL {spec!r}: expected path/to/file.py[:function] of an "
                         "existing file")
    module_spec = importlib.util.spec_from_file_location("_jaxpipe_aot_model", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # dataclasses look their module up there
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{path} defines no function {name!r}; write "
                         f"def {name}(mesh, *args) returning a Pipeline built on mesh")
    return fn


def add_compile_parser(subparsers: argparse._SubParsersAction) -> None:
    """``jaxpipe compile --target T [--mesh ...] MODEL [-- ARGS...]``."""
    parser = subparsers.add_parser(
        "compile",
        help="compile a pipeline for a TPU/GPU target ahead of time: memory, fit, census",
        description=__doc__.split("\n\n")[0] + " Needs pip install 'jaxpipe[aot]'.")
    parser.add_argument("--target", required=True,
                        help="tpu:GEN:TOPOLOGY (tpu:v5e:2x4, tpu:v5p:2x2x2) or "
                        "gpu:KIND:COUNT (gpu:h200:8, gpu:h100:2x8)")
    parser.add_argument("--mesh", help="mesh axes over all the target's devices, e.g. "
                        "pipe=4,data=2 (default: pipe=all)")
    parser.add_argument("--program", choices=("train_step", "value_and_grad", "loss"),
                        default="train_step")
    parser.add_argument("--json", metavar="OUT.json", help="also write the report as JSON")
    parser.add_argument("model", help="path/to/file.py[:function] (default function "
                        "aot_pipeline(mesh, *args))")
    parser.add_argument("model_args", nargs=argparse.REMAINDER,
                        help="after --: arguments passed to the function")
    parser.set_defaults(func=_run_compile)
