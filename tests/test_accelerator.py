"""The accelerator program (``SpmdRuntime(backend="gpu")``), built and run on CPU.

Its tick loop must be straight-line where XLA:GPU would otherwise stop the host: no
``while`` whose trip count XLA does not know, at most one ``conditional`` and no
collective inside one, one collective-permute per direction, no buffer copied per tick;
and its gradients must equal ``jax.value_and_grad`` of the unpipelined model.
"""


import jax
import pytest
from every_schedule import EVERY_SCHEDULE
from models import MODELS, assert_matches, reference

import jaxpipe as jp
from jaxpipe.runtime.spmd import SpmdRuntime
from jaxpipe.runtime.spmd.program.hlo_census import census

SCHEDULES = EVERY_SCHEDULE


def _build(schedule, runtime, layers=None):
    """tiny_lm (a token embedding and a tied head around attention blocks), one block per
    stage, pipelined over ``schedule``."""
    m = schedule.num_microbatches
    # (residual blocks scaled down: 16 of them at full scale reach a loss of ~4000, where
    # float32 rounding alone is 1e-4 of a gradient, in the reference as in the pipeline)
    loss_fn, params, batch = MODELS["tiny_lm"](layers or schedule.num_stages, batch=2 * m,
                                               block_scale=0.3)
    mesh = jax.make_mesh((schedule.num_devices,), ("pipe",))
    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=schedule, cut="markers",
                       runtime=runtime)
    return pipe, loss_fn, params, batch


def _storage_shapes(pipe) -> set[str]:
    """HLO shapes of the program's storage, inbox and gradient buffers."""
    hlo = {"float32": "f32", "int32": "s32", "bool": "pred"}
    low, lay = pipe.inspect.executor.lowering, pipe.inspect.executor.layouts

    def shape(c, lead):
        return f"{hlo[c.dtype]}[{','.join(map(str, (*lead, *c.row_shape)))}]"

    return ({shape(c, (n,)) for c, n in low.slots.items()}
            | {shape(c, ((low.num_inbox + 1) * n,)) for c, n in lay.unit.items()})


@pytest.mark.parametrize("p", [4, 8])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_tick_loop_is_straight_line_and_exact(name, p):
    """Every built-in and gallery schedule (v=2 where it has chunks), on a model with an
    embedding and a tied head: inside the tick loop no while without a known trip count,
    one conditional, no collective-permute in it, at most two permutes (one per
    direction: V placements need no third, their turn stays on the device), no carried
    buffer copied; gradients exact."""
    schedule = SCHEDULES[name](p, 2 * p)
    pipe, loss_fn, params, batch = _build(schedule, SpmdRuntime(backend="gpu"))
    compiled = pipe.inspect.value_and_grad_fn.lower(params, batch).compile()
    found = census(compiled.as_text())
    low = pipe.inspect.executor.lowering
    assert found.trip_count == low.num_ticks
    assert found.unknown_trip_whiles == 0, found
    assert found.conditionals == 1, found
    assert found.permutes_in_conditionals == 0, found
    assert found.permutes == len(low.perm_offsets) <= 2, found
    assert not set(found.copied) & _storage_shapes(pipe), found.copied
    assert_matches(compiled(params, batch),
                   reference(loss_fn, params, batch, schedule.num_microbatches))


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("name", ["1F1B", "DualPipeV"])
def test_overlap_on_and_off_are_exact(name, overlap):
    """The permute of the previous tick's message (overlap) or of this tick's: both
    exact, the overlap's operand from the loop carry (it runs before the switch)."""
    schedule = SCHEDULES[name](4, 8)
    pipe, loss_fn, params, batch = _build(schedule, SpmdRuntime(backend="gpu",
                                                                overlap=overlap))
    assert pipe.inspect.executor.lowering.exchange.delay == (2 if overlap else 1)
    assert_matches(pipe.value_and_grad(params, batch), reference(loss_fn, params, batch, 8))


