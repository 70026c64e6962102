"""The ``jaxpipe`` command.

Subcommands are registered in :data:`SUBCOMMANDS`: each entry is a function
``add_<name>_parser(subparsers)`` that adds its parser and sets ``func`` (a callable
``args -> int`` exit code) with ``parser.set_defaults(func=...)``. To add a
subcommand, write such a function and append it to :data:`SUBCOMMANDS`.

Every failure (bad arguments, an invalid schedule, a schedule file that does not import,
an exception raised by a schedule's own code) prints one line to stderr and exits 2.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import NoReturn

from jaxpipe.aot.command import add_compile_parser
from jaxpipe.tools.calibrate import add_calibrate_parser


class CLIError(Exception):
    """A user error: printed as ``jaxpipe: error: <message>``, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (no usage dump) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parse_costs(text: str) -> dict[str, Fraction]:
    """Parse ``"F=1,B=2,I=1,W=1"`` into exact costs (missing kinds keep defaults)."""
    from jaxpipe.schedule import ACTION_KINDS

    costs: dict[str, Fraction] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, sep, value = item.partition("=")
        kind = kind.strip().upper()
        if not sep or kind not in ACTION_KINDS:
            raise argparse.ArgumentTypeError(
                f"bad cost {item!r}: expected KIND=NUMBER with KIND in {', '.join(ACTION_KINDS)}"
            )
        try:
            cost = Fraction(value.strip())
        except (ValueError, ZeroDivisionError):
            raise argparse.ArgumentTypeError(
                f"bad cost {item!r}: {value!r} is not a number"
            ) from None
        if cost < 0:
            raise argparse.ArgumentTypeError(f"bad cost {item!r}: costs must be >= 0")
        try:
            float(cost)
        except OverflowError:
            raise argparse.ArgumentTypeError(
                f"bad cost {item!r}: too large for a float; give costs in a smaller unit"
            ) from None
        costs[kind] = cost
    return costs


