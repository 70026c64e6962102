"""Train a small character-level GPT with pipeline parallelism (the jaxpipe main job).

    python examples/gpt.py                      # 4 virtual CPU devices, 1F1B, auto cut
    python examples/gpt.py --schedule gpipe --microbatches 8
    python examples/gpt.py --schedule schedules/zero_bubble.py:ZeroBubbleH1
    python examples/gpt.py --plain              # same model, plain single-device JAX
    python examples/gpt.py --scan-layers        # the blocks as one nnx.scan over stacked weights
    python examples/gpt.py --mesh pipe=2,fsdp=2,tp=2     # + FSDP and tensor parallelism
    python examples/gpt.py --target tpu:v5e:2x4 # compile for a TPU (or gpu:h200:8): memory, fit

The model is a GPT written in flax nnx: token + position embeddings, the token
embedding tied to the output head (``logits = h @ embed.T``), ``--layers`` decoder
blocks (causal self-attention + MLP, pre-layernorm), each decorated with
``@jp.layer`` so the cutter may place a stage boundary after any block. The tied
embedding is used by the first stage (lookup) and the last (head): jaxpipe keeps a
copy on both and sums their gradients.

With ``--scan-layers`` the same GPT keeps its blocks' weights stacked (``nnx.vmap`` at
init) and runs them with one ``nnx.scan``, as MaxText-style models do; the model code is
otherwise unchanged. jaxpipe cuts the scan between iterations: each stage scans its own
blocks and holds only their rows of the stacked weights.

With ``--mesh pipe=2,fsdp=2,tp=2`` the pipeline runs inside a bigger mesh, written as
flax's own examples write sharded models: the mesh is ``jax.make_mesh``'s default (every
axis Explicit: sharding in types), the model is built under ``jax.set_mesh``, its weights
carry ``out_sharding`` metadata (FSDP over ``fsdp``, Megatron tensor parallelism over
``tp``: :class:`Sharding`) and its layers pass their activations' sharding to their
contractions (``out_sharding=``). The batch is placed split over ``fsdp`` (and ``data``,
an axis that only splits the batch). No sharding argument reaches the pipeline: it keeps
what the weights and the batch were placed with. Each device holds ~1/8 of the weights
(the busiest 1.08 x total/8 at the default size).

The corpus is the Python standard library's own source code (present on every
machine, no download), read as characters. Files are taken in sorted order; the last
10% of the characters (whole, different files) are held out for evaluation. Training
documents have random lengths, padded to the context: the loss is the per-token
cross-entropy over the batch's real tokens (``reduction="weighted"``: each microbatch
returns its summed loss and its token count), and the token accuracy comes back as an
aux output (``has_aux=True``). The held-out loss and accuracy are evaluated through the
pipeline too (``pipe.loss(state, batch)``: forward only, on the train state's stage
layout), so no part of the run leaves the pipeline.

The script prints the pipeline plan, the schedule's timeline, a progress bar (loss,
tokens/s), then the final train / held-out loss and accuracy next to the uniform-guess
loss ln(vocab), and on its last line ``RESULT {json}`` (a summary) for scripts and
tests. ``main(argv)`` returns the same dict.

Virtual CPU devices run one after another, so tokens/s here measures the
pipeline's overhead, not its speed-up; on real accelerators the stages overlap.
"""

from __future__ import annotations

import os
import sys


def _force_cpu_devices(argv: list[str]) -> None:
    """Ask XLA for enough virtual CPU devices; must run before jax is imported."""
    n = 4
    for i, a in enumerate(argv):  # a cheap pre-parse: argparse runs after jax import
        if a == "--stages" and i + 1 < len(argv) and argv[i + 1].isdigit():
            n = max(n, int(argv[i + 1]))
        elif a.startswith("--stages="):
            n = max(n, int(a.split("=", 1)[1]))
        elif a.startswith("--mesh"):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv)
                                                         else "")
            count = 1
            for part in value.split(","):  # name=size,...; argparse reports bad ones
                size = part.partition("=")[2]
                count *= int(size) if size.isdigit() else 1
            n = max(n, count)
    from jaxpipe.xla_flags import cpu_devices  # (imports no jax)

    cpu_devices(n)


