"""A data position that survives a change of world size: the global sample cursor.

``DistributedSampler`` is stateless and strides ``indices[r::W]``: resume with a
different world size and samples are repeated or skipped, silently (DESIGN §5).
:class:`GlobalBatchSampler` keeps the position as a GLOBAL cursor instead — the
epoch and how many samples of it the completed optimizer steps consumed — so a
job resumed with any world size continues at exactly the next global sample.

The order of one epoch::

    perm        = randperm(dataset_len, generator seeded by mix(seed, epoch))
    batch k     = perm[k*G : (k+1)*G]                      (the k-th global batch)
    rank r gets   batch k [r*G//W : (r+1)*G//W]            (contiguous, see rank_slice)

It depends on ``(seed, epoch, dataset_len, G)`` only, never on the world size or
the global torch RNG. The global batch size ``G`` stays fixed across resizes;
the per-rank batch (``local_share``) follows the world size, uneven by one
sample when ``W`` does not divide ``G``. When fewer ranks make a rank's share
too large for memory, split it into micro-batches and accumulate gradients;
:func:`loss_weight` keeps the update identical either way. The tail of an epoch shorter than ``G``
is dropped (as Megatron does): a short last batch would change per-rank shapes
and loss weights, and a rank with nothing to do would break the collectives.
With ``shuffle`` the dropped tail differs every epoch.

How a training loop uses it, identically on every rank::

    sampler = GlobalBatchSampler(len(dataset), G, rank=rank, world_size=world_size, seed=seed)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=4)
    if resuming:
        state = {"data": sampler.state_dict(), ...}
        dcp.load(state, checkpoint_id=path)
        sampler.load_state_dict(state["data"])
    while sampler.epoch < num_epochs:            # one pass of the for loop per epoch
        for batch in loader:                      # starts at the cursor: mid-epoch resume
            loss = loss_fn(model(batch), reduction="sum") * loss_weight(G, world_size)
            loss.backward(); optimizer.step(); optimizer.zero_grad()
            sampler.advance()                     # only now is the batch consumed
            ...                                   # checkpoint here: state_dict() is exact

The cursor moves only in :meth:`GlobalBatchSampler.advance`, never by
iteration: DataLoader workers prefetch batches ahead of the step that uses them,
so what was iterated is not what was trained on. Each ``iter()`` starts at the
cursor as it is when the iterator is created and runs to the end of that epoch;
after the last full batch ``advance()`` rolls over to ``(epoch + 1, 0)`` and the
``while`` loop above creates the next iterator.

Windows of data can be left out (:meth:`GlobalBatchSampler.skip_samples`;
after a loss anomaly the supervisor names them, :mod:`agent.skips`). They are
ranges of ``consumed_total``, so they name the same data at any world size, and
are widened to whole global batches: a step trains on all of a global batch or
none of it. A skipped batch is never yielded, and :meth:`~GlobalBatchSampler.advance`
steps over it, so the cursor passes it as if it had been trained on; the cursor
therefore counts the batches passed, skipped ones included, not the steps.

The state dict holds only global values, so it is identical on every rank and
DCP's deduplication of identical keys across ranks is harmless: save it under
one shared key (unlike the per-rank RNG state).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from agent.skips import merge

_MASK64 = (1 << 64) - 1


class GradReduction(enum.Enum):
    """How the data-parallel wrapper combines per-rank gradients."""

    # DDP's all-reduce and FSDP's reduce-scatter average over ranks.
    MEAN = "mean"
    # A hand-written all_reduce(op=SUM) of the gradients.
    SUM = "sum"


def _splitmix64(value: int) -> int:
    # One round of splitmix64: decorrelates nearby inputs, so (seed, epoch) and
    # (seed + 1, epoch - 1) give unrelated permutations, unlike ``seed + epoch``.
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def epoch_seed(seed: int, epoch: int) -> int:
    """The 64-bit generator seed of ``epoch``'s permutation for a run seeded ``seed``."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (epoch & _MASK64))


