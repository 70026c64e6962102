"""Looped BFS: breadth-first over local stages (Lamy-Poirier, "Breadth-First
Pipeline Parallelism", MLSys 2023; ``ScheduleLoopedBFS`` in PyTorch).

Each device holds ``v = stages_per_device`` stages with the loop placement
(stage ``s`` on device ``s % p``, so a microbatch loops over the devices ``v``
times). Order on device ``d``, local stages ``d, d + p, ..., d + (v-1)p``:

    forwards:  for each local stage, ascending:  F0 F1 ... F(m-1)
    backwards: for each local stage, descending: B(m-1) ... B1 B0

The backwards run in *reverse* microbatch order: the last microbatch through a
stage is the first one whose cotangent comes back, so the device never waits.

Trade-off: like GPipe every device holds all ``m`` microbatches of every local
stage (peak in-flight ``v * m``), but stages are ``v`` times smaller, so the
activation memory is GPipe's while the bubble shrinks to roughly
``(p - 1) / (v * m + p - 1)``, interleaved 1F1B's. Breadth-first order also
finishes each stage's gradients early: with data parallelism the all-reduce of
stage ``s`` can start while other stages still compute (not modelled here).
"""

from __future__ import annotations

import jaxpipe as jp


class LoopedBFS(jp.Schedule):
    """All forwards stage by stage, then all backwards in reverse; any ``p``, ``m``, ``v``.

    ``stages_per_device`` defaults to 2 (with 1 it is GPipe with reversed backwards).
    """

    name = "looped-bfs"

    def __init__(self, num_devices: int, num_microbatches: int, stages_per_device: int = 2):
        super().__init__(num_devices, num_microbatches, stages_per_device)

    def device_actions(self, device: int) -> list[jp.Action]:
        stages = self.device_stages(device)  # loop placement: d, d + p, ...
        mbs = range(self.num_microbatches)
        forwards = [jp.Action("F", s, mb) for s in stages for mb in mbs]
        backwards = [jp.Action("B", s, mb) for s in reversed(stages) for mb in reversed(mbs)]
        return forwards + backwards