if __name__ == "__main__":
    _force_cpu_devices(sys.argv[1:])
    from jaxpipe.xla_flags import cpu_unless_attached

    # no GPU/TPU attached: the CPU, even where jaxpipe[aot] installed their compilers
    # (compile-only devices for --target need no backend of their own)
    cpu_unless_attached()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpipe as jp  # noqa: E402

# ----------------------------------------------------------------------------- data

# A fixed character vocabulary (tab, newline, printable ASCII, one "unknown"), so the
# token ids do not depend on which Python version's sources were read.
CHARS = "\t\n" + "".join(chr(c) for c in range(32, 127))
UNK = len(CHARS)
VOCAB = len(CHARS) + 1
_LOOKUP = np.full(0x110000, UNK, dtype=np.int32)
_LOOKUP[[ord(c) for c in CHARS]] = np.arange(len(CHARS), dtype=np.int32)


def stdlib_corpus(max_chars: int) -> str:
    """Up to ``max_chars`` characters of the standard library's ``*.py`` files, sorted by name."""
    root = os.path.dirname(os.__file__)
    parts, total = [], 0
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
            text = f.read()
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def encode(text: str) -> np.ndarray:
    """Character ids (``int32``) under the fixed vocabulary ``CHARS`` (+ ``UNK``)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return _LOOKUP[codes]


def load_data(max_chars: int, heldout_frac: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train ids, held-out ids): the corpus split at ``1 - heldout_frac``."""
    ids = encode(stdlib_corpus(max_chars))
    split = int(len(ids) * (1 - heldout_frac))
    return ids[:split], ids[split:]


def _windows(ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray, seq: int) -> dict:
    """Documents of ``lengths`` characters from ``starts``, padded to ``seq``: ``x`` the
    characters, ``y`` the next ones, ``mask`` 1 on a document's real positions."""
    idx = starts[:, None] + np.arange(seq + 1)[None, :]
    windows = ids[idx]
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float32)
    return {"x": np.where(mask > 0, windows[:, :-1], 0).astype(np.int32),
            "y": windows[:, 1:], "mask": mask}


