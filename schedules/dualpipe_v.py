"""DualPipeV: DeepSeek's DualPipe "cut in half", two stages per device in a V
(DeepSeek-AI, DeepSeek-V3 Technical Report 2024, section 3.2.1; the V variant is
``dualpipev.py`` in github.com/deepseek-ai/DualPipe, after Sea AI Lab's
"DualPipe could be better without the Dual" and ZB-V from "Zero Bubble Pipeline
Parallelism", ICLR 2024).

Placement (a V): ``2p`` stages, device ``d`` holds stage ``d`` on the way down
and stage ``2p - 1 - d`` on the way back up. Device ``p - 1`` holds the two
middle stages ``p - 1`` and ``p``, so the turn of the V is a local hand-off, and
device 0 holds both the first and the last stage.

Order on device ``d``: call its stages ``s0 = d`` (down) and ``s1 = 2p-1-d`` (up).
A ``W`` deferred by an ``I`` goes into a first-in first-out queue, and "W" below
pops the oldest one.

    1. nF0        2(p - 1 - d) x  F(s0)
    2. nF0F1      (d + 1)      x  F(s0) F(s1)
    3. nI1W1F1    (p - 1 - d)  x  I(s1) W F(s1)
    4. main       (m - 2p + d + 1) x  F(s0) B(s1) F(s1) B(s0)
    5. nB1F1B0    (p - 1 - d)  x  B(s1) F(s1) B(s0)
    6. nB1B0      (d + 1)      x  B(s1) B(s0); from iteration (d+1)//2 on, these
                                  become I's (odd d switches before B(s1), even
                                  d before B(s0))
    7. nWI0       (p - 1 - d)  x  W I(s0)
    8. nW         the W's still queued

In DeepSeek's kernels the main phase overlaps the forward of one chunk with the
backward of the other (and their all-to-all communication); here each pair
simply runs back to back. The simulator models compute only.

Trade-off: a microbatch crosses every device twice with half-size stages, so the
warm-up is short, and the zero-bubble W's fill most of what is left: the bubble
is far below 1F1B's (about a sixth of its idle time at p=4, m=8). Memory: each
device peaks at ``2p + 1`` live stage-microbatches of *half-size* stages, i.e.
``p + 1/2`` 1F1B stage-microbatches, within DeepSeek's "PP + 1" (1F1B: "PP") -
about 1F1B's activation memory, with a single copy of the parameters (DualPipe
keeps two). It needs ``m >= 2p`` microbatches, as DeepSeek's implementation
asserts (the main phase of device 0 runs ``m - 2p + 1`` times).
"""

from __future__ import annotations

from collections import deque

import jaxpipe as jp


class DualPipeV(jp.Schedule):
    """DeepSeek's DualPipeV order on a V placement; needs ``m >= 2 * p``.

    ``stages_per_device`` is always 2 (the argument exists so generic code that
    passes it keeps working).
    """

    name = "dualpipe-v"

    def __init__(self, num_devices: int, num_microbatches: int, stages_per_device: int = 2):
        super().__init__(num_devices, num_microbatches, stages_per_device)
        p, m = self.num_devices, self.num_microbatches
        if self.stages_per_device != 2:
            raise jp.ScheduleError(
                f"DualPipeV places exactly 2 stages per device (a V), got "
                f"stages_per_device={self.stages_per_device}"
            )
        if m < 2 * p:
            raise jp.ScheduleError(
                f"DualPipeV needs num_microbatches >= 2 * num_devices: m={m} < 2*p={2 * p} "
                f"(its main phase on device 0 runs m - 2p + 1 times); use m >= {2 * p}"
            )

    def placement(self, stage: int) -> int:
        """V placement: stages ``0..p-1`` go down the devices, ``p..2p-1`` come back up."""
        p = self.num_devices
        return stage if stage < p else 2 * p - 1 - stage

    def device_actions(self, device: int) -> list[jp.Action]:
        p, m, d = self.num_devices, self.num_microbatches, device
        stages = (d, 2 * p - 1 - d)  # chunk 0 (down), chunk 1 (up)
        next_f, next_b = [0, 0], [0, 0]
        weights: deque[jp.Action] = deque()
        order: list[jp.Action] = []

        def forward(chunk: int) -> None:
            order.append(jp.Action("F", stages[chunk], next_f[chunk]))
            next_f[chunk] += 1

        def backward(chunk: int, split: bool = False) -> None:
            mb = next_b[chunk]
            next_b[chunk] += 1
            if split:  # input grad now, weight grad queued for later
                order.append(jp.Action("I", stages[chunk], mb))
                weights.append(jp.Action("W", stages[chunk], mb))
            else:
                order.append(jp.Action("B", stages[chunk], mb))

        def weight() -> None:
            order.append(weights.popleft())

        for _ in range(2 * (p - 1 - d)):  # 1. nF0
            forward(0)
        for _ in range(d + 1):  # 2. nF0F1
            forward(0)
            forward(1)
        for _ in range(p - 1 - d):  # 3. nI1W1F1
            backward(1, split=True)
            weight()
            forward(1)
        for _ in range(m - 2 * p + d + 1):  # 4. main: nF0B1F1B0
            forward(0)
            backward(1)
            forward(1)
            backward(0)
        for _ in range(p - 1 - d):  # 5. nB1F1B0
            backward(1)
            forward(1)
            backward(0)
        split = False
        for i in range(d + 1):  # 6. nB1B0, second half zero-bubble
            if i == (d + 1) // 2 and d % 2 == 1:
                split = True
            backward(1, split)
            if i == (d + 1) // 2 and d % 2 == 0:
                split = True
            backward(0, split)
        for _ in range(p - 1 - d):  # 7. nWI0
            weight()
            backward(0, split=True)
        while weights:  # 8. nW
            weight()
        return order
