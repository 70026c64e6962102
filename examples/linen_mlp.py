"""Pipeline a flax **linen** MLP with GPipe: ``@jp.layer`` on the layer class, a few steps.

    python examples/linen_mlp.py
    python examples/linen_mlp.py --stages 4 --microbatches 8 --steps 50

The task is a fixed random "teacher" network that the MLP learns to imitate
(regression, mean squared error). Each ``ResidualDense`` call is one cuttable unit;
the auto cutter groups them into ``--stages`` stages. The same loss and gradients as
``jax.value_and_grad`` of the unpipelined model are checked before training.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from jaxpipe.xla_flags import cpu_devices  # (imports no jax)

    cpu_devices(8)  # virtual CPU devices for the pipe axis, before jax is imported

import argparse  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402

import jaxpipe as jp  # noqa: E402


@jp.layer
class ResidualDense(nn.Module):
    """``x + gelu(Dense(x))``; ``@jp.layer`` puts a candidate stage cut after every call."""

    features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return x + nn.gelu(nn.Dense(self.features)(x))


class MLP(nn.Module):
    """Input projection, ``depth`` residual layers, output projection."""

    width: int
    depth: int
    out: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(self.width)(x)
        for _ in range(self.depth):
            x = ResidualDense(self.width)(x)
        return nn.Dense(self.out)(x)


def loss_fn(module: nn.Module, variables: Any, batch: dict) -> jax.Array:
    """Mean squared error of the MLP's prediction (per microbatch)."""
    return jnp.mean((module.apply(variables, batch["x"]) - batch["y"]) ** 2)


def make_data(seed: int, n: int, d_in: int, d_out: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets of a fixed random teacher ``y = tanh(x W1) W2``."""
    rng = np.random.default_rng(seed)
    w1 = rng.normal(size=(d_in, 64)) / np.sqrt(d_in)
    w2 = rng.normal(size=(64, d_out)) / 8.0
    x = rng.normal(size=(n, d_in)).astype(np.float32)
    return x, (np.tanh(x @ w1) @ w2).astype(np.float32)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Build, check against plain autodiff, train; returns ``{"losses": [...]}``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    x, y = make_data(args.seed, 4096, 16, 4)
    model = MLP(width=args.width, depth=args.depth, out=4)
    variables = model.init(jax.random.key(args.seed), x[: args.batch])
    mesh = jax.sharding.Mesh(np.array(jax.devices()[: args.stages]), ("pipe",))
    schedule = jp.GPipe(args.stages, args.microbatches)
    batch0 = {"x": x[: args.batch], "y": y[: args.batch]}

    pipe = jp.flax.pipeline_linen(model, variables, loss_fn, batch0, mesh=mesh,
                                  schedule=schedule)
    print(pipe.plan)
    print(schedule.simulate().to_ascii())

    # The pipelined gradient is the gradient of the unpipelined mean loss.
    loss, grads = pipe.value_and_grad(variables["params"], batch0)
    ref_loss, ref_grads = jax.value_and_grad(
        lambda prm: loss_fn(model, {**variables, "params": prm}, batch0))(variables["params"])
    err = max(float(jnp.max(jnp.abs(a - b)))
              for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True))
    print(f"pipelined loss {float(loss):.6f} vs plain {float(ref_loss):.6f}; "
          f"max |grad difference| {err:.2e}")

    state = pipe.init(variables["params"], optax.adam(args.lr))
    rng = np.random.default_rng(args.seed)
    losses = []
    for step in range(args.steps):
        idx = rng.integers(0, len(x), size=args.batch)
        state, metrics = pipe.train_step(state, {"x": x[idx], "y": y[idx]})
        losses.append(float(metrics["loss"]))
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {losses[-1]:.4f}")
    variables = pipe.update_variables(variables, state)
    final = float(loss_fn(model, variables, {"x": x, "y": y}))
    print(f"full-data loss with the trained variables: {final:.4f} (start {float(ref_loss):.4f})")
    return {"losses": losses, "final_loss": final, "grad_error": err}


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