def test_the_cpu_program_is_the_one_that_gates():
    """The CPU program's tick loop gates each branch and exchange in a loop of unknown
    trip count (right on CPU, where a collective costs ~75 us and the host reads every
    trip count anyway); the accelerator program's has none, on the same pipeline."""
    schedule = jp.OneFOneB(4, 8)
    cpu, *_ = _build(schedule, SpmdRuntime(backend="cpu"))
    gpu, loss_fn, params, batch = _build(schedule, SpmdRuntime(backend="gpu"))
    on_cpu = census(cpu.inspect.value_and_grad_fn.lower(params, batch).compile().as_text())
    on_gpu = census(gpu.inspect.value_and_grad_fn.lower(params, batch).compile().as_text())
    assert on_cpu.unknown_trip_whiles > 0 and on_cpu.permutes_in_conditionals > 0
    assert on_gpu.unknown_trip_whiles == 0 and on_gpu.permutes_in_conditionals == 0
    assert not set(on_cpu.copied) & _storage_shapes(cpu), on_cpu.copied


def test_scanned_interleaved_stack_and_train_step():
    """A scanned layer stack cut over the chunks of an interleaved schedule (an embedding
    and a head around one shared core, parameters read by row of stacked groups): exact
    public value_and_grad, and train_step (the optimizer epilogue after the tick loop)
    matches plain optax."""
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import lax

    ks = jax.random.split(jax.random.key(5), 4)
    params = {"embed": jax.random.normal(ks[0], (6, 8)),
              "layers": {"b": 0.1 * jax.random.normal(ks[1], (8, 8)),
                         "w": jax.random.normal(ks[2], (8, 8, 8)) / 8},
              "head": jax.random.normal(ks[3], (8, 6))}
    batch = {"x": jax.random.normal(ks[0], (16, 6)), "y": jax.random.normal(ks[1], (16, 6))}

    def loss_fn(p, b):
        def body(h, layer):
            return jp.boundary(jnp.tanh(h @ layer["w"] + layer["b"])), None

        h, _ = lax.scan(body, jp.boundary(b["x"] @ p["embed"]), p["layers"])
        return jnp.mean((h @ p["head"] - b["y"]) ** 2)

    pipe = jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                       schedule=jp.Interleaved1F1B(2, 4, stages_per_device=2),
                       cut=jp.Cut(indices=[2, 4, 6]), runtime=SpmdRuntime(backend="gpu"))
    assert_matches(pipe.value_and_grad(params, batch), reference(loss_fn, params, batch, 4))
    found = census(pipe.inspect.value_and_grad_fn.lower(params, batch).compile().as_text())
    assert found.unknown_trip_whiles == 0 and found.conditionals == 1, found
    assert found.known_trip_whiles >= 1  # the layer scans, inside the switch's branches
    tx = optax.adam(1e-2)
    state, ref_p, ref_o = pipe.init(params, tx), params, tx.init(params)
    for _ in range(2):
        state, metrics = pipe.train_step(state, batch)
        loss, grads = reference(loss_fn, ref_p, batch, 4)
        updates, ref_o = tx.update(grads, ref_o, ref_p)
        ref_p = optax.apply_updates(ref_p, updates)
        np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(pipe.params(state)), jax.tree.leaves(ref_p), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axes", ["data", "model"])
def test_sharded_meshes(axes):
    """Data x pipe (the batch split over a manual axis: messages packed into bytes) and
    pipe x model with tensor-parallel stages (an automatic axis inside the stages: one
    permutation per message class): exact, the tick loop still straight-line."""
    from jax.sharding import AxisType
    from test_sharded import TP, _model

    schedule = jp.OneFOneB(2, 4)
    if axes == "data":
        loss_fn, params, batch = MODELS["tiny_lm"](2, batch=16)
        mesh, kwargs = jax.make_mesh((2, 2), ("data", "pipe")), {}
    else:  # w1 column-, w2 row-sharded over 'model'
        loss_fn, params, specs, batch = _model(TP["wspec"], TP["bspec"], 16)
        mesh = jax.make_mesh((2, 2), ("pipe", "model"), axis_types=(AxisType.Auto,) * 2)
        kwargs = {"param_specs": specs, "batch_axes": ()}
    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=schedule, cut="markers",
                       runtime=SpmdRuntime(backend="gpu"), **kwargs)
    assert_matches(pipe.value_and_grad(params, batch), reference(loss_fn, params, batch, 4))
    found = census(pipe.inspect.value_and_grad_fn.lower(params, batch).compile().as_text())
    assert found.unknown_trip_whiles == 0 and found.permutes_in_conditionals == 0, found