def rank_slice(global_batch_size: int, rank: int, world_size: int) -> slice:
    """The part of a global batch that ``rank`` of ``world_size`` takes: contiguous.

    ``[r*G//W, (r+1)*G//W)``: shares differ by at most one sample, are disjoint
    and cover the batch. Contiguous rather than strided so that a rank's share
    splits into micro-batches without reordering.
    """
    _check_rank(rank, world_size)
    start = rank * global_batch_size // world_size
    stop = (rank + 1) * global_batch_size // world_size
    return slice(start, stop)


def local_share(global_batch_size: int, rank: int, world_size: int) -> int:
    """How many samples of each global batch ``rank`` of ``world_size`` processes."""
    _check_rank(rank, world_size)
    return (rank + 1) * global_batch_size // world_size - rank * global_batch_size // world_size


def loss_weight(
    global_batch_size: int,
    world_size: int,
    reduction: GradReduction = GradReduction.MEAN,
) -> float:
    """Factor for the SUM of a rank's per-sample losses so gradients are the global mean.

    Every rank computes ``loss = per_sample_losses.sum() * loss_weight(G, W)``
    (over all its micro-batches, when accumulating). With a SUM of gradients
    across ranks the factor is ``1/G``; DDP and FSDP divide by ``W`` when they
    average, so the factor is then ``W/G``. Either way the step's gradient is the
    mean over the ``G`` samples of the global batch, whatever the world size and
    however unevenly ``G`` splits — which is what lets a resize from 4 to 3
    ranks reproduce the same update to float tolerance. (A per-rank ``.mean()``
    weights ranks with one sample less more heavily, and is therefore wrong.)
    """
    _check_positive(global_batch_size, "global_batch_size")
    _check_positive(world_size, "world_size")
    if reduction is GradReduction.SUM:
        return 1.0 / global_batch_size
    return world_size / global_batch_size


