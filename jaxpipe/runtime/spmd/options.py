"""What a user sets on the SPMD runtime, and how each ``"auto"`` resolves for a mesh.

:class:`SpmdOptions` validates the options and resolves them (the program's backend, its
split, sharing, lanes, refinement); the options are documented on
:class:`~.runtime.SpmdRuntime`, which adds the runtime contract to them. A leaf module:
the executor reads the options and the runtime builds the executor, so neither imports
the other.
"""

from __future__ import annotations

from typing import Any

from jaxpipe.errors import PipelineError
from jaxpipe.runtime.spmd.backends import (
    BACKENDS,
    REFINE_EVALS,
    concurrent,
    packed_w_error,
    platform_of,
)

__all__ = ["SpmdOptions"]


class SpmdOptions:
    """The options of :class:`~.runtime.SpmdRuntime` (documented there), resolved for a
    mesh; what :class:`~.executor.SpmdExecutor` reads of its runtime."""

    def __init__(self, *, backend: str = "auto", overlap: bool | str = "auto",
                 share_bodies: bool | str = "auto", split_backward: bool | str = "auto",
                 iw_same_tick: bool | str = "auto", fuse_fb: bool | str = "auto",
                 refine: int | str = "auto", lanes: bool | str = "auto") -> None:
        if backend not in BACKENDS:
            raise PipelineError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, "
                                f"got {backend!r}.")
        for name, value in (("overlap", overlap), ("split_backward", split_backward),
                            ("iw_same_tick", iw_same_tick), ("fuse_fb", fuse_fb),
                            ("lanes", lanes)):
            if value not in (True, False, "auto"):
                raise PipelineError(f"{name} must be True, False or 'auto', got {value!r}.")
        if refine != "auto" and (isinstance(refine, bool) or not isinstance(refine, int)
                                 or refine < 0):
            raise PipelineError(
                f"refine must be 'auto' or a number of evaluations >= 0, got {refine!r}.")
        if backend in ("gpu", "tpu") and iw_same_tick is True:
            raise packed_w_error(backend)
        self.backend = backend
        self.overlap = overlap
        self.refine = refine
        self.fuse_fb = fuse_fb
        if share_bodies not in (True, False, "auto", "devices"):
            raise PipelineError(f"share_bodies must be True, False, 'devices' or 'auto', "
                                f"got {share_bodies!r}.")
        self.share_bodies = share_bodies
        self.split_backward = split_backward
        self.iw_same_tick = iw_same_tick
        self.lanes = lanes
        #: why the lanes were turned down, for a runtime standing in for one that wanted
        #: them (:meth:`~.runtime.SpmdRuntime.instead_of`)
        self.lanes_declined: str | None = None

    def options(self) -> dict[str, Any]:
        """The options as the constructor takes them (in its order)."""
        return {"backend": self.backend, "overlap": self.overlap,
                "share_bodies": self.share_bodies, "split_backward": self.split_backward,
                "iw_same_tick": self.iw_same_tick, "fuse_fb": self.fuse_fb,
                "refine": self.refine, "lanes": self.lanes}

    def resolve_backend(self, mesh: Any = None) -> str:
        """The program built for ``mesh`` (``backend="auto"``: its devices' platform)."""
        if self.backend != "auto":
            return self.backend
        platform = platform_of(mesh)
        return "cpu" if platform == "cpu" else ("tpu" if platform == "tpu" else "gpu")

    def accelerated(self, mesh: Any = None) -> bool:
        """Whether the accelerator program runs on ``mesh``."""
        return self.resolve_backend(mesh) != "cpu"

    def resolve_refine(self, mesh: Any = None) -> int:
        """Local-search evaluations the lowering runs (``refine="auto"`` resolved)."""
        if self.refine != "auto":
            return self.refine
        return REFINE_EVALS if self.accelerated(mesh) or concurrent(mesh) else 0

    def resolve_iw_same_tick(self, mesh: Any = None) -> bool:
        """Whether a W runs in its own I's tick (``iw_same_tick="auto"`` resolved)."""
        if self.iw_same_tick != "auto":
            return bool(self.iw_same_tick)
        return not (self.accelerated(mesh) or concurrent(mesh))

    def resolve_split(self, mesh: Any = None, mesh_axes: Any = None) -> bool:
        if self.split_backward != "auto":
            return bool(self.split_backward)
        return self.accelerated(mesh) and not self.wants_lanes(mesh, mesh_axes)

    def wants_lanes(self, mesh: Any = None, mesh_axes: Any = None) -> bool:
        """Whether the lanes program is wanted (``lanes=True``, or ``"auto"`` where a
        mesh axis left to JAX's sharding inside the stages has more than one device);
        the schedule may still refuse it (:func:`.lowering.lanes.lanes_refusal`)."""
        if self.lanes != "auto":
            return bool(self.lanes)
        if mesh is None or mesh_axes is None:
            return False
        return any(mesh.shape[a] > 1 for a in mesh.axis_names
                   if a not in mesh_axes.manual_axes)

    def resolve_share(self, mesh: Any = None, mesh_axes: Any = None) -> bool | str:
        """How stages share bodies (``share_bodies="auto"`` resolved)."""
        if self.share_bodies != "auto":
            return self.share_bodies
        by_devices = (not self.accelerated(mesh) and concurrent(mesh)
                      and not self.wants_lanes(mesh, mesh_axes))
        return "devices" if by_devices else True

