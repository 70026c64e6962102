"""The tick-loop census on small hand-written HLO modules, in the forms XLA:CPU, GPU and TPU
print them (no compiler needed): TPU trip counts read from the loop, tiled layouts,
async permute windows, other collectives."""

import pytest

from jaxpipe.runtime.spmd.program.hlo_census import census

_TUPLE = "(s32[]{:T(128)}, f32[8]{0:T(128)}, u8[272]{0:T(512)(128)(4,1)S(1)})"

_BRANCHES = """
%branch_0 (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %dot.1 = f32[8]{0} dot(%p0, %p0), lhs_contracting_dims={}, rhs_contracting_dims={}
}

%branch_1 (p1: f32[8]) -> f32[8] {
  %p1 = f32[8]{0} parameter(0)
  ROOT %negate.1 = f32[8]{0} negate(%p1)
}

%fused_conv (fp: f32[8]) -> f32[8] {
  %fp = f32[8]{0} parameter(0)
  ROOT %convolution.1 = f32[8]{0} convolution(%fp, %fp), dim_labels=b0f_0io->b0f
}

%fused_copy (fq: f32[1,2,4,8]) -> f32[1,2,4,8] {
  %param_0.7 = f32[1,2,4,8]{3,2,1,0} parameter(0)
  ROOT %copy.77 = f32[1,2,4,8]{0,3,2,1} copy(%param_0.7)
}

%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.s = f32[] add(%x, %y)
}

%inner_cond (ip: (s32[], s32[])) -> pred[] {
  %ip = (s32[], s32[]) parameter(0)
  %i0 = s32[] get-tuple-element(%ip), index=0
  %i1 = s32[] get-tuple-element(%ip), index=1
  ROOT %lt.i = pred[] compare(%i0, %i1), direction=LT
}

%inner_body (jp: (s32[], s32[])) -> (s32[], s32[]) {
  %jp = (s32[], s32[]) parameter(0)
  %j0 = s32[] get-tuple-element(%jp), index=0
  %j1 = s32[] get-tuple-element(%jp), index=1
  %one = s32[] constant(1)
  %j2 = s32[] add(%j0, %one)
  ROOT %jt = (s32[], s32[]) tuple(%j2, %j1)
}
"""


def _program(body: str, *, root_f="%g1", root_m="%g2",
             while_attrs="", cond_root=None, extra="", entry_extra="") -> str:
    """A module whose tick loop (tuple: counter, f32[8], a u8[272] message) runs ``body``
    (its tuple elements are %g0, %g1, %g2) and counts to 30 from 0 in steps of 1, TPU
    style (copies of the counter, no known_trip_count) unless ``while_attrs`` says."""
    cond_root = cond_root or "ROOT %lt = pred[]{:T(512)} compare(%gc, %constant.30), direction=LT"
    return f"""HloModule jit_f, is_scheduled=true, entry_computation_layout={{(f32[8])->f32[8]}}
{_BRANCHES}{extra}
%cond (cp: (s32[], f32[8], u8[272])) -> pred[] {{
  %cp = {_TUPLE} parameter(0)
  %gc = s32[]{{:T(128)}} get-tuple-element(%cp), index=0
  %constant.30 = s32[]{{:T(128)}} constant(30)
  {cond_root}
}}

%body (bp: (s32[], f32[8], u8[272])) -> (s32[], f32[8], u8[272]) {{
  %bp = {_TUPLE} parameter(0)
  %g0 = s32[]{{:T(128)}} get-tuple-element(%bp), index=0
  %g1 = f32[8]{{0:T(128)}} get-tuple-element(%bp), index=1
  %g2 = u8[272]{{0:T(512)(128)(4,1)S(1)}} get-tuple-element(%bp), index=2
{body}
  %copy.9 = s32[]{{:T(128)S(6)}} copy(%g0)
  %constant.1 = s32[]{{:T(128)}} constant(1)
  %add.1 = s32[]{{:T(128)}} add(%copy.9, %constant.1)
  ROOT %tuple.r = {_TUPLE} tuple(%add.1, {root_f}, {root_m})
}}

ENTRY %main (a: f32[8]) -> f32[8] {{
  %a = f32[8]{{0}} parameter(0)
  %constant.0 = s32[]{{:T(128)}} constant(0)
  %copy.i = s32[]{{:T(128)}} copy(%constant.0)
  %zero = u8[] constant(0)
  %m0 = u8[272]{{0}} broadcast(%zero), dimensions={{}}
  %tuple.i = {_TUPLE} tuple(%copy.i, %a, %m0)
{entry_extra}
  %while.1 = {_TUPLE} while(%tuple.i), condition=%cond, body=%body{while_attrs}
  ROOT %out = f32[8]{{0}} get-tuple-element(%while.1), index=1
}}
"""


