"""Writes into a device's buffers: in place, or recorded to be made after a conditional.

A step of the program reads stored values (residuals, the I -> W hand-off) and messages,
writes stored values and adds parameter gradients. The CPU program runs the step inside
a gated loop, which updates its carry in place: the writes happen where the branches make
them. The accelerator program runs the step as one branch of a ``lax.switch``, and XLA
copies every buffer a conditional passes through or updates (its copy insertion keeps a
conditional's operands and results apart; measured on jaxlib 0.10: a copy of the whole
buffer per step even where every branch writes in place). There the buffers stay outside
the conditional, read-only inside it, and a branch only *records* its writes: the
:class:`DeferredStore` and :class:`DeferredGrads` it is handed collect them, and the
program makes them after the conditional (:class:`Ports`).

The branches call :func:`get_rows`, :func:`put_rows` and :func:`add_grad`, which do one
or the other by the container they are given, so one branch body serves both programs.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

__all__ = ["DeferredGrads", "DeferredStore", "Ports", "add_grad", "get_rows", "opaque",
           "put_rows", "reading"]


class DeferredStore(Mapping):
    """A device's storage read-only (``store[c]``, as the dict the CPU program passes),
    with the rows a branch writes recorded in :attr:`writes`, in order:
    ``(class, base, offset, rows, mask)``, the rows going to ``base + offset`` where
    ``mask`` (a traced predicate, ``None``: always) holds.

    ``windows``: instead of whole buffers, per (pool, class), the rows the step may read
    and where its part starts in them (:mod:`.windows`); read through :func:`reading`.
    ``mask``: what the writes recorded from now on are made under (:meth:`with_mask`: a part
    that runs on every device but counts only on its own stage's, :mod:`.stage_ends`)."""

    def __init__(self, arrays: Mapping[Hashable, jax.Array],
                 writes: tuple[tuple[Hashable, Any, int, jax.Array, Any], ...] = (),
                 windows: Mapping[tuple[Any, Hashable], tuple[jax.Array, Any]] | None = None,
                 mask: Any = None) -> None:
        self.arrays = dict(arrays)
        self.writes = writes
        self.windows = windows
        self.mask = mask

    def __getitem__(self, c: Hashable) -> jax.Array:
        return self.arrays[c]

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.arrays)

    def __len__(self) -> int:
        return len(self.arrays)

    def put(self, c: Hashable, base: Any, offset: int, rows: jax.Array) -> DeferredStore:
        return DeferredStore(self.arrays, (*self.writes, (c, base, offset, rows, self.mask)),
                             self.windows, self.mask)

    def with_mask(self, mask: Any) -> DeferredStore:
        """The same records, later writes made under ``mask`` (``None``: always)."""
        return DeferredStore(self.arrays, self.writes, self.windows, mask)


def reading(store: Mapping[Hashable, jax.Array], pool: Any, bases: Mapping[Hashable, Any]
            ) -> tuple[Mapping[Hashable, jax.Array], dict]:
    """``(buffers, bases)`` to read the rows of ``pool``'s part at ``bases`` from: the
    store itself, or its windows (a :class:`DeferredStore` given them) at the part's
    place in them."""
    if not isinstance(store, DeferredStore) or store.windows is None:
        return store, dict(bases)
    mine = {c: store.windows[pool, c] for c in bases if (pool, c) in store.windows}
    return (DeferredStore({c: w for c, (w, _) in mine.items()}, store.writes,
                          mask=store.mask),
            {c: at for c, (_, at) in mine.items()})


class DeferredGrads(list):
    """A device's gradient list read-only, with the gradients a branch adds recorded in
    :attr:`adds`: ``(position, row or None, value, mask)`` (``mask`` as
    :class:`DeferredStore`'s)."""

    def __init__(self, grads: Sequence[jax.Array | None],
                 adds: list[tuple[int, Any, jax.Array, Any]] | None = None,
                 mask: Any = None) -> None:
        super().__init__(grads)
        self.adds = list(adds or [])
        self.mask = mask

    def copy(self) -> DeferredGrads:
        return DeferredGrads(self, self.adds, self.mask)

    def with_mask(self, mask: Any) -> DeferredGrads:
        return DeferredGrads(self, self.adds, mask)


def opaque(x: int) -> jax.Array:
    """``x`` as a scalar XLA cannot see the value of. XLA:CPU compiles one kernel per
    distinct fused computation, and a row offset folded in as a constant makes the
    reads and writes of every stored value distinct kernels even where they are alike
    (same buffer, same shapes); as an operand, alike ones share one compiled kernel (GPT
    d64, L=64, p=8, scanned: 199 -> 184 compiled kernels at v=1, 207 -> 197 at v=2).
    Measured inside the tick loop only: outside any loop XLA:CPU folds it back to a
    constant (tried on the gradient slices after the loop: no kernel saved)."""
    return lax.optimization_barrier(jnp.int32(x))