def _check_positive(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_skipped(skipped: tuple[tuple[int, int], ...], position: int) -> bool:
    return any(start <= position < end for start, end in skipped)


def _check_rank(rank: int, world_size: int) -> None:
    _check_positive(world_size, "world_size")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")


class GlobalBatchSampler(Sampler[list[int]]):
    """Batch sampler with a global, resharding-safe cursor (see the module docstring).

    Use as ``DataLoader(dataset, batch_sampler=sampler)``. Iterating yields this
    rank's share of each remaining global batch of the current epoch that is
    not skipped; :meth:`advance` records that one global batch was trained on.
    """

    def __init__(
        self,
        dataset_len: int,
        global_batch_size: int,
        *,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        _check_positive(dataset_len, "dataset_len")
        _check_positive(global_batch_size, "global_batch_size")
        _check_rank(rank, world_size)
        if global_batch_size > dataset_len:
            raise ValueError(
                f"global_batch_size {global_batch_size} exceeds dataset_len {dataset_len}: "
                "no full global batch exists"
            )
        if world_size > global_batch_size:
            raise ValueError(
                f"world_size {world_size} exceeds global_batch_size {global_batch_size}: "
                "some ranks would get no samples; raise the global batch size"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        super().__init__()
        self.dataset_len = dataset_len
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._consumed_in_epoch = 0
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)
        self._skipped: tuple[tuple[int, int], ...] = ()

    @property
    def epoch(self) -> int:
        """The epoch the next global batch belongs to."""
        return self._epoch

    @property
    def consumed_in_epoch(self) -> int:
        """Samples of the current epoch consumed by completed steps (a multiple of G)."""
        return self._consumed_in_epoch

    @property
    def batches_per_epoch(self) -> int:
        """Full global batches in one epoch; the tail shorter than G is dropped."""
        return self.dataset_len // self.global_batch_size

    @property
    def consumed_total(self) -> int:
        """Samples consumed by completed steps since the start of training, all epochs."""
        return (
            self._epoch * self.batches_per_epoch * self.global_batch_size + self._consumed_in_epoch
        )

    @property
    def batches_consumed(self) -> int:
        """Global batches the cursor has passed since the start of training, skipped ones
        included: the step count only when nothing was skipped."""
        return self.consumed_total // self.global_batch_size

    @property
    def skipped(self) -> tuple[tuple[int, int], ...]:
        """The skipped ranges of ``consumed_total``: merged, sorted, whole global batches."""
        return self._skipped

    def skip_samples(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Never train on the half-open ``[start, end)`` ranges of ``consumed_total``.

        Each range is widened outward to whole global batches (a step trains on
        a global batch or not at all) and merged with the ranges already set. A
        cursor inside a skipped range moves past it at once. Iterators created
        before the call keep the skips they started with, as they keep the
        cursor: call this before ``iter(loader)``. Raises ValueError for a range
        that is not two ints with ``0 <= start < end``.
        """
        self._skipped = merge([*self._skipped, *self._widened(ranges)])
        self._seek(self._next_trained(self.batches_consumed))

    def _widened(self, ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        size = self.global_batch_size
        widened = []
        for pair in ranges:
            if not (
                isinstance(pair, tuple | list)
                and len(pair) == 2
                and all(_is_int(value) for value in pair)
                and 0 <= pair[0] < pair[1]
            ):
                raise ValueError(f"a skipped range is two ints 0 <= start < end, got {pair!r}")
            start, end = pair
            widened.append((start // size * size, -(-end // size) * size))
        return widened

    def _next_trained(self, batch: int) -> int:
        """The first global batch from ``batch`` on (counted over all epochs) not skipped."""
        for start, end in self._skipped:  # merged and sorted: one pass suffices
            if start <= batch * self.global_batch_size < end:
                batch = end // self.global_batch_size
        return batch

    def _seek(self, batch: int) -> None:
        """Put the cursor at global batch ``batch``, counted over all epochs."""
        self._epoch, index = divmod(batch, self.batches_per_epoch)
        self._consumed_in_epoch = index * self.global_batch_size

    def permutation(self, epoch: int) -> torch.Tensor:
        """The sample order of ``epoch`` (int64 tensor); cached for the current epoch."""
        if epoch != self._perm_epoch:
            if self.shuffle:
                generator = torch.Generator()
                generator.manual_seed(epoch_seed(self.seed, epoch))
                self._perm = torch.randperm(self.dataset_len, generator=generator)
            else:
                self._perm = torch.arange(self.dataset_len, dtype=torch.int64)
            self._perm_epoch = epoch
        return self._perm

    def global_batch(self, epoch: int, index: int) -> list[int]:
        """The ``index``-th global batch of ``epoch``: all ranks' samples, in rank order."""
        if not 0 <= index < self.batches_per_epoch:
            raise IndexError(f"epoch has {self.batches_per_epoch} global batches, not {index}")
        start = index * self.global_batch_size
        return self.permutation(epoch)[start : start + self.global_batch_size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        """Yield this rank's share of each global batch from the cursor to the epoch's end,
        skipped batches left out.

        The cursor and the skipped ranges are read now, when the iterator is
        created, not at the first ``next()``: a DataLoader creates its iterator,
        then its workers pull batches ahead of training, and advancing meanwhile
        must not shift them. :meth:`advance` steps over the same skipped
        batches, so step k trains on the k-th batch yielded.
        """
        epoch = self._epoch
        first = self._consumed_in_epoch // self.global_batch_size
        part = rank_slice(self.global_batch_size, self.rank, self.world_size)
        perm = self.permutation(epoch)
        return self._batches(perm, epoch, first, part, self._skipped)

    def _batches(
        self,
        perm: torch.Tensor,
        epoch: int,
        first: int,
        part: slice,
        skipped: tuple[tuple[int, int], ...],
    ) -> Iterator[list[int]]:
        size = self.global_batch_size
        epoch_start = epoch * self.batches_per_epoch * size
        for index in range(first, self.batches_per_epoch):
            if not _is_skipped(skipped, epoch_start + index * size):
                yield perm[index * size + part.start : index * size + part.stop].tolist()

    def __len__(self) -> int:
        """Batches a new iterator would yield: those left in the current epoch, less skipped."""
        size = self.global_batch_size
        low = self.consumed_total
        high = (self._epoch + 1) * self.batches_per_epoch * size
        skipped = sum(max(0, min(end, high) - max(start, low)) for start, end in self._skipped)
        return (high - low - skipped) // size

    def advance(self, steps: int = 1) -> None:
        """Record ``steps`` completed optimizer steps (one global batch each).

        Call after ``optimizer.step()`` on every rank, never from inside the
        data pipeline. Skipped batches are stepped over, so the cursor never
        rests inside a skipped range. Past the last full batch of an epoch the
        cursor moves to the next epoch (its first batch not skipped); the
        iterator in hand then ends, and the loop creates a new one for it.
        """
        _check_positive(steps, "steps")
        batch = self.batches_consumed
        for _ in range(steps):
            batch = self._next_trained(batch + 1)
        self._seek(batch)

    def state_dict(self) -> dict[str, Any]:
        """The position as plain values, identical on every rank (safe under DCP dedup)."""
        return {
            "epoch": self._epoch,
            "consumed_in_epoch": self._consumed_in_epoch,
            "consumed_total": self.consumed_total,
            "global_batch_size": self.global_batch_size,
            "dataset_len": self.dataset_len,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "skipped": [[start, end] for start, end in self._skipped],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position, with any rank and world size.

        Raises ValueError naming the mismatch when the dataset length, seed,
        shuffle or global batch size differ from this sampler's: any of those
        would silently change which samples come next, the failure this class
        exists to prevent. The cursor must be consistent with itself. The saved
        skipped ranges are merged with those already set; a state without them
        (saved before data could be skipped) skips nothing more.
        """
        missing = [key for key in self.state_dict() if key not in state and key != "skipped"]
        if missing:
            raise ValueError(f"sampler state lacks {', '.join(missing)}")
        for key in ("dataset_len", "seed", "shuffle", "global_batch_size"):
            saved, here = state[key], getattr(self, key)
            if saved != here:
                raise ValueError(
                    f"sampler {key} mismatch: the checkpoint has {saved!r}, this run has "
                    f"{here!r}; resuming would change the data order. Use the checkpoint's "
                    f"{key} (grad accumulation absorbs a world-size change)"
                )
        epoch, consumed = int(state["epoch"]), int(state["consumed_in_epoch"])
        size = self.global_batch_size
        if (
            epoch < 0
            or consumed < 0
            or consumed % size
            or consumed // size >= self.batches_per_epoch
        ):
            raise ValueError(
                f"sampler cursor epoch={epoch} consumed_in_epoch={consumed} is not a position "
                f"of {self.batches_per_epoch} batches of {size}"
            )
        expected_total = epoch * self.batches_per_epoch * size + consumed
        if int(state["consumed_total"]) != expected_total:
            raise ValueError(
                f"sampler consumed_total {state['consumed_total']} disagrees with epoch "
                f"{epoch} and consumed_in_epoch {consumed} (expected {expected_total})"
            )
        saved = state.get("skipped", [])
        if not isinstance(saved, list | tuple):
            raise ValueError(f"sampler skipped ranges {saved!r} are not a list of [start, end]")
        skipped = merge([*self._skipped, *self._widened(saved)])
        self._epoch, self._consumed_in_epoch = epoch, consumed
        self._skipped = skipped
        self._seek(self._next_trained(self.batches_consumed))