def _int_at_least(low: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value
    return parse


#: argparse types: an int >= 1, an int >= 0.
_positive_int = _int_at_least(1, "a positive int")
_nonnegative_int = _int_at_least(0, "an int >= 0")


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _run_simulate(args: argparse.Namespace) -> int:
    from jaxpipe.schedule import load_schedule

    cls = load_schedule(args.schedule)
    kwargs = {} if args.v is None else {"stages_per_device": args.v}
    try:
        schedule = cls(args.p, args.m, **kwargs)
    except TypeError as err:
        raise CLIError(f"cannot construct {cls.__name__}(p={args.p}, m={args.m}): {err}") from err
    # options of the lowered program, refused without it rather than silently ignored
    lowered_only = [flag for flag, given in (
        ("--backend", args.backend != "cpu"), ("--processes", args.processes),
        ("--split-backward", args.split_backward is not None),
        ("--refine", args.refine is not None), ("--overlap", args.overlap != "auto"),
        ("--transfer", bool(args.transfer)), ("--tick-cost", bool(args.tick_cost))) if given]
    if lowered_only and not args.lowered:
        verb = "describes" if len(lowered_only) == 1 else "describe"
        raise CLIError(f"{', '.join(lowered_only)} {verb} the lowered SPMD program: add "
                       "--lowered to see it, or drop them")
    if args.backend == "cpu" and args.overlap != "auto":
        raise CLIError("--overlap describes the gpu/tpu program (the cpu program sends a "
                       "message at the tick end its readers need); use --backend gpu or tpu, "
                       "or drop it")
    timeline = schedule.simulate(args.costs)

    print(timeline.to_ascii(width=args.width))
    print()
    print(f"schedule        {schedule!r}")
    print(f"makespan        {_num(timeline.makespan)}")
    print(f"bubble fraction {timeline.bubble_fraction:.4f}")
    print("device  stages          peak in-flight  busy")
    for d in range(schedule.num_devices):
        stages = ",".join(map(str, schedule.device_stages(d)))
        print(f"{d:<7} {stages:<15} {timeline.peak_in_flight[d]:<15} {_num(timeline.busy_time[d])}")
    if args.lowered:
        timeline = _print_lowered(schedule, args)
    if args.trace:
        print(f"wrote chrome trace {timeline.to_chrome_trace(args.trace)}")
    if args.plot:
        print(f"wrote plot {timeline.plot(args.plot)}")
    return 0


def _print_lowered(schedule, args: argparse.Namespace):
    """The SPMD lowering of ``schedule``: which actions share a tick, and its efficiency."""
    from jaxpipe.runtime.spmd.backends import REFINE_EVALS
    from jaxpipe.runtime.spmd.lowering import lower, lower_accelerator
    from jaxpipe.runtime.spmd.lowering.sync import lowered_timeline, sync_report, tick_table
    from jaxpipe.runtime.spmd.predict import cpu_lowering
    from jaxpipe.schedule.simulate import resolve_costs

    accelerator = args.backend != "cpu"
    if accelerator and (args.processes or args.tick_cost):
        raise CLIError("--processes and --tick-cost describe the CPU program; the "
                       f"{args.backend} program meets every tick and runs one step a tick "
                       "(drop them, or use --backend cpu)")
    concurrent = accelerator or args.processes
    split = args.split_backward if args.split_backward is not None else accelerator
    refine = args.refine if args.refine is not None else (REFINE_EVALS if concurrent else 0)
    if args.tick_cost and not (args.costs or refine):
        raise CLIError("--tick-cost prices ticks where they are chosen by cost: pass "
                       "--costs, or --refine N (or --processes, whose search is on)")
    # with costs given, ticks follow them where that runs faster (as the runtime does); the
    # local search needs costs, so --refine alone prices the default ones
    costs = resolve_costs(args.costs) if args.costs or refine else None
    if accelerator:
        low = lower_accelerator(schedule, {}, split_backward=split, costs=costs, refine=refine,
                                overlap={"on": True, "off": False}.get(args.overlap, "auto"),
                                transfer=args.transfer)
        how = (f"{args.backend} program: every tick ends with one permutation per "
               "direction over the fixed pairs; "
               + ("the previous tick's outbox is sent during the next tick (overlap on)"
                  if low.exchange.delay == 2 else "what a tick computes is sent at its end "
                  "(overlap off)"))
    else:
        # the runtime's exchange for these processes; the tick cost in --costs' units
        low = lower(schedule, {}, split_backward=split, costs=costs, refine=refine,
                    **cpu_lowering(args.processes, costed=False) | {"tick_cost": args.tick_cost})
        how = ("cpu program: at a tick's end a device waits only for the devices it "
               "exchanges a message with" + ("; across processes messages move lazily, "
                                             "at as few tick ends as their readers allow"
                                             if args.processes else ""))
    report = sync_report(schedule, low, args.costs, args.transfer)
    print()
    print(f"lowered SPMD program ({how}):")
    print(tick_table(low, max_ticks=args.width // 5 if args.width else None))
    if not low.exchange.every_tick:
        meets = int(low.table.exchange[:, 0, :].any(axis=1).sum())
        print(f"devices meet at {meets} of {low.num_ticks} tick ends")
    print(report.summary())
    return lowered_timeline(low, resolve_costs(args.costs), args.transfer)


def _num(x: object) -> str:
    if isinstance(x, Fraction):
        return str(x.numerator) if x.denominator == 1 else f"{float(x):.6g}"
    return str(x) if isinstance(x, int) else f"{float(x):.6g}"  # type: ignore[arg-type]


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> None:
    """``jaxpipe simulate SCHEDULE -p P -m M [-v V] [--costs ...] [--plot ...] [--trace ...]``."""
    parser = subparsers.add_parser(
        "simulate",
        help="simulate a schedule: ASCII timeline, bubble fraction, peak in-flight",
        description="Validate and simulate a pipeline schedule; print its timeline, "
        "makespan, bubble fraction and per-device peak in-flight microbatches.",
    )
    parser.add_argument(
        "schedule",
        help="built-in name (gpipe, 1f1b, interleaved) or path/to/file.py:ClassName",
    )
    parser.add_argument("-p", "--devices", dest="p", type=int, required=True,
                        help="number of pipeline devices")
    parser.add_argument("-m", "--microbatches", dest="m", type=int, required=True,
                        help="number of microbatches")
    parser.add_argument("-v", "--stages-per-device", dest="v", type=_positive_int, default=None,
                        help="stages (model chunks) per device; default: the schedule's")
    parser.add_argument("--costs", type=parse_costs, default=None, metavar="F=1,B=2,I=1,W=1",
                        help="action costs (default F=1,B=2,I=1,W=1)")
    parser.add_argument("--width", type=_positive_int, default=None,
                        help="cap the ASCII timeline width in characters")
    parser.add_argument("--plot", metavar="OUT.png", help="save a Gantt chart (PNG/SVG)")
    parser.add_argument("--trace", metavar="OUT.json",
                        help="save a Chrome/Perfetto trace (open in ui.perfetto.dev)")
    parser.add_argument("--lowered", action="store_true",
                        help="also lower the schedule to the SPMD program's ticks: which "
                        "actions share a tick and the lowered efficiency (asynchronous "
                        "makespan / lowered makespan); --plot/--trace then draw the "
                        "lowered program")
    parser.add_argument("--backend", choices=("cpu", "gpu", "tpu"), default="cpu",
                        help="with --lowered: the program the SPMD runtime builds for this "
                        "backend (cpu: exchanges only on ticks with messages; gpu/tpu: "
                        "straight-line ticks, one unconditional permutation per direction "
                        "each tick); default cpu")
    parser.add_argument("--processes", action="store_true",
                        help="with --lowered --backend cpu: the CPU program whose devices "
                        "run concurrently, in several processes, as the SPMD runtime "
                        "lowers it there (messages move lazily, at as few tick ends as "
                        "their readers allow; the local search on)")
    parser.add_argument("--split-backward", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="with --lowered: run every B as I then W (default: on for "
                        "gpu/tpu, off for cpu, as the SPMD runtime does)")
    parser.add_argument("--refine", type=_nonnegative_int, default=None, metavar="N",
                        help="with --lowered: N evaluations of the local search that moves "
                        "actions between ticks where that runs faster (default: 1200 for "
                        "gpu/tpu and --processes, 0 for cpu, as the SPMD runtime does)")
    parser.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                        help="with --lowered --backend gpu/tpu: send each tick's messages "
                        "during the next tick, overlapping its compute (one more tick "
                        "before they can be read); auto: where the sync model says that "
                        "runs faster with --transfer")
    parser.add_argument("--transfer", type=_nonnegative_float, default=0.0, metavar="T",
                        help="with --lowered: time of one permutation, in the units of "
                        "--costs (default 0)")
    parser.add_argument("--tick-cost", type=_nonnegative_float, default=0.0, metavar="T",
                        help="with --lowered --backend cpu and --costs or --refine: a tick's "
                        "fixed cost (dispatch), in the units of --costs: ticks are chosen by "
                        "the makespan plus this per tick, as the SPMD runtime does with its "
                        "calibrated cost (default 0)")
    parser.set_defaults(func=_run_simulate)


#: Subcommand registry: each adds one parser to the ``subparsers`` action.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_simulate_parser, add_compile_parser, add_calibrate_parser]


def build_parser() -> argparse.ArgumentParser:
    """The top-level ``jaxpipe`` parser with every registered subcommand."""
    parser = _Parser(
        prog="jaxpipe",
        description="jaxpipe: pipeline parallelism for JAX with user-defined schedules.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``jaxpipe`` command; returns the exit code (0 ok, 2 user error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a usage error (2), already printed
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        return int(args.func(args))
    except (CLIError, ValueError, OSError) as err:  # ScheduleError is a ValueError
        message = " ".join(str(err).split())  # one line, whatever the exception held
        print(f"jaxpipe {args.command}: error: {message}", file=sys.stderr)
        return 2
    except Exception as err:  # e.g. a bug in the user's schedule: name it and where
        message = " ".join(str(err).split())
        print(f"jaxpipe {args.command}: error: {type(err).__name__}: {message}"
              f"{_origin(err)}", file=sys.stderr)
        return 2


def _origin(err: BaseException) -> str:
    """`` (at file.py:12)``: the innermost frame of the traceback, if there is one."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return ""
    return f" (at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})"


if __name__ == "__main__":
    raise SystemExit(main())