def sample_batch(ids: np.ndarray, rng: np.random.Generator, batch: int, seq: int) -> dict:
    """Random documents of random lengths (a quarter of ``seq`` to all of it), padded:
    rows hold very different numbers of real tokens, as packed or padded corpora do."""
    starts = rng.integers(0, len(ids) - seq - 1, size=batch)
    lengths = rng.integers(max(1, seq // 4), seq + 1, size=batch)
    return _windows(ids, starts, lengths, seq)


def heldout_batches(ids: np.ndarray, batch: int, seq: int, n: int) -> list[dict]:
    """``n`` fixed, evenly spaced held-out batches of whole windows (deterministic)."""
    starts = np.linspace(0, len(ids) - seq - 2, batch * n).astype(np.int64)
    full = np.full(batch, seq)
    return [_windows(ids, s, full, seq) for s in starts.reshape(n, batch)]


# ----------------------------------------------------------------------------- model


@dataclasses.dataclass(frozen=True)
class Config:
    """GPT hyper-parameters."""

    vocab: int = VOCAB
    seq: int = 128
    layers: int = 4
    width: int = 128
    heads: int = 4
    mlp_ratio: int = 4


@dataclasses.dataclass(frozen=True)
class Sharding:
    """Where the GPT's arrays live on the mesh, one ``PartitionSpec`` per kind of array (as
    flax's Gemma example writes its ``ShardingConfig``). ``None`` everywhere (the default):
    nothing is sharded. The weights carry theirs as flax metadata (``out_sharding``), the
    layers pass the activations' to their contractions (``out_sharding=``): under a mesh
    with Explicit axes (``jax.make_mesh``'s default) the types carry the sharding."""

    embed_vd: P | None = None  # token embedding [vocab, width], tied to the output head
    pos_td: P | None = None  # position embedding [seq, width]
    act_td: P | None = None  # the positions' embeddings [seq, width]
    w_df: P | None = None  # column-parallel kernels [width, out]: q, k, v, MLP in
    w_fd: P | None = None  # row-parallel kernels [in, width]: attention out, MLP out
    b_f: P | None = None  # the column-parallel layers' biases
    act_btd: P | None = None  # the residual stream [batch, seq, width] (and the logits)
    act_btf: P | None = None  # column-parallel outputs [batch, seq, heads or hidden]

    @staticmethod
    def for_mesh(axis_names: tuple[str, ...]) -> Sharding:
        """FSDP over ``fsdp`` (weights split on their width dimension, the batch too) and
        Megatron tensor parallelism over ``tp``; ``data`` (the pipeline splits the batch
        over it by hand) and ``pipe`` shard no weight."""
        if "fsdp" not in axis_names and "tp" not in axis_names:
            return Sharding()
        fsdp = "fsdp" if "fsdp" in axis_names else None
        tp = "tp" if "tp" in axis_names else None
        # Tables are split along their rows: a lookup (nnx.Embed's auto_axes gather) in a
        # table split along its width aborts XLA:CPU's SPMD partitioner inside the
        # pipeline, and so does one whose rows are split over fsdp alone. The vocabulary
        # (98) splits over tp only; the positions over both.
        rows = tuple(a for a in (tp, fsdp) if a is not None)
        return Sharding(embed_vd=P(tp, None), pos_td=P(rows, None), act_td=P(),
                        w_df=P(fsdp, tp), w_fd=P(tp, fsdp), b_f=P(tp),
                        act_btd=P(fsdp, None, None), act_btf=P(fsdp, None, tp))


def _meta(spec: P | None) -> dict:
    return {} if spec is None else {"out_sharding": spec}


def _init() -> nnx.Initializer:
    return nnx.initializers.normal(0.02)


def _residual_init(cfg: Config) -> nnx.Initializer:
    # Projections back into the residual stream are scaled down with depth (GPT-2), so
    # the stream's variance does not grow with the number of blocks.
    return nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.layers))


