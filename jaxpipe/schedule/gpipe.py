"""GPipe: every forward, then every backward (Huang et al., 2019).

Simple and bubble-equal to 1F1B, but each device holds the residuals of *all*
``m`` microbatches at once (peak in-flight = m per local stage).

Order on device ``d`` (exact, other code relies on it):

- forwards: for each local stage in ascending order, microbatches ``0..m-1``;
- backwards: for each local stage in *descending* order, microbatches ``0..m-1``
  (forward microbatch order, as in ``torch.distributed.pipelining.ScheduleGPipe``).

With ``stages_per_device > 1`` stages use the loop placement (``stage % p``) and
each device sweeps its stages breadth-first, as above.
"""

from __future__ import annotations

from .action import Action
from .base import Schedule


class GPipe(Schedule):
    """All forwards (stage-major, mb ascending), then all backwards (stage descending,
    mb ascending). Works for any ``p``, ``m`` and ``stages_per_device``."""

    name = "gpipe"

    def device_actions(self, device: int) -> list[Action]:
        stages = self.device_stages(device)
        mbs = range(self.num_microbatches)
        forwards = [Action("F", s, mb) for s in stages for mb in mbs]
        backwards = [Action("B", s, mb) for s in reversed(stages) for mb in mbs]
        return forwards + backwards
