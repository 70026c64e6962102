"""A MaxText-style layout on Auto axes, pipelined: prints the pipeline's and JAX's losses.

``python tests/support/auto_axes_lookup.py``: a ``jax.sharding.Mesh`` (Auto axes, as
MaxText builds it) of pipe 2 x fsdp 2 x tensor 2, an embedding table split over
('tensor', 'fsdp') looked up with ``jnp.take`` (as flax's ``nn.Embed``), weights split
over ('fsdp', 'tensor'), the batch placed over 'fsdp'. Before the gather's operand was
made whole in the program's context (not the context the user traced the model in,
which names no mesh), XLA's partitioner aborted the process
(``spmd_partitioner_util.cc:497``; :mod:`jaxpipe.sharding.gathers`). Run in a subprocess
by ``tests/test_sharded.py``, which compares the printed values.
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpipe as jp  # noqa: E402

VOCAB, WIDTH, M = 64, 32, 4
mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("pipe", "fsdp", "tensor"))
ks = jax.random.split(jax.random.key(0), 5)


def put(x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


params = {"table": put(jax.random.normal(ks[0], (VOCAB, WIDTH)), "tensor", "fsdp"),
          "blocks": [put(jax.random.normal(k, (WIDTH, WIDTH)) / 6, "fsdp", "tensor")
                     for k in ks[1:3]],
          "head": put(jax.random.normal(ks[3], (WIDTH, VOCAB)) / 6, "fsdp", "tensor")}
tokens = np.asarray(jax.random.randint(ks[4], (16, 9), 0, VOCAB), np.int32)
batch = {"inputs": put(tokens[:, :-1], "fsdp"), "targets": put(tokens[:, 1:], "fsdp")}


def loss_fn(p, b):
    h = jnp.take(p["table"], b["inputs"], axis=0)
    for w in p["blocks"]:
        h = jp.boundary(h + jnp.tanh(h @ w))
    logits = h @ p["head"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, b["targets"][..., None], -1))


pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=jp.OneFOneB(2, M))
loss, grads = pipe.value_and_grad(params, batch)
mbs = jax.tree.map(lambda x: np.asarray(x).reshape(M, -1, *x.shape[1:]), batch)
each = [jax.value_and_grad(loss_fn)(params, jax.tree.map(lambda x, i=i: x[i], mbs))
        for i in range(M)]
want_loss, want_grads = jax.tree.map(lambda *xs: sum(xs) / M, *each)
print(json.dumps({"batch_axes": list(pipe.batch_axes), "loss": float(loss),
                  "want_loss": float(want_loss),
                  "grad_err": max(float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
                                  for g, w in zip(jax.tree.leaves(grads),
                                                  jax.tree.leaves(want_grads), strict=True))}))