def test_xla_flags_for_the_accelerator_program():
    """jaxpipe.xla_flags.apply adds what JAX's GPU pipeline guide recommends, keeps what
    XLA_FLAGS already sets (a flag named there wins), and names an unknown platform."""
    from jaxpipe import xla_flags

    env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false --foo=1"}
    flags = xla_flags.apply("gpu", env).split()
    assert flags[:2] == ["--xla_gpu_enable_latency_hiding_scheduler=false", "--foo=1"]
    assert "--xla_disable_hlo_passes=collective-permute-motion" in flags
    assert "--xla_gpu_enable_command_buffer=" in flags
    assert sum(f.startswith("--xla_gpu_enable_latency_hiding_scheduler") for f in flags) == 1
    assert xla_flags.apply("gpu", env).split() == flags  # applying twice adds nothing
    assert xla_flags.apply("cpu", {}) == ""
    # XLA stops reading at a bare token (JAX's FAQ: intra_op_parallelism_threads=1): ours
    # go before it
    bare = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"}
    flags = xla_flags.apply("gpu", bare).split()
    assert flags[-1] == "intra_op_parallelism_threads=1" and len(flags) > 2
    assert all(f.startswith("--") for f in flags[:-1])
    with pytest.raises(ValueError, match="unknown platform 'cuda'"):
        xla_flags.apply("cuda", {})


def test_compiler_options_leave_out_what_xla_flags_names(monkeypatch):
    """jaxpipe's CPU programs compile at LLVM -O1 and its GPU programs with the overlap
    options, per compile; an option the user's XLA_FLAGS names is left out, so their flag
    wins (a per-compile option would override it)."""
    from jaxpipe import xla_flags

    monkeypatch.setenv("XLA_FLAGS", "--foo=1")
    assert xla_flags.compiler_options("cpu") == {"xla_backend_optimization_level": 1}
    assert xla_flags.compiler_options("gpu") == xla_flags.COMPILER_OPTIONS["gpu"]
    assert xla_flags.compiler_options("tpu") is None
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=3 "
                       "--xla_gpu_enable_latency_hiding_scheduler=false")
    assert xla_flags.compiler_options("cpu") is None
    gpu = xla_flags.compiler_options("gpu")
    assert "xla_gpu_enable_latency_hiding_scheduler" not in gpu
    assert len(gpu) == len(xla_flags.COMPILER_OPTIONS["gpu"]) - 1


def test_fast_cpu_compile_only_for_a_jaxlib_that_reads_it(monkeypatch):
    """jaxpipe.xla_flags.fast_cpu_compile adds the emitter flag once, before a bare token,
    keeps a value XLA_FLAGS already names, and adds nothing for a jaxlib not known to read
    it (XLA aborts at a flag it does not know)."""
    from importlib import metadata

    from jaxpipe import xla_flags

    monkeypatch.setattr(metadata, "version", lambda name: "0.10.2")
    env = {"XLA_FLAGS": "--foo=1 intra_op_parallelism_threads=1"}
    assert xla_flags.fast_cpu_compile(env).split() == [
        "--foo=1", xla_flags.FAST_CPU_COMPILE, "intra_op_parallelism_threads=1"]
    assert xla_flags.fast_cpu_compile(env) == " ".join(
        ["--foo=1", xla_flags.FAST_CPU_COMPILE, "intra_op_parallelism_threads=1"])
    named = {"XLA_FLAGS": "--xla_cpu_use_fusion_emitters=true"}
    assert xla_flags.fast_cpu_compile(named) == "--xla_cpu_use_fusion_emitters=true"
    monkeypatch.setattr(metadata, "version", lambda name: "0.11.0")
    assert xla_flags.fast_cpu_compile({"XLA_FLAGS": "--foo=1"}) == "--foo=1"
