"""XLA aborts partitioning a gather in a switch in a loop of a partly manual shard_map.

JAX and XLA only (no jaxpipe), 8 virtual CPU devices, jax 0.10.2:
``python tests/support/xla_gather_bug.py split`` aborts the process in XLA's SPMD
partitioner (``spmd_partitioner_util.cc:497 Check failed: partition_group_list...``);
``... whole`` (the operand constrained replicated first: jaxpipe's workaround,
:mod:`jaxpipe.sharding.gathers`) prints the gathered sums. Each of the loop, the switch and the
partly manual ``shard_map`` is needed: without any one of them both run.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

whole = sys.argv[1] == "whole"
mesh = jax.make_mesh((2, 2, 2), ("pipe", "fsdp", "tp"))


def lookup(table, tokens):  # flax's nnx.Embed with out_sharding=, in an auto_axes region
    table = jax.lax.with_sharding_constraint(table, P()) if whole else table
    return jnp.take(table, tokens, axis=0)


take = jax.sharding.auto_axes(lookup, axes=("fsdp", "tp"), out_sharding=P("fsdp", None, "tp"))


def body(table, tokens):  # manual over 'pipe': each pipe position runs its own branch
    def step(k, acc):
        used = lambda: take(table, tokens).sum() * jnp.ones_like(table)
        return acc + jax.lax.switch(jax.lax.axis_index("pipe"), [used, lambda: table])
    return jax.lax.fori_loop(0, 2, step, jnp.zeros_like(table))[None]


with jax.set_mesh(mesh):
    table = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("tp", "fsdp")))
    tokens = jax.device_put(jnp.zeros((4, 8), jnp.int32), NamedSharding(mesh, P("fsdp")))
    f = jax.jit(jax.shard_map(body, in_specs=(P(), P()), out_specs=P("pipe"),
                              axis_names={"pipe"}))
    out = jax.device_get(f(table, tokens))
    print("sums", float(out[0].sum()), float(out[1].sum()))
