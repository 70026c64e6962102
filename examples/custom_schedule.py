"""Write your own pipeline schedule, check it, simulate it, and run it with exact gradients.

The schedule below is "1F1B with a lazy start": each device warms up with one forward
fewer than 1F1B (never fewer than one), so the first devices hold one residual set less
(p=4, m=8: peak in-flight [3, 2, 2, 2] against 1F1B's [4, 3, 2, 1]; the last device,
which cannot warm up with fewer than one, one more) and the bubble grows. It is a
made-up order — the point is that any order that validates runs on the SPMD runtime and
gives jax.value_and_grad's result.

    python examples/custom_schedule.py [-p 4] [-m 8]
"""

from __future__ import annotations

import argparse
import json

from jaxpipe.xla_flags import cpu_devices  # (imports no jax)

cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxpipe as jp  # noqa: E402


class Lazy1F1B(jp.Schedule):
    """1F1B whose warm-up is one forward shorter than usual (at least one forward)."""

    def device_actions(self, device: int) -> list[jp.Action]:
        p, m, s = self.num_devices, self.num_microbatches, device
        warm = min(m, max(1, p - device - 2))
        order = [jp.Action("F", s, i) for i in range(warm)]
        for i in range(m):  # steady state: backward of i, then the next forward
            if warm + i < m:
                order.append(jp.Action("F", s, warm + i))
            order.append(jp.Action("B", s, i))
        return order


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", type=int, default=4, help="pipeline devices")
    ap.add_argument("-m", type=int, default=8, help="microbatches")
    args = ap.parse_args(argv)
    p, m = args.p, args.m

    schedule = Lazy1F1B(num_devices=p, num_microbatches=m)
    schedule.validate()  # raises jp.ScheduleError naming device, action and rule if broken
    timeline = schedule.simulate()
    print(timeline.to_ascii())
    base = jp.OneFOneB(p, m).simulate()
    print(f"bubble {timeline.bubble_fraction:.3f} (1F1B {base.bubble_fraction:.3f}); "
          f"peak in-flight {list(timeline.peak_in_flight)} (1F1B {list(base.peak_in_flight)})")

    # A small MLP with one cut marker per layer, one layer per stage.
    keys = jax.random.split(jax.random.key(0), p + 2)
    params = [jax.random.normal(k, (32, 32)) / np.sqrt(32) for k in keys[:p]]
    batch = {"x": jax.random.normal(keys[-2], (4 * m, 32)),
             "y": jax.random.normal(keys[-1], (4 * m, 32))}

    def loss_fn(params, mb):
        h = mb["x"]
        for w in params:
            h = jp.boundary(jnp.tanh(h @ w))
        return jnp.mean((h - mb["y"]) ** 2)

    mesh = jax.make_mesh((p,), ("pipe",), devices=jax.devices()[:p])
    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=schedule, cut="markers")
    loss, grads = pipe.value_and_grad(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, batch)
    err = max(float(jnp.max(jnp.abs(a - b)))
              for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True))
    print(f"pipelined loss {float(loss):.6f}  unpipelined {float(ref_loss):.6f}  "
          f"max |grad diff| {err:.2e}")
    result = {"loss": float(loss), "ref_loss": float(ref_loss), "max_grad_err": err,
              "bubble": float(timeline.bubble_fraction),
              "peak_in_flight": [int(x) for x in timeline.peak_in_flight],
              "lowered_residual_slots": list(pipe.inspect.executor.lowering.residual_peak)}
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
