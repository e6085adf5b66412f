"""The loss of a script that imports nothing from Resurgo: read off ``backward()``.

Every training loop starts its backward pass from the loss:
``loss.backward()`` (plain PyTorch, Lightning's ``LightningModule.backward``),
``accelerator.backward(loss)`` (Hugging Face's ``Trainer``, which calls
``loss.backward()``), ``scaler.scale(loss).backward()`` (mixed precision).
The bootstrap (:mod:`agent.train.autohooks`) wraps ``torch.Tensor.backward``
and hands each scalar it starts from to a :class:`LossTap`; at each step of
the optimizer it counts, the tap gives the step's loss: the sum of those
scalars since the step before. A loop that accumulates gradients over micro
batches divides each micro batch's loss by their number (the Trainer and
Lightning do), so the sum is the step's loss; one that does not reports a
multiple of it, the same multiple every step, which is all a NaN and a spike
need. A scalar that ``GradScaler.scale`` made is divided by its scale again.

No device synchronization per step: the sum stays on the device; at the step's
end it starts on its way to the host (on a GPU, a non-blocking copy followed by
an event), and is read once the copy is done, normally at the next step. On
the CPU it is read at once. At most :data:`MAX_IN_FLIGHT` steps wait; an older
one is dropped rather than waited for.

What this cannot see, said in docs/operations.md: a backward started with
``torch.autograd.backward(tensors)`` or ``torch.autograd.grad`` (not
``Tensor.backward``), a loss that is not a scalar, and which of several
optimizers' losses is which (all count towards the first optimizer's step).
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Any

# Steps whose loss is on its way to the host; the oldest beyond this is dropped.
MAX_IN_FLIGHT = 4
# Set on a tensor GradScaler.scale returned: the scale it was multiplied by.
SCALE_ATTRIBUTE = "_resurgo_loss_scale"


class _OnItsWay:
    """One step's loss on its way to the host."""

    def __init__(self, step: int, total: Any) -> None:
        self.step = step
        self._event = None
        if total.device.type == "cpu":
            self._host = total
            return
        self._host = total.to("cpu", non_blocking=True)
        if total.device.type == "cuda":
            import torch

            self._event = torch.cuda.Event()
            self._event.record()

    def ready(self) -> bool:
        return self._event is None or bool(self._event.query())

    def value(self) -> float:
        return float(self._host)


class LossTap:
    """The scalars backward passes start from, summed per optimizer step (see the module)."""

    def __init__(self) -> None:
        self._sum: Any = None
        self._in_flight: deque[_OnItsWay] = deque()

    def started_backward(self, tensor: Any) -> None:
        """``tensor.backward()`` is about to run; never raises."""
        with contextlib.suppress(Exception):
            if tensor.numel() != 1 or not tensor.is_floating_point() or not tensor.requires_grad:
                return
            value = tensor.detach()
            scale = getattr(tensor, SCALE_ATTRIBUTE, None)
            if scale is not None:
                value = value / scale
            value = value.reshape(()).float()
            self._sum = value if self._sum is None else self._sum + value

    def step_ended(self, step: int) -> list[tuple[int, float]]:
        """The optimizer finished ``step``: start its loss on its way; the (step, loss) pairs
        that are on the host now, oldest first (``step``'s own at once on the CPU)."""
        try:
            total, self._sum = self._sum, None
            if total is not None:
                self._in_flight.append(_OnItsWay(step, total))
                while len(self._in_flight) > MAX_IN_FLIGHT:
                    self._in_flight.popleft()
            ready = []
            while self._in_flight and self._in_flight[0].ready():
                done = self._in_flight.popleft()
                ready.append((done.step, done.value()))
            return ready
        except Exception:  # never into the user's training loop
            self._sum = None
            self._in_flight.clear()
            return []

    def forget(self) -> None:
        """Drop what is summed and on its way (a checkpoint was loaded: a new count)."""
        self._sum = None
        self._in_flight.clear()


def mark_scaled(scaled: Any, scale: Any) -> Any:
    """Note on ``scaled`` (what ``GradScaler.scale`` returned) the ``scale`` it carries."""
    with contextlib.suppress(Exception):
        if scale is not None and hasattr(scaled, "backward"):
            setattr(scaled, SCALE_ATTRIBUTE, scale)
    return scaled
