"""The SPMD program's costs a tick, as measured on this machine, stored and reused.

``schedule="auto"`` ranks schedules by their work plus a fixed cost per tick and a cost
per stored byte per tick (:mod:`.predict`). ``jaxpipe calibrate``
(:mod:`jaxpipe.tools.calibrate`) times small pipelines whose work, ticks and stored bytes
are known, solves ``time = work / rate + ticks * cost`` for the rate (FLOP/s) and the cost
a tick (s), and takes the cost a stored byte a tick (s) from two pipelines that differ
only in what they store; :func:`fit` does the solving and :func:`save` keeps the result
in a JSON file (``$JAXPIPE_CALIBRATION``, default
``~/.cache/jaxpipe/calibration.json``) under this machine's backend, device kind and
whether its devices run together.
:func:`tick_overhead_flops` and :func:`stored_byte_flops` read it back, falling back to
:data:`~.backends.TICK_OVERHEAD_FLOPS` and :data:`~.backends.STORED_BYTE_TICK_FLOPS`
where nothing was measured.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from jaxpipe.errors import PipelineError
from jaxpipe.runtime.spmd.backends import STORED_BYTE_TICK_FLOPS, TICK_OVERHEAD_FLOPS

__all__ = ["Calibration", "calibration_path", "fit", "load", "machine_key", "save",
           "stored_byte_flops", "tick_overhead_flops"]


@dataclass(frozen=True)
class Calibration:
    """One machine's measured constants (see the module docstring).

    Attributes:
      key: what it was measured for: ``"<backend>:<device kind>:<together|turns>"``.
      flops_per_s: the rate the cutter's FLOPs ran at.
      tick_overhead_s: the fixed time of one tick.
      samples: the measurements it was fitted to: ``(seconds, work FLOPs, ticks)`` each.
      stored_byte_tick_s: the time a stored byte costs a tick (0 where not measured).
      stored_samples: the pair that measured it: ``(seconds, stored bytes x ticks)`` of
        two pipelines with the same work and ticks (empty: not measured).
    """

    key: str
    flops_per_s: float
    tick_overhead_s: float
    samples: tuple[tuple[float, float, int], ...]
    stored_byte_tick_s: float = 0.0
    stored_samples: tuple[tuple[float, float], ...] = ()

    @property
    def tick_overhead_flops(self) -> float:
        """The cost of a tick in FLOPs of compute time (what :mod:`.predict` adds)."""
        return self.tick_overhead_s * self.flops_per_s

    @property
    def stored_byte_tick_flops(self) -> float:
        """The cost of a stored byte a tick in FLOPs of compute time."""
        return self.stored_byte_tick_s * self.flops_per_s


def machine_key(backend: str, device_kind: str, concurrent: bool) -> str:
    return f"{backend}:{device_kind}:{'together' if concurrent else 'turns'}"


def calibration_path() -> Path:
    """Where calibrations are kept (``$JAXPIPE_CALIBRATION`` or the user's cache)."""
    env = os.environ.get("JAXPIPE_CALIBRATION")
    return Path(env) if env else Path.home() / ".cache" / "jaxpipe" / "calibration.json"


def fit(key: str, samples: list[tuple[float, float, int]],
        stored: tuple[tuple[float, float], tuple[float, float]] | None = None
        ) -> Calibration:
    """Least squares of ``seconds = work / rate + ticks * cost`` over ``samples`` (each
    ``(seconds, work, ticks)``); raises ``PipelineError`` where they do not give a
    positive rate and cost (too noisy, or too alike: measure a small and a large model).
    ``stored``: two ``(seconds, stored bytes x ticks)`` of one model's pipelines with the
    same work and ticks (1F1B and GPipe): their difference is the stored bytes' cost (0
    where noise makes it negative)."""
    if len(samples) < 2:
        raise PipelineError("calibration needs at least two measurements (a small and a "
                            "large model)")
    t = np.array([s[0] for s in samples], np.float64)
    a = np.array([[s[1], s[2]] for s in samples], np.float64)
    (inv_rate, cost), *_ = np.linalg.lstsq(a, t, rcond=None)
    if not (inv_rate > 0 and cost > 0):
        raise PipelineError(
            f"the measurements give no positive rate and tick cost (1/rate {inv_rate:.3g} "
            f"s/FLOP, tick {cost:.3g} s): the machine was too noisy or the models too "
            "alike; run jaxpipe calibrate again on an idle machine")
    byte_cost = 0.0
    if stored is not None:
        (t1, b1), (t2, b2) = stored
        if b1 == b2:
            raise PipelineError("the stored-bytes pair stores the same bytes: measure two "
                                "schedules that store different amounts")
        byte_cost = max(0.0, (t2 - t1) / (b2 - b1))
    return Calibration(key, float(1 / inv_rate), float(cost),
                       tuple((float(x), float(w), int(n)) for x, w, n in samples),
                       float(byte_cost), tuple(tuple(map(float, s)) for s in stored or ()))


def load(path: Path | None = None) -> dict[str, Calibration]:
    """Every calibration kept at ``path`` (default :func:`calibration_path`)."""
    path = path or calibration_path()
    try:
        st = path.stat()
    except FileNotFoundError:
        return {}
    return dict(_read(str(path), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=8)
def _read(path: str, mtime_ns: int, size: int) -> tuple[tuple[str, Calibration], ...]:
    """The file at ``path`` as it is at that modification time and size (read once:
    schedule="auto" asks for every candidate)."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise PipelineError(f"cannot read the calibration file {path} ({err}); delete it "
                            "or run jaxpipe calibrate again") from None
    return tuple((k, Calibration(k, v["flops_per_s"], v["tick_overhead_s"],
                                 tuple(tuple(s) for s in v.get("samples", ())),
                                 v.get("stored_byte_tick_s", 0.0),
                                 tuple(tuple(s) for s in v.get("stored_samples", ()))))
                 for k, v in raw.items())


def save(cal: Calibration, path: Path | None = None) -> Path:
    """Keep ``cal`` at ``path`` (replacing an older one of the same key)."""
    path = path or calibration_path()
    kept = load(path)
    kept[cal.key] = cal
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: {f: v for f, v in asdict(c).items() if f != "key"}
                                for k, c in kept.items()}, indent=2))
    return path


def _kept(backend: str, concurrent: bool, device_kind: str | None) -> Calibration | None:
    """The kept calibration of this backend (and device kind, if given; where several
    were measured, the first), or ``None``."""
    prefix = f"{backend}:"
    suffix = f":{'together' if concurrent else 'turns'}"
    for key, cal in load().items():
        if key.startswith(prefix) and key.endswith(suffix) and (
                device_kind is None or key == machine_key(backend, device_kind, concurrent)):
            return cal
    return None


def tick_overhead_flops(backend: str, concurrent: bool, device_kind: str | None = None
                        ) -> float:
    """The cost of a tick in FLOPs: the kept calibration's, else the default."""
    cal = _kept(backend, concurrent, device_kind)
    return cal.tick_overhead_flops if cal else TICK_OVERHEAD_FLOPS[backend]


def stored_byte_flops(backend: str, concurrent: bool, device_kind: str | None = None
                      ) -> float:
    """The cost of a stored byte a tick in FLOPs: the kept calibration's where it
    measured one, else the default."""
    cal = _kept(backend, concurrent, device_kind)
    if cal is not None and cal.stored_samples:
        return cal.stored_byte_tick_flops
    return STORED_BYTE_TICK_FLOPS[backend]
