"""A test-local split-backward (I/W) schedule, written against the public API only."""

from __future__ import annotations

import jaxpipe as jp


class DeferredW1F1B(jp.Schedule):
    """1F1B with each backward split into I then a W deferred past the next forward.

    Device d warms up with min(m, p-d-1) forwards, then alternates F and I; each W is run
    right after the following forward (filling what would be a bubble in ZB-H1 style),
    and the remaining W's close the schedule.
    """

    def device_actions(self, device: int) -> list[jp.Action]:
        p, m, s = self.num_devices, self.num_microbatches, device
        warm = min(m, p - device - 1)
        out: list[jp.Action] = [jp.Action("F", s, i) for i in range(warm)]
        pending: list[jp.Action] = []
        nf, nb = warm, 0
        while nb < m:
            if nf < m:
                out.append(jp.Action("F", s, nf))
                nf += 1
                out.extend(pending)
                pending = []
            out.append(jp.Action("I", s, nb))
            pending.append(jp.Action("W", s, nb))
            nb += 1
        return out + pending