def get_rows(bufs: Mapping[Hashable, jax.Array], c: Hashable, base: Any,
             offset: int | jax.Array, n: int) -> jax.Array:
    """Rows ``base + offset ..`` (``n`` of them) of class ``c``'s buffer (``offset``:
    static, or :func:`opaque`)."""
    if isinstance(bufs, DeferredStore) and any(w[0] == c for w in bufs.writes):
        # the conditional reads the buffer as it was before the step: a branch that read
        # what it wrote itself would see the old rows
        raise NotImplementedError(
            f"a step reads {c} after writing it, which the accelerator program cannot "
            "defer (a W joined to its I: use iw_same_tick=False)")
    return lax.dynamic_slice_in_dim(bufs[c], base + offset, n, 0,
                                    allow_negative_indices=False)


def put_rows(bufs: Mapping[Hashable, jax.Array], c: Hashable, base: Any,
             offset: int | jax.Array, rows: jax.Array) -> Mapping[Hashable, jax.Array]:
    """``bufs`` with rows ``base + offset ..`` of class ``c`` replaced by ``rows``: in
    place, or recorded (a :class:`DeferredStore`)."""
    if isinstance(bufs, DeferredStore):
        return bufs.put(c, base, offset, rows)
    out = dict(bufs)
    out[c] = lax.dynamic_update_slice_in_dim(bufs[c], rows.astype(bufs[c].dtype),
                                             base + offset, 0, allow_negative_indices=False)
    return out


def add_grad(gbuf: list, pos: int, ct: jax.Array, row: Any = None) -> None:
    """Add ``ct`` into gradient ``pos`` (its row ``row`` when it is a stacked group), in
    place in the list, or recorded (a :class:`DeferredGrads`)."""
    if isinstance(gbuf, DeferredGrads):
        gbuf.adds.append((pos, row, ct, gbuf.mask))
        return
    gbuf[pos] = _added(gbuf[pos], ct, row)


def _added(buf: jax.Array, ct: jax.Array, row: Any) -> jax.Array:
    if row is None:
        return buf + _typed_like(ct.astype(buf.dtype), buf)
    old = lax.dynamic_index_in_dim(buf, row, 0, keepdims=False, allow_negative_indices=False)
    return lax.dynamic_update_index_in_dim(buf, old + _typed_like(ct.astype(old.dtype), old),
                                           row, 0, allow_negative_indices=False)


def _typed_like(x: jax.Array, ref: jax.Array) -> jax.Array:
    """``x`` with ``ref``'s sharded type (Explicit axes): a gradient may come out of the
    backward sharded where its parameter is not (a replicated bias added to an activation
    sharded over 'tp' gets a cotangent summed to ``P('tp')``); the buffer keeps its own."""
    want, have = _typed_spec(ref), _typed_spec(x)
    if want == have or jax.typeof(ref).sharding.mesh.empty:
        return x
    return jax.sharding.reshard(x, want if want is not None else P())


