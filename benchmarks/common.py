"""Shared pieces of the benchmark suite: a GPT-like model, FLOP counts, timing and memory.

The model is written in plain JAX (a params dict, no framework) so that the three things
being compared -- plain JAX, jaxpipe and the SPMD GPipe baseline -- run *exactly* the same
math:

* :func:`block` is one pre-layernorm decoder block (causal multi-head self-attention +
  GELU MLP). All blocks have the same shapes (homogeneous), so the stacked-weights
  baseline applies.
* :func:`gpt_loss` is a full GPT: token + position embedding, ``n_layers`` blocks with a
  :func:`jaxpipe.boundary` after every block but the last (so ``cut="markers"`` groups
  whole blocks evenly into stages; the head and loss ride with the last block), final
  layernorm, untied output head, next-token cross entropy.
* :func:`blocks_loss` is the block stack alone on float activations with a mean-squared
  loss: the part of a GPT that a MaxText-style pipeline actually pipelines. The
  baseline comparison uses it on both sides so both do identical work.

Timing helpers return medians of repeated runs after warm-up, plus the process CPU time
(all threads), which is less sensitive to other processes competing for the cores.
"""

from __future__ import annotations

import ast
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxpipe as jp

__all__ = [
    "GPTConfig",
    "init_params",
    "block",
    "gpt_loss",
    "blocks_loss",
    "make_gpt_batch",
    "make_blocks_batch",
    "plain_value_and_grad",
    "plain_train_step",
    "model_flops",
    "time_compiled",
    "time_interleaved",
    "compile_timed",
    "memory_stats",
    "peak_flops_per_device",
]

# ----------------------------------------------------------------------------- model


@dataclass(frozen=True)
class GPTConfig:
    """Size of the GPT-like model. ``d_model`` must be divisible by ``n_heads``."""

    vocab: int = 256
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 8
    seq: int = 32
    mlp_ratio: int = 4
    dtype: str = "float32"

    def asdict(self) -> dict[str, Any]:
        return asdict(self)


