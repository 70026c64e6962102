"""The program: the one ``jit(shard_map)`` that runs a lowered schedule (JAX).

It reads the lowering's tables (:mod:`..lowering`) and never changes them. Modules:

- :mod:`.layout` -- where values live: parameter slots, per-class storage, messages;
- :mod:`.bodies` -- stages that share one compiled body; :mod:`.param_groups` -- a
  shared body's per-stage parameters and gradients; :mod:`.stage_ends` -- a member's
  prologue and epilogue around a shared core;
- :mod:`.scan_buffers` -- stacked scan values straight to and from the buffers;
- :mod:`.direct_io` -- which of a body's values its scans move so, and the evaluations;
- :mod:`.branches` -- what a step runs for one (action kind, body);
- :mod:`.gated` -- run a function or not by a traced predicate, updating in place;
- :mod:`.build` -- the tick loop and its ``shard_map``;
- :mod:`.param_moves` -- user parameter leaves into and out of the slots;
- :mod:`.optimizer` -- the per-stage optimizer update after the tick loop.
"""
