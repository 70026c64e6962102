"""V-Half: a V-shape schedule with about half of 1F1B's activation memory (Qi, Wan,
Amar, Lin, "Pipeline Parallelism with Controllable Memory", NeurIPS 2024).

Placement: the V of ``dualpipe_v.py``. ``2p`` half-size stages; device ``d`` holds
stage ``d`` (chunk 0, going down) and stage ``2p - 1 - d`` (chunk 1, coming back
up), so the turn at device ``p - 1`` is a local hand-off. Every backward is split
into ``I`` + ``W``.

The paper builds a schedule from one repeating *building block*: the times at
which device ``d`` runs the four critical passes of one microbatch. With every
pass taking one time unit a device does six passes per microbatch (two each of
F, I, W), so microbatch ``k`` repeats the block shifted by ``6k``. V-Half's
offsets on device ``d`` (``g = 3`` if ``p`` is even, else 0, keeps them distinct
mod 6):

    F(chunk 0) at 2d          F(chunk 1) at 3p - d - 2
    I(chunk 1) at 3p + g + 2d - 1          I(chunk 0) at 6p + g - d - 2

The two slots per period left free are filled with the device's pending ``W``'s,
oldest first. Sorting everything by time gives each device's order; the
simulator (and the runtime) then run that order as early as dependencies allow,
which closes the gaps of warm-up and cool-down.

Why it saves memory: a device's activation memory is the *lifespan* of a
microbatch on it divided by the period. Forwards go down the V two units apart
instead of one, so the backward comes back sooner relative to the forward, and
the lifespan is about half of 1F1B's. In jaxpipe's accounting (a residual set
lives from its ``F`` to its ``W``) each device peaks at ``p + 2`` half-size
stage-microbatches for even ``p`` (``p + 1`` for odd): about ``(p + 2) / 2p`` of
1F1B's device-0 memory, with a smaller bubble than 1F1B. The paper additionally
"squeezes" warm-up and cool-down by moving passes into free slots while memory
allows; this file does not, so its bubble is a little larger than the paper's.
Any ``p`` and ``m``.
"""

from __future__ import annotations

import jaxpipe as jp

PERIOD = 6  # passes per microbatch per device: F, F, I, I, W, W


class VHalf(jp.Schedule):
    """V-Half building block on a V placement (2 stages per device); any ``p``, ``m``."""

    name = "v-half"

    def __init__(self, num_devices: int, num_microbatches: int, stages_per_device: int = 2):
        super().__init__(num_devices, num_microbatches, stages_per_device)
        if self.stages_per_device != 2:
            raise jp.ScheduleError(
                f"VHalf places exactly 2 stages per device (a V), got "
                f"stages_per_device={self.stages_per_device}"
            )

    def placement(self, stage: int) -> int:
        """V placement: stages ``0..p-1`` go down the devices, ``p..2p-1`` come back up."""
        p = self.num_devices
        return stage if stage < p else 2 * p - 1 - stage

    def offsets(self, device: int) -> tuple[int, int, int, int]:
        """Building-block times of F(chunk 0), F(chunk 1), I(chunk 1), I(chunk 0)."""
        p, d = self.num_devices, device
        g = 3 if p % 2 == 0 else 0
        return (2 * d, 3 * p - d - 2, 3 * p + g + 2 * d - 1, 6 * p + g - d - 2)

    def device_actions(self, device: int) -> list[jp.Action]:
        p, d = self.num_devices, device
        down, up = d, 2 * p - 1 - d
        block = zip(self.offsets(d), (("F", down), ("F", up), ("I", up), ("I", down)), strict=True)
        at: dict[int, jp.Action] = {}  # time slot -> action
        for offset, (kind, stage) in block:
            for mb in range(self.num_microbatches):
                at[offset + PERIOD * mb] = jp.Action(kind, stage, mb)
        if len(at) != 4 * self.num_microbatches:  # offsets must be distinct mod PERIOD
            raise AssertionError(f"V-Half building-block slots collide on device {d}")

        order: list[jp.Action] = []
        owed: list[jp.Action] = []  # W's whose I has run, oldest first
        for t in range(max(at) + 1):
            if t in at:
                order.append(at[t])
                if at[t].kind == "I":
                    owed.append(jp.Action("W", at[t].stage, at[t].microbatch))
            elif owed:
                order.append(owed.pop(0))
        return order + owed