def load_example(name: str) -> Any:
    """``examples/<name>.py`` as a module (the examples are scripts, not a package); its
    ``if __name__ == "__main__"`` part does not run."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"jaxpipe_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class _Init:
    """Parameter values drawn from ``key``: :meth:`normal` (a fresh draw per call),
    :meth:`ones`, :meth:`zeros`, as ``jax.Array`` s of ``dtype``.

    A concrete key draws from numpy's generator seeded with the key's data and builds
    every array on the host: eager ``jax.random`` and jnp arithmetic compile a program
    per shape and op, 1.5-2.5 s of a benchmark section's model (the parameters are the
    same for every program a section compares, so where they come from does not
    matter). Under a trace (``jax.eval_shape`` of a model too big to hold), jax.random,
    which such a trace never runs."""

    def __init__(self, key: jax.Array, dtype: Any) -> None:
        self.dtype = jnp.dtype(dtype)
        self.traced = isinstance(key, jax.core.Tracer)
        self.key, self.count = key, 0
        if not self.traced:
            self.rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).tolist())

    def normal(self, shape: tuple[int, ...], scale: float) -> jax.Array:
        if self.traced:
            self.count += 1
            x = jax.random.normal(jax.random.fold_in(self.key, self.count), shape, jnp.float32)
            return (x * scale).astype(self.dtype)
        return jnp.asarray((self.rng.standard_normal(shape, np.float32) * np.float32(scale))
                           .astype(self.dtype))

    def dense(self, shape: tuple[int, ...]) -> jax.Array:
        return self.normal(shape, 1 / math.sqrt(shape[0]))

    def ones(self, shape: tuple[int, ...]) -> jax.Array:
        return jnp.asarray(np.ones(shape, self.dtype))

    def zeros(self, shape: tuple[int, ...]) -> jax.Array:
        return jnp.asarray(np.zeros(shape, self.dtype))


def init_block(cfg: GPTConfig, key: jax.Array) -> dict[str, jax.Array]:
    """Parameters of one decoder block."""
    return _block_params(cfg, _Init(key, cfg.dtype))


def _block_params(cfg: GPTConfig, init: _Init) -> dict[str, jax.Array]:
    d, f = cfg.d_model, cfg.d_model * cfg.mlp_ratio
    return {
        "ln1_g": init.ones((d,)), "ln1_b": init.zeros((d,)),
        "wqkv": init.dense((d, 3 * d)), "wo": init.dense((d, d)),
        "ln2_g": init.ones((d,)), "ln2_b": init.zeros((d,)),
        "w1": init.dense((d, f)), "b1": init.zeros((f,)),
        "w2": init.dense((f, d)), "b2": init.zeros((d,)),
    }


def init_params(cfg: GPTConfig, key: jax.Array, *, embed: bool = True) -> dict[str, Any]:
    """``{"blocks": [block params] * n_layers}`` plus embedding/head when ``embed``."""
    init = _Init(key, cfg.dtype)
    params: dict[str, Any] = {"blocks": [_block_params(cfg, init)
                                         for _ in range(cfg.n_layers)]}
    if embed:
        params["embed"] = init.normal((cfg.vocab, cfg.d_model), 0.02)
        params["pos"] = init.normal((cfg.seq, cfg.d_model), 0.02)
        params["lnf_g"] = init.ones((cfg.d_model,))
        params["lnf_b"] = init.zeros((cfg.d_model,))
        params["head"] = init.dense((cfg.d_model, cfg.vocab))
    return params


def _layernorm(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g + b


def block(p: dict[str, jax.Array], h: jax.Array, n_heads: int) -> jax.Array:
    """One pre-LN decoder block on ``h: [batch, seq, d_model]``."""
    b, s, d = h.shape
    dh = d // n_heads
    x = _layernorm(h, p["ln1_g"], p["ln1_b"])
    q, k, v = jnp.split(x @ p["wqkv"], 3, axis=-1)
    q, k, v = (t.reshape(b, s, n_heads, dh) for t in (q, k, v))
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
    causal = jnp.tril(jnp.ones((s, s), bool))
    att = jax.nn.softmax(jnp.where(causal, att, jnp.finfo(att.dtype).min), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d)
    h = h + out @ p["wo"]
    x = _layernorm(h, p["ln2_g"], p["ln2_b"])
    return h + jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def _run_blocks(blocks: list[dict[str, jax.Array]], h: jax.Array, n_heads: int) -> jax.Array:
    for i, bp in enumerate(blocks):
        h = block(bp, h, n_heads)
        if i < len(blocks) - 1:
            h = jp.boundary(h)  # identity outside a pipeline trace
    return h


def _scan_blocks(blocks: dict[str, jax.Array], h: jax.Array, n_heads: int) -> jax.Array:
    """The blocks as one ``lax.scan`` over stacked weights, a boundary in its body."""

    def body(h: jax.Array, bp: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        return jp.boundary(block(bp, h, n_heads)), None

    return jax.lax.scan(body, h, blocks)[0]


def stack_blocks(params: dict) -> dict:
    """``params`` with ``blocks`` stacked along a leading layer axis (for ``scanned``)."""
    return {**params, "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *params["blocks"])}


def gpt_loss(cfg: GPTConfig, *, scanned: bool = False) -> Callable[[dict, dict], jax.Array]:
    """Per-microbatch next-token cross entropy of the full GPT (``batch = {"x", "y"}`` ids).

    ``scanned``: the blocks' weights are stacked (:func:`stack_blocks`) and run by one
    ``lax.scan``, as MaxText-style models do.
    """

    def loss_fn(params: dict, batch: dict) -> jax.Array:
        h = params["embed"][batch["x"]] + params["pos"][None]
        h = (_scan_blocks if scanned else _run_blocks)(params["blocks"], h, cfg.n_heads)
        h = _layernorm(h, params["lnf_g"], params["lnf_b"])
        logits = (h @ params["head"]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, batch["y"][..., None], axis=-1))

    return loss_fn


def blocks_loss(cfg: GPTConfig) -> Callable[[dict, dict], jax.Array]:
    """Per-microbatch MSE of the block stack on float activations (``batch = {"x", "y"}``)."""

    def loss_fn(params: dict, batch: dict) -> jax.Array:
        h = _run_blocks(params["blocks"], batch["x"], cfg.n_heads)
        return jnp.mean(jnp.square(h - batch["y"]).astype(jnp.float32))

    return loss_fn


def make_gpt_batch(cfg: GPTConfig, batch_size: int, seed: int = 0) -> dict[str, jax.Array]:
    """Random token ids ``x`` and targets ``y`` of shape ``[batch_size, seq]``."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab, size=(batch_size, cfg.seq + 1), dtype=np.int32)
    return {"x": jnp.asarray(ids[:, :-1]), "y": jnp.asarray(ids[:, 1:])}