_SYNC_PERMUTE = ("  %collective-permute.1 = u8[272]{0} collective-permute(%g2),"
                 " channel_id=1, source_target_pairs={{0,1},{1,2}}")
_SWITCH = ("  %idx = s32[] constant(1)\n"
           "  %conditional.1 = f32[8]{0} conditional(%idx, %g1, "
           "%g1), branch_computations={%branch_0, %branch_1}")


def test_tpu_trip_count_is_read_from_the_loop():
    """No known_trip_count (TPU): counter from copy(constant 0), +1 per trip, < 30."""
    found = census(_program(_SYNC_PERMUTE))
    assert found.trip_count == 30
    # the same bound reversed (30 > i) and with LE (i <= 29) read the same
    gt = "ROOT %gt = pred[] compare(%constant.30, %gc), direction=GT"
    assert census(_program(_SYNC_PERMUTE, cond_root=gt)).trip_count == 30
    le = ("%c29 = s32[] constant(29)\n"
          "  ROOT %le = pred[] compare(%gc, %c29), direction=LE")
    assert census(_program(_SYNC_PERMUTE, cond_root=le)).trip_count == 30
    # XLA's own note wins (CPU, GPU)
    noted = ', backend_config={"known_trip_count":{"n":"7"}}'
    assert census(_program(_SYNC_PERMUTE, while_attrs=noted)).trip_count == 7


def test_tpu_trip_count_through_a_fused_compare():
    fused = """
%fused_lt (f0: s32[], f1: s32[]) -> pred[] {
  %param_0.1 = s32[] parameter(0)
  %param_1.1 = s32[] parameter(1)
  ROOT %lt.f = pred[] compare(%param_0.1, %param_1.1), direction=LT
}
"""
    root = ("ROOT %lt_fusion = pred[] fusion(%gc, %constant.30), kind=kLoop, "
            "calls=%fused_lt")
    assert census(_program(_SYNC_PERMUTE, cond_root=root, extra=fused)).trip_count == 30


def test_unknown_trip_whiles_on_tpu():
    """A bound read from the carry (not a constant) is unknown; a step that is not a
    constant too; a scan with a constant bound is known."""
    dynamic = ("%gb = s32[] get-tuple-element(%cp), index=0\n"
               "  ROOT %lt = pred[] compare(%gc, %gb), direction=LT")
    assert census(_program(_SYNC_PERMUTE, cond_root=dynamic)).trip_count is None
    inner = (_SYNC_PERMUTE + "\n  %n = s32[] constant(4)\n"
             "  %it = (s32[], s32[]) tuple(%g0, %n)\n"
             "  %while.2 = (s32[], s32[]) while(%it), condition=%inner_cond, body=%inner_body")
    found = census(_program(inner))
    assert (found.unknown_trip_whiles, found.known_trip_whiles) == (1, 0)  # bound carried
    known = inner.replace("body=%inner_body",
                          'body=%inner_body, backend_config={"known_trip_count":{"n":"4"}}')
    found = census(_program(known))
    assert (found.unknown_trip_whiles, found.known_trip_whiles) == (0, 1)


def test_tiled_copies_of_carried_values():
    """TPU layouts (tiling, memory space) parse; a copy of a computed value, a scalar
    (the counter moved to scalar memory) are left out; copy-start is reported apart."""
    body = _SYNC_PERMUTE + """
  %copy.1 = u8[272]{0:T(512)(128)(4,1)S(1)} copy(%g2)
  %copy.2 = f32[8]{0:T(256)} copy(%g1)
  %negate.2 = f32[8]{0:T(128)} negate(%g1)
  %copy.3 = f32[8]{0:T(128)} copy(%negate.2)
  %copy-start.1 = (f32[8]{0:T(128)S(1)}, f32[8]{0:T(128)}, u32[]{:S(2)}) copy-start(%g1)
  %copy-done.1 = f32[8]{0:T(128)S(1)} copy-done(%copy-start.1)"""
    found = census(_program(body, root_m="%copy.1"))
    assert found.copied == ("f32[8]", "u8[272]")
    assert found.relayout_copies == 1  # the T(256) one; S(1) alone is no relayout
    assert found.async_copied == ("f32[8]",)
    assert found.copies_in_conditionals == 0


