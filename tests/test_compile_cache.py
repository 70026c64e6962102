"""JAX's persistent compilation cache serves a pipeline's programs to a second process.

A pipeline lowers to the same StableHLO in every process that builds it from the same
model, schedule and mesh, so with ``jax_compilation_cache_dir`` set the second process
loads XLA's executables instead of compiling them (README: "Compile once, across
processes").
"""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys
    from jaxpipe.xla_flags import cpu_devices
    cpu_devices(2)
    import jax, jax.numpy as jnp, optax
    import jaxpipe as jp

    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

    def loss_fn(params, batch):
        h = batch["x"]
        for w in params:
            h = jp.boundary(jnp.tanh(h @ w))
        return jnp.mean((h - batch["y"]) ** 2)

    params = [jnp.eye(16) * (1 + i / 10) for i in range(4)]
    batch = {"x": jnp.linspace(-1, 1, 8 * 16).reshape(8, 16), "y": jnp.zeros((8, 16))}
    pipe = jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                       schedule=jp.OneFOneB(2, 4))
    state = pipe.init(params, optax.sgd(0.1))
    events = []
    jax.monitoring.register_event_listener(
        lambda name, **_: events.append(name.rsplit("/", 1)[-1]))
    loss, _ = pipe.value_and_grad(params, batch)
    state, metrics = pipe.train_step(state, batch)
    print(json.dumps({"hits": events.count("cache_hits"),
                      "misses": events.count("cache_misses"),
                      "loss": float(loss), "train_loss": float(metrics["loss"])}))
""")


def _run(script, cache):
    # a fresh interpreter: the script sets its own device count (this one's XLA_FLAGS off)
    env = {"JAX_PLATFORMS": "cpu",
           **{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}}
    proc = subprocess.run([sys.executable, str(script), str(cache)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_pipelines_programs_from_the_cache(tmp_path):
    script = tmp_path / "pipe.py"
    script.write_text(SCRIPT)
    cache = tmp_path / "cache"
    first = _run(script, cache)
    assert first["misses"] >= 2 and first["hits"] == 0, first  # value_and_grad, train_step
    assert any(cache.iterdir())
    second = _run(script, cache)
    assert second["misses"] == 0 and second["hits"] == first["misses"], second
    assert (second["loss"], second["train_loss"]) == (first["loss"], first["train_loss"])
