"""Accelerators by name, as meshes of compile-only devices: compile for hardware you lack.

XLA's TPU compiler (libtpu) and CUDA compiler (the jax-cuda12 plugin with ptxas) both
compile a JAX program for a device that is not there: ``jax.experimental.topologies``
gives *compile-only* devices of a named topology, a ``Mesh`` over them lowers and
compiles like any other, and ``compiled.memory_analysis()`` says what one device holds.
Nothing can run on such devices and nothing can be placed on them.

:func:`target` turns a name into a :class:`Target`:

- ``"tpu:v5e:2x4"``, ``"tpu:v5p:2x2x2"``, ``"tpu:v6e:2x2"``, ``"tpu:v4:2x2x1"``: a TPU
  topology as libtpu names it (generation, then chips per dimension);
- ``"gpu:h200:8"``, ``"gpu:h100:2x8"``: a GPU kind from :data:`GPUS` and the number of
  GPUs (or hosts x GPUs per host). The CUDA compiler needs the GPU's description (SM
  count, shared memory, compute capability, memory), which :data:`GPUS` gives from the
  vendors' published figures.

Install what the compilers need with ``pip install 'jaxpipe[aot]'``. With the CUDA
plugin installed on a machine without a GPU, set ``JAX_PLATFORMS=cpu`` before JAX starts
(the plugin otherwise fails to start and registers nothing); ``jaxpipe compile`` does.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxpipe.errors import PipelineError
from jaxpipe.sharding import device_memory

__all__ = ["GPUS", "TPUS", "GpuSpec", "Target", "target"]


@dataclass(frozen=True)
class GpuSpec:
    """The published figures of one GPU kind that XLA's CUDA compiler reads.

    ``name`` becomes the compile-only devices' ``device_kind``; ``memory`` is the bytes
    of device memory (the cutter's budget and the fit check use it).
    """

    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    memory: int
    memory_bandwidth: int  # bytes/s
    l2_cache: int
    clock_ghz: float
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    fp32_per_sm: int = 128

    def config(self) -> str:
        """The ``stream_executor.GpuTargetConfigProto`` text the CUDA compiler takes."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {self.sm_count}
  fpus_per_core: {self.fp32_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth}
  l2_cache_size: {self.l2_cache}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{self.name}"
"""


_GIB = 1 << 30

#: GPU kinds :func:`target` knows (vendor data sheets: SMs, memory, bandwidth, L2, boost
#: clock, shared memory per SM).
GPUS: dict[str, GpuSpec] = {
    "a100": GpuSpec("NVIDIA A100-SXM4-80GB", (8, 0), 108, 80 * _GIB, 2_039_000_000_000,
                    40 << 20, 1.41, 167936, 166912, 64),
    "a100-40": GpuSpec("NVIDIA A100-SXM4-40GB", (8, 0), 108, 40 * _GIB, 1_555_000_000_000,
                       40 << 20, 1.41, 167936, 166912, 64),
    "h100": GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), 132, 80 * _GIB, 3_350_000_000_000,
                    50 << 20, 1.98, 233472, 232448),
    "h200": GpuSpec("NVIDIA H200", (9, 0), 132, 141 * _GIB, 4_800_000_000_000,
                    50 << 20, 1.98, 233472, 232448),
    "b200": GpuSpec("NVIDIA B200", (10, 0), 148, 180 * _GIB, 8_000_000_000_000,
                    126 << 20, 1.965, 233472, 232448),
}

#: TPU generations :func:`target` knows: the name libtpu's topologies use.
TPUS = ("v4", "v5e", "v5p", "v6e")


@dataclass(frozen=True)
class Target:
    """A named accelerator topology of compile-only devices.

    Attributes:
      name: as given, e.g. ``"tpu:v5e:2x4"``.
      platform: ``"tpu"`` or ``"gpu"``.
      devices: the compile-only devices, in the topology's order.
      device_kind: their ``device_kind`` (``"TPU v5 lite"``, ``"NVIDIA H200"``).
      memory: bytes of memory one device's program may use.
    """

    name: str
    platform: str
    devices: tuple[Any, ...]
    device_kind: str
    memory: int

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def mesh(self, shape: tuple[int, ...] | dict[str, int], axis_names: tuple[str, ...] = (),
             *, axis_types: Any = None) -> Any:
        """A ``jax.sharding.Mesh`` over this target's devices.

        ``shape``: sizes per axis with ``axis_names`` (``mesh((2, 4), ("data", "pipe"))``),
        or a dict ``{"pipe": 4, "data": 2}``; their product must be the device count.
        ``axis_types`` as ``jax.make_mesh`` takes them (default: every axis Explicit, as
        ``jax.make_mesh`` makes them).
        """
        import jax
        from jax.experimental import mesh_utils

        if isinstance(shape, dict):
            shape, axis_names = tuple(shape.values()), tuple(shape)
        shape, axis_names = tuple(int(s) for s in shape), tuple(axis_names)
        if len(shape) != len(axis_names):
            raise PipelineError(f"mesh shape {shape} and axis names {axis_names} differ in "
                                "length; give one name per axis.")
        if math.prod(shape) != self.num_devices:
            raise PipelineError(
                f"a mesh of shape {dict(zip(axis_names, shape, strict=True))} needs "
                f"{math.prod(shape)} devices; {self.name} has {self.num_devices}.")
        try:
            devices = mesh_utils.create_device_mesh(shape, list(self.devices))
        except (ValueError, NotImplementedError, AssertionError):
            devices = np.array(self.devices, dtype=object).reshape(shape)
        if axis_types is None:
            axis_types = (jax.sharding.AxisType.Explicit,) * len(shape)
        return jax.sharding.Mesh(devices, axis_names, axis_types=axis_types)

    def compiler_options(self) -> dict[str, Any]:
        """The XLA options a pipeline on this target compiles with
        (:func:`jaxpipe.xla_flags.compiler_options`: on GPU the latency-hiding scheduler,
        both permutes in flight and started before the tick's switch; none on TPU). The
        pipeline's own programs carry them; pass them to compile anything else alike."""
        from jaxpipe.xla_flags import compiler_options

        return compiler_options(self.platform) or {}

    def describe(self) -> str:
        return (f"{self.name}: {self.num_devices} x {self.device_kind}, "
                f"{self.memory / _GIB:.2f} GiB each")


_NAME = re.compile(r"^(tpu|gpu):([\w\-]+):(\d+(?:x\d+)*)$")


def target(name: str) -> Target:
    """The compile-only devices of a named accelerator topology.

    ``"tpu:<generation>:<chips per dimension>"`` (``"tpu:v5e:2x4"``, ``"tpu:v5p:2x2x2"``)
    or ``"gpu:<kind>:<count>"`` (``"gpu:h200:8"``; ``"gpu:h100:2x8"`` for 2 hosts of 8).

    Example::

        t = jaxpipe.aot.target("tpu:v5e:2x4")
        mesh = t.mesh((2, 4), ("data", "pipe"))
        pipe = jp.pipeline(loss_fn, abstract_params, abstract_batch, mesh=mesh, ...)
        compiled = pipe.lower("train_step", optimizer=optax.adamw(1e-3)).compile()
    """
    m = _NAME.match(str(name).strip().lower())
    if m is None:
        raise PipelineError(
            f"target {name!r} is not a target name: expected 'tpu:GEN:TOPOLOGY' (e.g. "
            f"'tpu:v5e:2x4', generations {', '.join(TPUS)}) or 'gpu:KIND:COUNT' (e.g. "
            f"'gpu:h200:8', kinds {', '.join(GPUS)}).")
    platform, kind, dims = m.groups()
    if platform == "tpu":
        return _tpu(name, kind, dims)
    return _gpu(name, kind, dims)


def _tpu(name: str, gen: str, dims: str) -> Target:
    if gen not in TPUS:
        raise PipelineError(f"unknown TPU generation {gen!r} in {name!r}; known: "
                            f"{', '.join(TPUS)}.")
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise PipelineError(
            f"compiling for {name!r} needs libtpu, XLA's TPU compiler: pip install "
            "'jaxpipe[aot]' (or the libtpu version your jax's 'tpu' extra pins).") from None
    from jax.experimental import topologies

    # libtpu holds a lockfile so that one process owns a TPU host's chips; compiling for
    # a topology owns none, and several processes (test workers, a benchmark beside a
    # session) may compile at once
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        devices = topologies.get_topology_desc(topology_name=f"{gen}:{dims}",
                                               platform="tpu").devices
    except Exception as e:  # noqa: BLE001 - libtpu's own message says what is wrong
        raise PipelineError(f"libtpu cannot make the topology {gen}:{dims} of {name!r}: "
                            f"{_first_line(e)}") from e
    kind = devices[0].device_kind
    cap = device_memory.capacity(devices[0])
    return Target(name, "tpu", tuple(devices), kind, cap.bytes)


def _gpu(name: str, kind: str, dims: str) -> Target:
    if kind not in GPUS:
        raise PipelineError(f"unknown GPU kind {kind!r} in {name!r}; known: "
                            f"{', '.join(GPUS)}.")
    spec = GPUS[kind]
    counts = [int(x) for x in dims.split("x")]
    if len(counts) > 2 or min(counts) < 1:
        raise PipelineError(f"{name!r}: give the GPU count as N or HOSTSxN, got {dims!r}.")
    hosts, per_host = (1, counts[0]) if len(counts) == 1 else counts
    from jax.experimental import topologies

    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        raise PipelineError(
            f"compiling for {name!r} needs XLA's CUDA compiler: pip install "
            "'jaxpipe[aot]' (jax-cuda12-plugin, jax-cuda12-pjrt and nvidia-cuda-nvcc-cu12 "
            "for ptxas).") from None
    try:
        devices = topologies.get_topology_desc(
            platform="cuda", target_config=spec.config(),
            topology=f"1x{hosts}x{per_host}").devices
    except Exception as e:  # noqa: BLE001
        hint = ""
        if os.environ.get("JAX_PLATFORMS", "") != "cpu":
            hint = (" On a machine without a GPU the CUDA plugin fails to start and "
                    "registers nothing: set JAX_PLATFORMS=cpu before importing jax.")
        raise PipelineError(f"the CUDA compiler cannot make the topology of {name!r}: "
                            f"{_first_line(e)}.{hint}") from e
    device_memory.register(devices[0].device_kind, spec.memory)
    return Target(name, "gpu", tuple(devices), devices[0].device_kind, spec.memory)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