def test_copy_inside_a_fusion_counts_and_cpu_form():
    """A copy of a fusion's parameter (GPU wraps copies in fusions) counts, CPU layouts
    too."""
    body = _SYNC_PERMUTE + """
  %g5 = f32[1,2,4,8]{3,2,1,0} get-tuple-element(%bp), index=1
  %copy.5 = f32[1,2,4,8]{3,2,1,0} copy(%g5)
  %wrapped_copy = f32[1,2,4,8]{0,3,2,1} fusion(%copy.5), kind=kLoop, calls=%fused_copy"""
    found = census(_program(body))
    assert found.copied == ("f32[1,2,4,8]", "f32[1,2,4,8]")
    assert found.relayout_copies == 1


def test_async_permute_windows():
    """GPU/TPU start/done pairs: the first spans the switch (a dot in a branch) and a
    convolution fusion, the second spans nothing; a sync permute has an empty window."""
    body = f"""
  %collective-permute-start = (u8[272]{{0}}, u8[272]{{0}}) collective-permute-start(%g2)
{_SWITCH}
  %conv_fusion = f32[8]{{0}} fusion(%conditional.1), kind=kOutput, calls=%fused_conv
  %negate.3 = f32[8]{{0}} negate(%conv_fusion)
  %collective-permute-done = u8[272]{{0}} collective-permute-done(%collective-permute-start)
  %cps.1 = (u8[272]{{0}}, u8[272]{{0}}) collective-permute-start(%collective-permute-done)
  %collective-permute-done.1 = u8[272]{{0}} collective-permute-done(%cps.1)
{_SYNC_PERMUTE}"""
    found = census(_program(body, root_f="%negate.3", root_m="%collective-permute-done.1"))
    assert found.permutes == 3 and found.permutes_in_conditionals == 0
    first, second, sync = found.windows
    assert first.name == "collective-permute-start"
    assert first.done_index - first.start_index == 5 and first.between == 4
    assert first.overlaps_conditional and first.compute_between == 2  # switch, conv
    assert (second.between, second.overlaps_conditional, second.compute_between) == (
        0, False, 0)
    assert second.done_index == second.start_index + 1
    assert sync.start_index == sync.done_index and sync.between == 0
    assert "the conditional inside" in found.summary()


def test_async_start_wrapping_a_permute():
    """TPU/GPU's generic async wrapper: async-start calls a computation holding the op."""
    extra = """
%async_cp (ap: u8[272]) -> u8[272] {
  %ap = u8[272]{0} parameter(0)
  ROOT %collective-permute.9 = u8[272]{0} collective-permute(%ap), channel_id=3
}
"""
    body = f"""  %async-start = ((u8[272]{{0}}), u8[272]{{0}}) async-start(%g2), calls=%async_cp
{_SWITCH}
  %async-done = u8[272]{{0}} async-done(%async-start), calls=%async_cp"""
    found = census(_program(body, root_f="%conditional.1", root_m="%async-done", extra=extra))
    assert found.permutes == 1  # the start, not again the op it wraps
    (w,) = found.windows
    assert w.name == "async-start" and w.between == 2 and w.overlaps_conditional