def make_blocks_batch(cfg: GPTConfig, batch_size: int, seed: int = 0) -> dict[str, jax.Array]:
    """Random activations ``x`` and targets ``y`` of shape ``[batch_size, seq, d_model]``."""
    rng = np.random.default_rng(seed)
    shape = (batch_size, cfg.seq, cfg.d_model)
    return {"x": jnp.asarray(rng.standard_normal(shape), cfg.dtype),
            "y": jnp.asarray(rng.standard_normal(shape), cfg.dtype)}


def plain_value_and_grad(loss_fn: Callable, num_microbatches: int,
                         microbatch_sharding: Any = None) -> Callable:
    """Plain JAX reference step: ``lax.scan`` over microbatches accumulating value and grad.

    Returns an (unjitted) ``f(params, batch) -> (mean loss, grads)``; the mean is over
    microbatches, like :meth:`jaxpipe.Pipeline.value_and_grad`. ``microbatch_sharding``
    (e.g. ``NamedSharding(mesh, P(None, "data"))``) places the ``[m, rows, ...]``
    microbatches so that every microbatch is split over the data axes, as a pipeline
    splits them; without it, reshaping a batch sharded on its rows puts the sharding on
    the microbatch axis and each scan step runs on one data shard's rows.
    """
    vg = jax.value_and_grad(loss_fn)

    def step(params: Any, batch: Any) -> tuple[jax.Array, Any]:
        mbs = jax.tree.map(
            lambda x: x.reshape(num_microbatches, x.shape[0] // num_microbatches, *x.shape[1:]),
            batch)
        if microbatch_sharding is not None:
            mbs = jax.lax.with_sharding_constraint(mbs, microbatch_sharding)

        def body(carry, mb):
            loss, g = carry
            l_mb, g_mb = vg(params, mb)
            return (loss + l_mb, jax.tree.map(jnp.add, g, g_mb)), None

        init = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, g), _ = jax.lax.scan(body, init, mbs)
        return loss / num_microbatches, jax.tree.map(lambda x: x / num_microbatches, g)

    return step