def _column(cfg: Config, shd: Sharding, out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(cfg.width, out, kernel_init=_init(), kernel_metadata=_meta(shd.w_df),
                      bias_metadata=_meta(shd.b_f), rngs=rngs)


def _row(cfg: Config, shd: Sharding, inp: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(inp, cfg.width, kernel_init=_residual_init(cfg),
                      kernel_metadata=_meta(shd.w_fd), rngs=rngs)


class CausalSelfAttention(nnx.Module):
    """Multi-head self-attention where position t only attends to positions <= t; the
    heads are split over the tensor-parallel axis."""

    def __init__(self, cfg: Config, shd: Sharding, *, rngs: nnx.Rngs):
        self.heads, self.shd = cfg.heads, shd
        self.q, self.k, self.v = (_column(cfg, shd, cfg.width, rngs) for _ in range(3))
        self.proj = _row(cfg, shd, cfg.width, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        # [b, t, d] -> [b, t, heads, d/heads]
        q, k, v = (f(x, out_sharding=self.shd.act_btf).reshape(b, t, self.heads, -1)
                   for f in (self.q, self.k, self.v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return self.proj(out.reshape(b, t, d), out_sharding=self.shd.act_btd)


@jp.layer
class Block(nnx.Module):
    """A pre-layernorm decoder block; ``@jp.layer`` makes each call one cuttable unit."""

    def __init__(self, cfg: Config, shd: Sharding, *, rngs: nnx.Rngs):
        self.shd = shd
        self.ln1 = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.attn = CausalSelfAttention(cfg, shd, rngs=rngs)
        self.ln2 = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.fc = _column(cfg, shd, cfg.mlp_ratio * cfg.width, rngs)
        self.out = _row(cfg, shd, cfg.mlp_ratio * cfg.width, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        hidden = jax.nn.gelu(self.fc(self.ln2(x), out_sharding=self.shd.act_btf))
        return x + self.out(hidden, out_sharding=self.shd.act_btd)


class GPT(nnx.Module):
    """Decoder-only transformer with the token embedding tied to the output head."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs, scan_layers: bool = False,
                 sharding: Sharding = Sharding()):
        self.shd = sharding
        self.embed = nnx.Embed(cfg.vocab, cfg.width, embedding_init=_init(),
                               embedding_metadata=_meta(sharding.embed_vd), rngs=rngs)
        self.pos = nnx.Embed(cfg.seq, cfg.width, embedding_init=nnx.initializers.normal(0.01),
                             embedding_metadata=_meta(sharding.pos_td), rngs=rngs)
        self.scan_layers = scan_layers
        if scan_layers:
            # One Block whose every weight has a leading [layers] axis.
            @nnx.split_rngs(splits=cfg.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked(rngs: nnx.Rngs) -> Block:
                return Block(cfg, sharding, rngs=rngs)

            self.blocks = stacked(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, sharding, rngs=rngs) for _ in range(cfg.layers)])
        self.ln_f = nnx.LayerNorm(cfg.width, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits ``[batch, seq, vocab]`` for integer ``tokens`` ``[batch, seq]``."""
        positions = self.pos(jnp.arange(tokens.shape[1]), out_sharding=self.shd.act_td)
        h = self.embed(tokens, out_sharding=self.shd.act_btd) + positions
        if self.scan_layers:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(h: jax.Array, block: Block) -> jax.Array:
                return block(h)

            h = run(h, self.blocks)
        else:
            for block in self.blocks:
                h = block(h)
        # Tied head: the same matrix that embedded the tokens scores the next one.
        return self.embed.attend(self.ln_f(h), out_sharding=self.shd.act_btd)


#: How many times ``loss_fn`` ran (traced) in this process: in the pipelined run, only
#: inside jaxpipe (every forward and every evaluation goes through the pipeline).
LOSS_FN_CALLS = [0]


def loss_fn(model: GPT, batch: dict) -> tuple[tuple[jax.Array, jax.Array], dict]:
    """Next-character cross-entropy (nats) summed over a microbatch's real tokens, and
    their count: the pipeline reduces them as ``sum(loss) / sum(count)`` over the whole
    batch (``reduction="weighted"``), the per-token loss of padded documents. Aux: the
    real tokens predicted right (for the accuracy)."""
    LOSS_FN_CALLS[0] += 1
    logits = model(batch["x"])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    mask = batch["mask"]
    correct = jnp.sum((jnp.argmax(logits, -1) == batch["y"]) * mask)
    return (jnp.sum(nll * mask), jnp.sum(mask)), {"correct": correct, "tokens": jnp.sum(mask)}


def batch_summary(total: Any) -> tuple[float, float]:
    """``(loss, accuracy)`` of ``loss_fn``'s outputs summed over microbatches."""
    (loss_sum, count), aux = total
    return float(loss_sum / count), float(jnp.sum(aux["correct"]) / jnp.sum(aux["tokens"]))


def make_optimizer(lr: float, steps: int, scan_layers: bool = False
                   ) -> optax.GradientTransformation:
    """AdamW, linear warm-up from lr/10, cosine decay to lr/10; no decay on norms and biases
    (matrices only; a stacked block weight has one more axis, the layer)."""
    warmup = max(1, min(100, steps // 10))
    sched = optax.warmup_cosine_decay_schedule(lr / 10, lr, warmup, max(steps, warmup + 1), lr / 10)

    def is_matrix(path: Any, x: jax.Array) -> bool:
        stacked = scan_layers and "blocks" in jax.tree_util.keystr(path)
        return x.ndim - stacked >= 2

    return optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1,
                       mask=lambda p: jax.tree_util.tree_map_with_path(is_matrix, p))


# ----------------------------------------------------------------------------- driver

DEFAULTS = dict(layers=4, width=128, heads=4, seq=128, batch=32, stages=4, microbatches=8,
                steps=200, lr=3e-3, corpus_chars=2_000_000, eval_batches=8)
TINY = dict(layers=4, width=32, heads=2, seq=32, batch=8, stages=4, microbatches=4,
            steps=20, lr=1e-2, corpus_chars=200_000, eval_batches=2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, help="decoder blocks (default 4)")
    p.add_argument("--width", type=int, help="model width (default 128)")
    p.add_argument("--heads", type=int, help="attention heads (default 4)")
    p.add_argument("--seq", type=int, help="context length in characters (default 128)")
    p.add_argument("--batch", type=int, help="sequences per step (default 32)")
    p.add_argument("--stages", type=int, help="pipeline devices (default 4)")
    p.add_argument("--stages-per-device", type=int, default=1,
                   help="virtual stages per device, for interleaved schedules (default 1)")
    p.add_argument("--microbatches", type=int, help="microbatches per step (default 8)")
    p.add_argument("--schedule", default="1f1b",
                   help="built-in name (gpipe, 1f1b, interleaved1f1b) or file.py:Class")
    p.add_argument("--cut", default="auto", help="auto (memory-aware) or markers")
    p.add_argument("--steps", type=int, help="training steps (default 200)")
    p.add_argument("--lr", type=float, help="peak learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-chars", type=int, help="characters of stdlib source to read")
    p.add_argument("--eval-batches", type=int, help="held-out batches to evaluate")
    p.add_argument("--tiny", action="store_true", help="a very small config (tests, smoke runs)")
    p.add_argument("--plain", action="store_true",
                   help="train without the pipeline (plain jax.value_and_grad, one device)")
    p.add_argument("--scan-layers", action="store_true",
                   help="run the blocks as one nnx.scan over stacked weights")
    p.add_argument("--mesh", help="mesh axes, e.g. pipe=2,fsdp=2,tp=2 (the pipe size is the "
                   "number of stages; 'data' splits the batch, 'fsdp' the batch and the "
                   "weights, 'tp' is tensor parallel)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--target", help="compile the train step ahead of time for an accelerator "
                   "this machine need not have (e.g. tpu:v5e:2x4, gpu:h200:8; needs "
                   "pip install 'jaxpipe[aot]') and print its memory, fit and tick loop "
                   "instead of training; --mesh axes must use all its devices (default: "
                   "pipe=--stages, data=the rest)")
    p.add_argument("--json", help="with --target: also write the report as JSON here")
    args = p.parse_args(argv)
    if args.mesh:
        try:
            sizes = dict(parse_mesh(args.mesh))
        except ValueError as err:
            p.error(str(err))
        if "pipe" not in sizes:
            p.error(f"--mesh {args.mesh} has no pipe axis")
        unknown = sorted(set(sizes) - {"pipe", "data", "fsdp", "tp"})
        if unknown:
            p.error(f"--mesh {args.mesh} names axes {unknown}; the GPT knows pipe, data, "
                    "fsdp and tp")
        args.stages = sizes["pipe"]
    if args.target and args.plain:
        p.error("--target compiles the pipeline; it does not combine with --plain")
    base = TINY if args.tiny else DEFAULTS
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def parse_mesh(text: str) -> list[tuple[str, int]]:
    """``"pipe=2,fsdp=2,tp=2"`` -> ``[("pipe", 2), ("fsdp", 2), ("tp", 2)]``."""
    out = []
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name or not size.isdigit():
            raise ValueError(f"--mesh expects name=size,... (e.g. pipe=2,fsdp=2,tp=2), "
                             f"got {text!r}")
        out.append((name.strip(), int(size)))
    return out


def make_mesh(args: argparse.Namespace) -> jax.sharding.Mesh:
    """The pipeline's mesh: ``--stages`` devices on one pipe axis, or ``--mesh``; made
    as JAX users make one today (``jax.make_mesh``: every axis Explicit)."""
    axes = parse_mesh(args.mesh) if args.mesh else [("pipe", args.stages)]
    need = math.prod(size for _, size in axes)
    if len(jax.devices()) < need:
        raise SystemExit(f"the mesh {dict(axes)} needs {need} devices, jax sees "
                         f"{len(jax.devices())}; set XLA_FLAGS=--xla_force_host_platform_"
                         f"device_count={need} before starting Python")
    return jax.make_mesh(tuple(size for _, size in axes), tuple(name for name, _ in axes))


def batch_axes_of(mesh: jax.sharding.Mesh) -> tuple[str, ...]:
    """The mesh axes that split the batch: ``data`` and ``fsdp``."""
    return tuple(a for a in ("data", "fsdp") if a in mesh.axis_names)


def place_batch(batch: dict, mesh: jax.sharding.Mesh) -> dict:
    """The host batch placed split over the batch axes (the pipeline follows the
    placement); left on the host when the mesh has none."""
    axes = batch_axes_of(mesh)
    return jax.device_put(batch, NamedSharding(mesh, P(axes))) if axes else batch


def param_bytes_per_device(staged: Any) -> int:
    """The most bytes of parameters one device holds in a pipeline's stage layout
    (``state.params`` or ``pipe.shard(model)``: its stages' weights, its shards of them)."""
    per_device: dict[Any, int] = {}
    for leaf in jax.tree.leaves(staged):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


def make_schedule(args: argparse.Namespace) -> jp.Schedule:
    cls = jp.load_schedule(args.schedule)
    if args.stages_per_device > 1:
        return cls(args.stages, args.microbatches, stages_per_device=args.stages_per_device)
    return cls(args.stages, args.microbatches)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train and evaluate; returns the summary dict also printed as the ``RESULT`` line."""
    args = parse_args(argv)
    if args.target:
        return compile_for_target(args)
    if args.plain:
        return train(args, None)
    mesh = make_mesh(args)
    with jax.set_mesh(mesh):  # the model is built (its weights placed) and trained on it
        return train(args, mesh)


def compile_for_target(args: argparse.Namespace) -> dict[str, Any]:
    """``--target``: the same model and pipeline built abstractly (no weights, no data) on
    the target's compile-only devices, its train step compiled by XLA's TPU or CUDA
    compiler; prints the plan and the compile report (memory per device, fit, tick loop)."""
    import jaxpipe.aot

    target = jaxpipe.aot.target(args.target)
    if args.mesh:
        axes = dict(parse_mesh(args.mesh))
    else:
        if target.num_devices % args.stages:
            raise SystemExit(f"--stages {args.stages} does not divide the "
                             f"{target.num_devices} devices of {args.target}; pass --mesh")
        axes = {"pipe": args.stages}
        if target.num_devices > args.stages:
            axes["data"] = target.num_devices // args.stages
    mesh = target.mesh(axes)
    pipe, optimizer = abstract_pipeline(args, mesh)
    print(pipe.plan)
    report = jaxpipe.aot.compile_report(pipe, optimizer=optimizer)
    print(report)
    result = {"mode": "compile", "target": args.target, "mesh": dict(mesh.shape),
              **report.to_dict()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print("RESULT " + json.dumps(result, default=str))
    return result


def abstract_pipeline(args: argparse.Namespace, mesh: jax.sharding.Mesh
                      ) -> tuple[Any, optax.GradientTransformation]:
    """The GPT's pipeline and optimizer built from shapes alone (``nnx.eval_shape``: no
    weight is made), on ``mesh`` (its ``pipe`` axis sets the stages): what an
    ahead-of-time compile needs."""
    args.stages = mesh.shape["pipe"]
    cfg = Config(seq=args.seq, layers=args.layers, width=args.width, heads=args.heads)
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(args.seed),
                                           scan_layers=args.scan_layers,
                                           sharding=Sharding.for_mesh(mesh.axis_names)))
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        rows = NamedSharding(mesh, P(batch_axes_of(mesh) or None))
        batch = {name: jax.ShapeDtypeStruct((args.batch, args.seq), dtype, sharding=rows)
                 for name, dtype in (("x", jnp.int32), ("y", jnp.int32),
                                     ("mask", jnp.float32))}
        pipe = jp.flax.pipeline(model, loss_fn, batch, mesh=mesh, schedule=make_schedule(args),
                                cut=args.cut, has_aux=True, reduction="weighted")
    print(f"model: {cfg.layers} blocks{' (scanned)' if args.scan_layers else ''}, width "
          f"{cfg.width}, {n_params:,} parameters; mesh {dict(mesh.shape)} of "
          f"{mesh.devices.flat[0].device_kind}")
    return pipe, make_optimizer(args.lr, args.steps, args.scan_layers)


def aot_pipeline(mesh: jax.sharding.Mesh, *argv: str) -> tuple[Any, Any]:
    """For ``jaxpipe compile --target T examples/gpt.py [-- --layers 48 ...]``: the
    pipeline and optimizer of this script's arguments ``argv`` on ``mesh``."""
    return abstract_pipeline(parse_args(list(argv)), mesh)


def train(args: argparse.Namespace, mesh: jax.sharding.Mesh | None) -> dict[str, Any]:
    """The run: plain JAX on one device when ``mesh`` is ``None``, else pipelined."""
    t_start = time.perf_counter()
    cfg = Config(seq=args.seq, layers=args.layers, width=args.width, heads=args.heads)
    train_ids, held_ids = load_data(args.corpus_chars)
    rng = np.random.default_rng(args.seed)
    sharding = Sharding() if mesh is None else Sharding.for_mesh(mesh.axis_names)
    model = GPT(cfg, rngs=nnx.Rngs(args.seed), scan_layers=args.scan_layers, sharding=sharding)
    optimizer = make_optimizer(args.lr, args.steps, args.scan_layers)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"corpus: {len(train_ids):,} train / {len(held_ids):,} held-out characters of "
          f"stdlib source; vocab {VOCAB} (uniform-guess loss ln(V) = {math.log(VOCAB):.3f})")
    print(f"model: {cfg.layers} blocks{' (scanned)' if args.scan_layers else ''}, width "
          f"{cfg.width}, {cfg.heads} heads, context {cfg.seq}, {n_params:,} parameters")

    graphdef, params0, rest = nnx.split(model, nnx.Param, ...)

    if args.plain:
        def pure_loss(p: Any, batch: dict) -> tuple[jax.Array, tuple[jax.Array, dict]]:
            (loss_sum, count), aux = loss_fn(nnx.merge(graphdef, p, rest), batch)
            return loss_sum / count, (count, aux)

        @jax.jit
        def plain_step(p: Any, opt_state: Any, batch: dict) -> tuple[Any, Any, jax.Array,
                                                                       dict]:
            (loss, (_, aux)), grads = jax.value_and_grad(pure_loss, has_aux=True)(p, batch)
            updates, opt_state = optimizer.update(grads, opt_state, p)
            return optax.apply_updates(p, updates), opt_state, loss, aux

        plain_eval = jax.jit(pure_loss)
        state = (params0, optimizer.init(params0))

        def step_fn(s: Any, b: dict) -> tuple[Any, jax.Array, dict]:
            p, o, loss, aux = plain_step(*s, b)
            return (p, o), loss, aux

        def evaluate(s: Any, b: dict) -> tuple[float, float]:
            loss, (count, aux) = plain_eval(s[0], b)
            return batch_summary(((loss * count, count), aux))

        final_params = lambda s: s[0]
        print("training without a pipeline (--plain): one device, jax.value_and_grad")
    else:
        assert mesh is not None
        schedule = make_schedule(args)
        example = place_batch(sample_batch(train_ids, np.random.default_rng(args.seed),
                                           args.batch, args.seq), mesh)
        # No sharding argument: the weights are placed as their flax metadata says, the
        # batch as place_batch put it, and the pipeline keeps both.
        pipe = jp.flax.pipeline(model, loss_fn, example, mesh=mesh, schedule=schedule,
                                cut=args.cut, has_aux=True, reduction="weighted")
        print(pipe.plan)
        print(f"schedule {type(schedule).__name__} (p={args.stages}, m={args.microbatches}):")
        print(schedule.simulate().to_ascii())
        state = pipe.init(model, optimizer)
        per_device = param_bytes_per_device(state.params)
        total = sum(x.nbytes for x in jax.tree.leaves(params0))
        print(f"mesh {dict(mesh.shape)}: batch split over {pipe.batch_axes}; parameters: "
              f"{per_device:,} bytes on the busiest device, the model's {total:,} "
              f"({per_device * mesh.size / total:.2f} x total/{mesh.size})")

        def step_fn(s: Any, b: dict) -> tuple[Any, jax.Array, dict]:
            s, metrics = pipe.train_step(s, place_batch(b, mesh))
            return s, metrics["loss"], metrics["aux"]

        def evaluate(s: Any, b: dict) -> tuple[float, float]:
            # forward only, through the pipeline, on the state's stage layout (no gather)
            loss, aux = pipe.loss(s, place_batch(b, mesh))
            return float(loss), float(jnp.sum(aux["correct"]) / jnp.sum(aux["tokens"]))

        def final_params(s: Any) -> Any:
            pipe.update_model(model, pipe.params(s))
            return nnx.state(model, nnx.Param)

    tokens_per_step = args.batch * args.seq
    losses: list[float] = []
    accuracies: list[float] = []
    steady_time, steady_steps = 0.0, 0
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc="train", dynamic_ncols=True, file=sys.stdout)
    for step in range(args.steps):
        batch = sample_batch(train_ids, rng, args.batch, args.seq)
        t0 = time.perf_counter()
        state, loss, aux = step_fn(state, batch)
        loss = float(loss)  # blocks until the step is done
        accuracies.append(float(jnp.sum(aux["correct"]) / jnp.sum(aux["tokens"])))
        dt = time.perf_counter() - t0
        if step > 0:  # step 0 includes compilation
            steady_time += dt
            steady_steps += 1
        losses.append(loss)
        if bar is not None:
            tps = tokens_per_step * steady_steps / steady_time if steady_steps else 0.0
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}", refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()

    # Held-out evaluation, forward only (through the pipeline unless --plain).
    held = [evaluate(state, b)
            for b in heldout_batches(held_ids, args.batch, args.seq, args.eval_batches)]
    held_loss = float(np.mean([x[0] for x in held]))
    held_acc = float(np.mean([x[1] for x in held]))
    final_params(state)  # the pipelined run writes the trained weights back into model
    tail = slice(-max(1, min(20, len(losses) // 10)), None)
    every = max(1, len(losses) // 10)
    result = {
        "mode": "plain" if args.plain else "pipeline",
        "schedule": None if args.plain else args.schedule,
        "config": dataclasses.asdict(cfg) | {"batch": args.batch, "stages": args.stages,
                                             "microbatches": args.microbatches,
                                             "steps": args.steps, "lr": args.lr,
                                             "scan_layers": args.scan_layers},
        "params": int(n_params),
        "uniform_loss": math.log(VOCAB),
        "first_losses": losses[:3],
        "loss_curve": losses[::every] + ([losses[-1]] if (len(losses) - 1) % every else []),
        "train_loss": float(np.mean(losses[tail])),
        "train_accuracy": float(np.mean(accuracies[tail])),
        "heldout_loss": held_loss,
        "heldout_accuracy": held_acc,
        "evaluated_by": "jax.jit forward" if args.plain else "pipe.loss",
        "mesh": None if mesh is None else dict(mesh.shape),
        "param_bytes": None if mesh is None else {"busiest_device": per_device,
                                                  "total": total},
        "loss_fn_calls": LOSS_FN_CALLS[0],
        "tokens_per_s": tokens_per_step * steady_steps / steady_time if steady_steps else None,
        "wall_s": time.perf_counter() - t_start,
    }
    tps = result["tokens_per_s"]
    print(f"final: train loss {result['train_loss']:.3f} (accuracy "
          f"{result['train_accuracy']:.3f})  held-out loss {held_loss:.3f} (accuracy "
          f"{held_acc:.3f})  uniform ln({VOCAB}) = {math.log(VOCAB):.3f}  "
          f"{tps if tps is None else f'{tps:,.0f}'} tokens/s  wall {result['wall_s']:.1f} s")
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
