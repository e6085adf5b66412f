"""Step reports on their way from the ranks to the supervisor: buffered per rank, sent in batches.

The node agent adds every :class:`~agent.wire.datagram.StepReport` it
receives to a :class:`StepBuffer` and, at each heartbeat report and once more
before its ``launcher_exited`` event, drains the buffer into ``step_losses``
payloads: per rank, the steps received since the last drain in arrival order,
at most :data:`agent.wire.protocol.MAX_STEPS_PER_EVENT` to a payload. Pure: no
clock, no I/O.
"""

from __future__ import annotations

import math
from typing import Any

from agent.wire.datagram import StepReport
from agent.wire.protocol import MAX_STEPS_PER_EVENT, NonFinite

# Between two drains (5 s apart by default) no real training loop reports this
# many steps; the bound only keeps a flood on the agent's socket (which every
# local process can write to) from growing the agent without limit.
MAX_BUFFERED_STEPS = 16 * MAX_STEPS_PER_EVENT


class StepBuffer:
    """Step reports received since the last :meth:`drain`, per rank, in arrival order."""

    def __init__(self, max_steps: int = MAX_BUFFERED_STEPS) -> None:
        self._max_steps = max_steps
        self._steps: dict[int, list[dict[str, Any]]] = {}
        self._count = 0
        self._dropped = 0

    def __len__(self) -> int:
        """Steps buffered now, all ranks together."""
        return self._count

    def add(self, report: StepReport) -> bool:
        """Buffer one report; False (and counted as dropped) when the buffer is full.

        A loss that is not finite travels as null with ``non_finite`` naming
        it (``nan``, ``inf``, ``-inf``): the wire protocol carries only finite
        numbers, and a null alone means "no loss reported". A grad norm goes
        as ``grad_norm`` only when the rank reported one (most scripts do
        not, and an absent key costs nothing on the wire); one that is not
        finite is null with ``grad_non_finite`` naming it, the same way.
        """
        if self._count >= self._max_steps:
            self._dropped += 1
            return False
        entry: dict[str, Any] = {"step": report.step, "loss": report.loss, "cursor": report.cursor}
        if report.loss is not None and not math.isfinite(report.loss):
            entry["loss"] = None
            entry["non_finite"] = NonFinite.of(report.loss).value
        if report.grad_norm is not None:
            entry["grad_norm"] = report.grad_norm
            if not math.isfinite(report.grad_norm):
                entry["grad_norm"] = None
                entry["grad_non_finite"] = NonFinite.of(report.grad_norm).value
        self._steps.setdefault(report.rank, []).append(entry)
        self._count += 1
        return True

    def drain(self) -> tuple[list[dict[str, Any]], int]:
        """The ``step_losses`` payloads for everything buffered, by rank; and how many dropped.

        Empties the buffer and resets the dropped count. A rank with more than
        ``MAX_STEPS_PER_EVENT`` steps gets several payloads, in step order.
        """
        payloads = [
            {"global_rank": rank, "steps": steps[start : start + MAX_STEPS_PER_EVENT]}
            for rank, steps in sorted(self._steps.items())
            for start in range(0, len(steps), MAX_STEPS_PER_EVENT)
        ]
        dropped = self._dropped
        self._steps, self._count, self._dropped = {}, 0, 0
        return payloads, dropped