def plain_train_step(value_and_grad: Callable, optimizer: Any) -> Callable:
    """Plain JAX's train step around ``value_and_grad`` (e.g. :func:`plain_value_and_grad`):
    an (unjitted) ``f(params, opt_state, batch) -> (params, opt_state, loss)`` applying
    ``optimizer``'s update, the yardstick for a pipeline's ``train_step``."""
    import optax

    def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        loss, grads = value_and_grad(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


# ----------------------------------------------------------------------------- FLOPs


def model_flops(cfg: GPTConfig, tokens: int, *, embed: bool = True) -> float:
    """Analytic training FLOPs (forward + backward = 3x forward) for ``tokens`` tokens.

    Counts matmuls only: per token and block ``24 d^2`` (QKV 6d^2, output 2d^2, MLP
    16d^2 at ratio 4, generalised to ``2 d^2 (4 + 2 r)``) plus attention ``4 s d``
    (scores and weighted sum, full square as computed); the head adds ``2 d V``.
    """
    d, s = cfg.d_model, cfg.seq
    per_block = 2 * d * d * (4 + 2 * cfg.mlp_ratio) + 4 * s * d
    fwd = cfg.n_layers * per_block + (2 * d * cfg.vocab if embed else 0)
    return 3.0 * fwd * tokens


def peak_flops_per_device(device: jax.Device) -> float | None:
    """Nominal dense peak FLOP/s of one accelerator (bf16/fp16 tensor core), or None."""
    kind = getattr(device, "device_kind", "").lower()
    table = {
        "h200": 989e12, "h100": 989e12, "a100": 312e12, "l4": 121e12, "a10": 125e12,
        "v100": 125e12, "t4": 65e12, "tpu v4": 275e12, "tpu v5 lite": 197e12,
        "tpu v5e": 197e12, "tpu v5p": 459e12, "tpu v5": 459e12, "tpu v6": 918e12,
    }
    for name, peak in table.items():
        if name in kind:
            return peak
    return None


# ----------------------------------------------------------------------------- timing


def compile_timed(jitted: Any, *args: Any) -> tuple[Any, float, float]:
    """``(compiled, lower seconds, compile seconds)`` for a ``jax.jit`` object."""
    t0 = time.perf_counter()
    lowered = jitted.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return compiled, t1 - t0, t2 - t1


def time_compiled(fn: Callable, *args: Any, warmup: int = 2, repeats: int = 7) -> dict[str, Any]:
    """Wall and process-CPU time of ``fn(*args)`` (blocked), ``warmup`` runs discarded.

    Returns ``median_s``, ``min_s``, ``cpu_median_s`` and every wall time in ``times_s``.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    walls, cpus = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        jax.block_until_ready(fn(*args))
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return {
        "median_s": statistics.median(walls),
        "min_s": min(walls),
        "cpu_median_s": statistics.median(cpus),
        "times_s": walls,
    }


def time_interleaved(runs: dict[str, tuple[Callable, tuple]], warmup: int = 2,
                     repeats: int = 7) -> dict[str, dict[str, Any]]:
    """Like :func:`time_compiled` for several programs, timed round-robin.

    Each round runs every program once, so a change in machine load during the
    measurement affects all of them alike; the ratios of medians are then fairer.
    """
    for fn, args in runs.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    walls: dict[str, list[float]] = {k: [] for k in runs}
    cpus: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for k, (fn, args) in runs.items():
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(fn(*args))
            walls[k].append(time.perf_counter() - t0)
            cpus[k].append(time.process_time() - c0)
    return {k: {"median_s": statistics.median(walls[k]), "min_s": min(walls[k]),
                "cpu_median_s": statistics.median(cpus[k]), "times_s": walls[k]}
            for k in runs}


def memory_stats(compiled: Any) -> dict[str, int]:
    """Per-device byte counts from ``compiled.memory_analysis()``.

    ``total_bytes = argument + output + temp - alias`` (aliased outputs reuse argument
    buffers); ``temp`` is the scratch the program needs beyond its inputs and outputs:
    activations, residuals, pipeline buffers.
    """
    ma = compiled.memory_analysis()
    if ma is None:
        return {"argument_bytes": -1, "output_bytes": -1, "temp_bytes": -1, "alias_bytes": -1,
                "total_bytes": -1}
    arg, out = int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes)
    temp, alias = int(ma.temp_size_in_bytes), int(ma.alias_size_in_bytes)
    return {"argument_bytes": arg, "output_bytes": out, "temp_bytes": temp,
            "alias_bytes": alias, "total_bytes": arg + out + temp - alias}


# ----------------------------------------------------------------------------- schedules


def gallery_schedules() -> list[tuple[str, Callable[[int, int], jp.Schedule]]]:
    """(name, factory) for every Schedule subclass defined in ``schedules/*.py``."""
    out = []
    for path in sorted((Path(__file__).resolve().parent.parent / "schedules").glob("*.py")):
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:
            continue
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            try:
                cls = jp.load_schedule(f"{path}:{node.name}")
            except Exception:  # noqa: BLE001 - not a schedule / not loadable: skip
                continue
            if isinstance(cls, type) and issubclass(cls, jp.Schedule):
                out.append((f"{cls.__name__}", lambda p, m, cls=cls: cls(p, m)))
    return out


def write_json(out_dir: str | Path, name: str, data: Any, indent: int = 2,
               default: Callable[[Any], Any] | None = None) -> Path:
    """Write ``data`` as JSON to ``out_dir / name`` (the folder made if missing)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(data, indent=indent, default=default))
    return path