def test_other_collectives_and_those_in_conditionals():
    extra = """
%branch_ar (q0: f32[8]) -> f32[8] {
  %q0 = f32[8]{0} parameter(0)
  %all-reduce.1 = f32[8]{0} all-reduce(%q0), replica_groups={{0,1}}, to_apply=%sum
  ROOT %dot.2 = f32[8]{0} dot(%all-reduce.1, %q0), lhs_contracting_dims={}, rhs_contracting_dims={}
}

%async_rs (rp: f32[8]) -> f32[4] {
  %rp = f32[8]{0} parameter(0)
  ROOT %reduce-scatter.1 = f32[4]{0} reduce-scatter(%rp), dimensions={0}, to_apply=%sum
}
"""
    body = _SYNC_PERMUTE + """
  %all-gather-start = (f32[8]{0}, f32[16]{0}) all-gather-start(%g1), dimensions={0}
  %all-gather-done = f32[16]{0} all-gather-done(%all-gather-start)
  %async-start.2 = ((f32[8]{0}), f32[4]{0}, u32[]) async-start(%g1), calls=%async_rs
  %async-done.2 = f32[4]{0} async-done(%async-start.2), calls=%async_rs
  %idx = s32[] constant(0)
  %cond.2 = f32[8]{0} conditional(%idx, %g1, %g1), branch_computations={%branch_ar, %branch_1}"""
    found = census(_program(body, root_f="%cond.2", extra=extra))
    assert found.collectives == 3 and found.collectives_in_conditionals == 1
    assert found.collective_ops == {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 1}
    assert found.permutes == 1 and found.conditionals == 1
    assert "all-gather 1, all-reduce 1, reduce-scatter 1" in found.summary()


def test_cpu_form_permutes_in_conditionals_and_copies():
    """XLA:CPU's form: sync permutes inside the branches of a conditional, plain layouts,
    the trip count noted by XLA."""
    extra = """
%branch_cp (r0: u8[272]) -> u8[272] {
  %param_0.4 = u8[272]{0} parameter(0)
  %copy.40 = u8[272]{0} copy(%param_0.4)
  ROOT %ppermute.4 = u8[272]{0} collective-permute(%copy.40), source_target_pairs={{0,1}}
}
"""
    body = """  %idx = s32[] constant(0)
  %conditional.3 = u8[272]{0} conditional(%idx, %g2, %g2), branch_computations={%branch_cp}"""
    noted = ', backend_config={"known_trip_count":{"n":"22"}}'
    found = census(_program(body, root_m="%conditional.3", extra=extra, while_attrs=noted))
    assert found.trip_count == 22
    assert found.permutes == 1 and found.permutes_in_conditionals == 1
    assert found.copied == ("u8[272]",) and found.copies_in_conditionals == 1
    assert found.windows[0].between == 0


def test_the_tick_loop_is_the_largest_permuting_while():
    """A small loop of permutes before the tick loop (TPU windowed einsum) is not taken."""
    extra = """
%w_cond (wp: (s32[], u8[272])) -> pred[] {
  %wp = (s32[], u8[272]{0}) parameter(0)
  %w0 = s32[] get-tuple-element(%wp), index=0
  %c2 = s32[] constant(2)
  ROOT %lt.w = pred[] compare(%w0, %c2), direction=LT
}

%w_body (wq: (s32[], u8[272])) -> (s32[], u8[272]) {
  %wq = (s32[], u8[272]{0}) parameter(0)
  %v0 = s32[] get-tuple-element(%wq), index=0
  %v1 = u8[272]{0} get-tuple-element(%wq), index=1
  %cp.w = u8[272]{0} collective-permute(%v1), channel_id=9, source_target_pairs={{0,1}}
  %k1 = s32[] constant(1)
  %v2 = s32[] add(%v0, %k1)
  ROOT %wt = (s32[], u8[272]{0}) tuple(%v2, %cp.w)
}
"""
    entry = ("  %wi = (s32[], u8[272]{0}) tuple(%copy.i, %m0)\n"
             "  %while.0 = (s32[], u8[272]{0}) while(%wi), condition=%w_cond, body=%w_body")
    body = _SYNC_PERMUTE + "\n" + _SWITCH
    found = census(_program(body, root_f="%conditional.1", extra=extra, entry_extra=entry))
    assert found.trip_count == 30 and found.conditionals == 1


def test_no_permuting_loop_raises():
    with pytest.raises(ValueError, match="collective-permute"):
        census(_program("  %negate.9 = f32[8]{0} negate(%g1)"))


def test_summary_lines():
    found = census(_program(_SYNC_PERMUTE + "\n  %copy.1 = u8[272]{0:T(512)(128)(4,1)S(1)} "
                            "copy(%g2)", root_m="%copy.1"))
    text = found.summary()
    assert text.splitlines()[0].startswith("trips: 30;")
    assert "1 overlapping nothing" in text
    assert "copies of carried buffers: 1, 272 bytes" in text
