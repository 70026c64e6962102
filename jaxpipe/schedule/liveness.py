"""Residual liveness (temporary; replaced by the cut-package branch's version)."""

from __future__ import annotations

from collections.abc import Iterable


def unit_lifetimes(events: Iterable) -> dict:
    out: dict = {}
    for a, t in events:
        key = (a.stage, a.microbatch)
        lo, hi = out.get(key, (None, None))
        if a.kind == "F":
            lo = t
        else:
            hi = t if hi is None else max(hi, t)
        out[key] = (lo, hi)
    return {k: (lo, hi if hi is not None else lo) for k, (lo, hi) in out.items()}


def peak_overlap(intervals: Iterable) -> int:
    events = sorted([(a, 0) for a, _ in intervals] + [(b, 1) for _, b in intervals])
    live = peak = 0
    for _, kind in events:
        live += 1 if kind == 0 else -1
        peak = max(peak, live)
    return peak