def _typed_spec(x: Any) -> Any:
    """The ``PartitionSpec`` of ``x``'s type when it names mesh axes (Explicit axes:
    sharding in types), else ``None``."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return spec if spec is not None and any(e is not None for e in spec) else None


@dataclass(frozen=True)
class _Port:
    """One write every branch returns: rows of a class (``kind="rows"``: ``key`` the
    class, ``shape`` the rows' shape), or a gradient (``"grad"``: ``key`` its position,
    ``dynamic`` whether its row is picked at run time, ``row`` a fixed row)."""

    kind: str
    key: Any
    shape: tuple[int, ...]
    dtype: Any
    row: int | None = None
    dynamic: bool = False
    spec: Any = None  # the value's sharding over Explicit axes (sharding in types)


class Ports:
    """The union of what a switch's branches write, as outputs of one fixed structure.

    Every branch of a ``lax.switch`` returns the same structure. Each branch's recorded
    writes are matched to *ports* by what they are (rows of one class and count; a
    gradient of one position and row kind), the k-th such write of a branch to the k-th
    port of its kind; a branch that writes less returns its unused ports marked not
    valid and uninitialised (``lax.empty``: zeros would be filled and copied per port
    and tick). After the switch, :meth:`apply` makes every port's write: rows with
    ``dynamic_update_slice`` (an unused port writes back what is there), gradients added
    in place (an unused port adds nothing).

    Built from every branch's records (:meth:`signature` of each, then the union).
    """

    def __init__(self, signatures: Sequence[Sequence[_Port]]) -> None:
        count: dict[_Port, int] = {}
        for sig in signatures:
            mine: dict[_Port, int] = {}
            for p in sig:
                mine[p] = mine.get(p, 0) + 1
            for p, n in mine.items():
                count[p] = max(count.get(p, 0), n)
        self.ports = [p for p, n in count.items() for _ in range(n)]
        # classes some branch writes more than once (the order of its writes matters)
        self._rewritten = {p.key for sig in signatures for p in sig if p.kind == "rows"
                           and sum(q.kind == "rows" and q.key == p.key for q in sig) > 1}

    def nbytes(self, kind: str) -> int:
        """Bytes every step returns and writes through the ports of ``kind`` (``"rows"``
        or ``"grad"``), whatever its branch wrote: the price of keeping the buffers out of
        the conditional. A gradient port costs its bytes in every step (read and added
        as zeros but in a step that adds a gradient), so the W steps' gradients are
        added in every tick."""
        return sum(int(np.prod(p.shape)) * np.dtype(p.dtype).itemsize
                   for p in self.ports if p.kind == kind)

    @staticmethod
    def signature(store: DeferredStore, gbuf: DeferredGrads) -> list[_Port]:
        """The ports a branch's records need, in record order."""
        out = [_Port("rows", c, tuple(rows.shape), jnp.dtype(rows.dtype),
                     spec=_typed_spec(rows)) for c, _, _, rows, _ in store.writes]
        for pos, row, ct, _ in gbuf.adds:
            static = isinstance(row, int)
            out.append(_Port("grad", pos, tuple(ct.shape), jnp.dtype(gbuf[pos].dtype),
                             row if static else None, dynamic=row is not None and not static,
                             spec=_typed_spec(ct)))
        return out

    def outputs(self, store: DeferredStore, gbuf: DeferredGrads, active: Any = None) -> list:
        """A branch's records as one entry per port: ``(rows, start, valid)`` or
        ``(value, row, valid)``; ``active`` (a traced predicate): make none of them
        where it is false (a step run on every device, idle on some)."""
        records = list(zip(self.signature(store, gbuf),
                           [(base + offset, rows, m) for _, base, offset, rows, m in store.writes]
                           + [(row, ct, m) for _, row, ct, m in gbuf.adds], strict=True))
        out = []
        for port in self.ports:
            k = next((i for i, (p, _) in enumerate(records) if p == port), None)
            if k is None:
                out.append(self._empty(port))
                continue
            _, (where, value, mask) = records.pop(k)
            valid = jnp.int32(1)
            for m in (mask, active):
                if m is not None:
                    valid = valid * jnp.asarray(m).astype(jnp.int32)
            if port.kind == "rows":
                out.append((value.astype(port.dtype), jnp.int32(where), valid))
            else:
                out.append((value.astype(port.dtype),
                            jnp.int32(where if port.dynamic else 0), valid))
        assert not records, records  # every record has a port (the union covers it)
        return out

    @staticmethod
    def _empty(port: _Port) -> tuple:
        # not valid, so never read: left uninitialised (XLA's AllocateBuffer on GPU and
        # TPU) rather than zeros every tick, which XLA:GPU fills and copies per port
        unused = lax.empty(port.shape, port.dtype)
        if port.spec is not None:  # the other branches' type
            unused = jax.sharding.reshard(unused, port.spec)
        return unused, jnp.int32(0), jnp.int32(0)

    def apply(self, store: dict, gbuf: list, outputs: Sequence) -> tuple[dict, list]:
        """Make every port's write into the real buffers (after the switch)."""
        store, gbuf = dict(store), list(gbuf)
        # a port that rewrites its whole buffer goes first: after row writes, XLA fuses
        # it into a select into a new buffer and copies that into the loop carry every
        # tick; before them, the writes fuse into one in-place dynamic_update_slice
        pairs = sorted(zip(self.ports, outputs, strict=True),
                       key=lambda po: not (po[0].kind == "rows"
                                           and po[0].key not in self._rewritten
                                           and po[0].shape[0] == store[po[0].key].shape[0]))
        for port, out in pairs:
            if port.kind == "rows":
                rows, start, valid = out
                buf = store[port.key]
                # an unused port writes back the rows that are there: no dummy rows
                old = lax.dynamic_slice_in_dim(buf, start, rows.shape[0], 0,
                                               allow_negative_indices=False)
                new = jnp.where(valid.astype(bool), rows, old)
                store[port.key] = lax.dynamic_update_slice_in_dim(
                    buf, new, start, 0, allow_negative_indices=False)
            else:
                value, row, valid = out  # an unused port's value is not zeros: add none
                value = jnp.where(valid.astype(bool), value, jnp.zeros((), value.dtype))
                gbuf[port.key] = _added(gbuf[port.key], value,
                                        row if port.dynamic else port.row)
        return store, gbuf
