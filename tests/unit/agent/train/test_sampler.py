"""The global-cursor batch sampler: exact resume across world sizes and epochs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from agent.train.sampler import (
    GlobalBatchSampler,
    GradReduction,
    epoch_seed,
    local_share,
    loss_weight,
    rank_slice,
)


def _ranks(
    dataset_len: int, batch: int, world_size: int, seed: int = 0, shuffle: bool = True
) -> list[GlobalBatchSampler]:
    return [
        GlobalBatchSampler(
            dataset_len, batch, rank=rank, world_size=world_size, seed=seed, shuffle=shuffle
        )
        for rank in range(world_size)
    ]


def _train(samplers: Sequence[GlobalBatchSampler], steps: int) -> list[list[int]]:
    """Drive the documented loop on every rank in lockstep; return each step's global batch.

    A new iterator per epoch, as `while ...: for batch in loader:` does; the
    global batch of a step is the concatenation of the ranks' shares.
    """
    done: list[list[int]] = []
    while len(done) < steps:
        for shares in zip(*(iter(sampler) for sampler in samplers), strict=True):
            done.append([index for share in shares for index in share])
            for sampler in samplers:
                sampler.advance()
            if len(done) == steps:
                break
    return done


def _reference(dataset_len: int, batch: int, steps: int, seed: int = 0) -> list[list[int]]:
    return [
        GlobalBatchSampler(dataset_len, batch, rank=0, world_size=1, seed=seed).global_batch(
            step // (dataset_len // batch), step % (dataset_len // batch)
        )
        for step in range(steps)
    ]


@st.composite
def _resize_cases(draw: st.DrawFn) -> tuple[int, int, int, int, int, int]:
    dataset_len = draw(st.integers(1, 120))
    batch = draw(st.integers(1, dataset_len))
    world_before = draw(st.integers(1, min(batch, 6)))
    world_after = draw(st.integers(1, min(batch, 6)))
    per_epoch = dataset_len // batch
    stop = draw(st.integers(0, 3 * per_epoch))
    total = stop + draw(st.integers(0, 3 * per_epoch))
    return dataset_len, batch, world_before, world_after, stop, total


@settings(max_examples=150, deadline=None)
@given(case=_resize_cases(), seed=st.integers(0, 2**40))
def test_resume_with_another_world_size_continues_at_exactly_the_next_global_sample(
    case: tuple[int, int, int, int, int, int], seed: int
) -> None:
    dataset_len, batch, world_before, world_after, stop, total = case
    reference = _reference(dataset_len, batch, total, seed)

    before = _ranks(dataset_len, batch, world_before, seed)
    trained = _train(before, stop)
    states = [sampler.state_dict() for sampler in before]
    assert all(state == states[0] for state in states), "state differs across ranks"

    after = _ranks(dataset_len, batch, world_after, seed)
    for sampler in after:
        sampler.load_state_dict(dict(states[0]))
    trained += _train(after, total - stop)

    assert trained == reference
    assert after[0].consumed_total == total * batch


@settings(max_examples=60, deadline=None)
@given(
    dataset_len=st.integers(1, 200),
    data=st.data(),
)
def test_each_epoch_visits_distinct_samples_and_drops_only_the_short_tail(
    dataset_len: int, data: st.DataObject
) -> None:
    batch = data.draw(st.integers(1, dataset_len))
    per_epoch = dataset_len // batch
    steps = _reference(dataset_len, batch, 2 * per_epoch, seed=3)
    for epoch in range(2):
        seen = [i for step in steps[epoch * per_epoch : (epoch + 1) * per_epoch] for i in step]
        assert len(seen) == len(set(seen)) == per_epoch * batch
        assert set(seen) <= set(range(dataset_len))


@settings(max_examples=100, deadline=None)
@given(batch=st.integers(1, 64), data=st.data())
def test_rank_shares_are_disjoint_cover_the_batch_and_differ_by_at_most_one(
    batch: int, data: st.DataObject
) -> None:
    world_size = data.draw(st.integers(1, batch))
    parts = [rank_slice(batch, rank, world_size) for rank in range(world_size)]
    covered = [i for part in parts for i in range(part.start, part.stop)]
    assert covered == list(range(batch))
    shares = [local_share(batch, rank, world_size) for rank in range(world_size)]
    assert sum(shares) == batch
    assert max(shares) - min(shares) <= 1


def test_order_ignores_the_global_torch_rng_and_depends_on_seed_and_epoch() -> None:
    sampler = GlobalBatchSampler(50, 5, rank=0, world_size=1, seed=11)
    torch.manual_seed(0)
    first = sampler.permutation(0).tolist()
    other = GlobalBatchSampler(50, 5, rank=0, world_size=1, seed=11)
    torch.manual_seed(12345)
    assert other.permutation(0).tolist() == first
    assert other.permutation(1).tolist() != first
    assert GlobalBatchSampler(50, 5, rank=0, world_size=1, seed=12).permutation(0).tolist() != first
    # (seed, epoch) pairs with equal sums must not share a permutation.
    assert epoch_seed(11, 1) != epoch_seed(12, 0)


def test_without_shuffle_the_order_is_the_dataset_order() -> None:
    sampler = GlobalBatchSampler(10, 4, rank=1, world_size=2, shuffle=False)
    assert list(sampler) == [[2, 3], [6, 7]]


def test_iteration_does_not_move_the_cursor_and_an_iterator_keeps_its_start() -> None:
    sampler = GlobalBatchSampler(40, 8, rank=0, world_size=2, seed=1)
    iterator = iter(sampler)
    sampler.advance(2)
    # Created before advancing: still yields from the start of the epoch.
    assert next(iterator) == sampler.global_batch(0, 0)[:4]
    list(iterator)
    assert sampler.state_dict()["consumed_in_epoch"] == 16
    assert next(iter(sampler)) == sampler.global_batch(0, 2)[:4]
    assert len(sampler) == 3


def test_advance_past_the_last_full_batch_rolls_over_to_the_next_epoch() -> None:
    sampler = GlobalBatchSampler(23, 5, rank=0, world_size=1)
    sampler.advance(4)
    assert (sampler.epoch, sampler.consumed_in_epoch) == (1, 0)
    sampler.advance(9)
    assert (sampler.epoch, sampler.consumed_in_epoch) == (3, 5)
    assert sampler.state_dict()["consumed_total"] == 13 * 5
    assert sampler.batches_consumed == 13


class _Indices(Dataset[int]):
    def __len__(self) -> int:
        return 37

    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_prefetch_does_not_move_the_cursor_and_resume_4_to_3_is_exact(
    num_workers: int,
) -> None:
    dataset, batch, crash_at, total = _Indices(), 12, 4, 7
    reference = _reference(len(dataset), batch, total, seed=5)

    def loaders(samplers: list[GlobalBatchSampler]) -> list[DataLoader[Any]]:
        kwargs: dict[str, Any] = {"num_workers": num_workers}
        if num_workers:
            kwargs["prefetch_factor"] = 4
        return [DataLoader(dataset, batch_sampler=s, **kwargs) for s in samplers]

    def run(samplers: list[GlobalBatchSampler], steps: int) -> list[list[int]]:
        out: list[list[int]] = []
        data = loaders(samplers)
        while len(out) < steps:
            for batches in zip(*data, strict=True):
                out.append([int(i) for b in batches for i in b])
                for sampler in samplers:
                    sampler.advance()
                if len(out) == steps:
                    # Workers have prefetched ahead; leaving the loop is the crash.
                    break
        return out

    before = _ranks(len(dataset), batch, 4, seed=5)
    trained = run(before, crash_at)
    state = before[0].state_dict()
    assert state["consumed_total"] == crash_at * batch

    after = _ranks(len(dataset), batch, 3, seed=5)
    for sampler in after:
        sampler.load_state_dict(state)
    trained += run(after, total - crash_at)
    assert trained == reference


def _state(**changes: Any) -> dict[str, Any]:
    sampler = GlobalBatchSampler(100, 10, rank=0, world_size=2, seed=4)
    sampler.advance(3)
    return {**sampler.state_dict(), **changes}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dataset_len": 101}, "dataset_len mismatch"),
        ({"seed": 5}, "seed mismatch"),
        ({"global_batch_size": 20}, "global_batch_size mismatch"),
        ({"shuffle": False}, "shuffle mismatch"),
        ({"consumed_in_epoch": 15}, "not a position"),
        ({"consumed_in_epoch": 100}, "not a position"),
        ({"epoch": -1}, "not a position"),
        ({"consumed_total": 31}, "disagrees"),
    ],
)
def test_loading_a_mismatched_state_raises_naming_the_mismatch(
    changes: dict[str, Any], message: str
) -> None:
    sampler = GlobalBatchSampler(100, 10, rank=1, world_size=3, seed=4)
    with pytest.raises(ValueError, match=message):
        sampler.load_state_dict(_state(**changes))
    assert sampler.consumed_total == 0


def test_loading_a_state_without_a_key_names_it() -> None:
    state = _state()
    del state["seed"]
    with pytest.raises(ValueError, match="lacks seed"):
        GlobalBatchSampler(100, 10, rank=0, world_size=1, seed=4).load_state_dict(state)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((10, 11, 0, 1), "exceeds dataset_len"),
        ((10, 4, 0, 5), "world_size 5 exceeds"),
        ((10, 4, 2, 2), "rank must be"),
        ((0, 4, 0, 1), "dataset_len must be"),
    ],
)
def test_impossible_configurations_are_refused(
    args: tuple[int, int, int, int], message: str
) -> None:
    dataset_len, batch, rank, world_size = args
    with pytest.raises(ValueError, match=message):
        GlobalBatchSampler(dataset_len, batch, rank=rank, world_size=world_size)


@pytest.mark.parametrize("reduction", list(GradReduction))
def test_weighted_loss_gives_the_global_mean_gradient_for_4_and_3_ranks(
    reduction: GradReduction,
) -> None:
    torch.manual_seed(0)
    batch = 10
    inputs, targets = torch.randn(batch, 3), torch.randn(batch)
    weights = torch.randn(3, requires_grad=True)

    def gradient(loss: torch.Tensor) -> torch.Tensor:
        (grad,) = torch.autograd.grad(loss, weights)
        return grad

    def per_sample(part: slice) -> torch.Tensor:
        return (inputs[part] @ weights - targets[part]) ** 2

    expected = gradient(per_sample(slice(None)).mean())
    for world_size in (4, 3):
        grads = [
            gradient(
                per_sample(rank_slice(batch, r, world_size)).sum()
                * loss_weight(batch, world_size, reduction)
            )
            for r in range(world_size)
        ]
        combined = torch.stack(grads).sum(0)
        if reduction is GradReduction.MEAN:
            combined = combined / world_size
        torch.testing.assert_close(combined, expected)


def _trained_positions(samplers: Sequence[GlobalBatchSampler], steps: int) -> list[int]:
    """The ``consumed_total`` of each step's global batch, checked against the batch trained.

    The position is read before the step's ``advance()``; the iterator's batch
    must be exactly the one the cursor accounts for (the batch at the cursor).
    """
    positions: list[int] = []
    size, per_epoch = samplers[0].global_batch_size, samplers[0].batches_per_epoch
    while len(positions) < steps:
        for shares in zip(*(iter(sampler) for sampler in samplers), strict=True):
            cursor = samplers[0].consumed_total
            epoch, index = divmod(cursor // size, per_epoch)
            assert [i for share in shares for i in share] == samplers[0].global_batch(epoch, index)
            positions.append(cursor)
            for sampler in samplers:
                sampler.advance()
            if len(positions) == steps:
                break
    return positions


def test_a_skipped_window_mid_epoch_is_widened_to_whole_batches_and_never_trained() -> None:
    # 10 batches of 4 per epoch; [9, 17) widens to batches 2..4 = samples [8, 20).
    sampler = GlobalBatchSampler(40, 4, rank=0, world_size=1, seed=2)
    sampler.skip_samples([(9, 17)])
    assert sampler.skipped == ((8, 20),)
    assert len(sampler) == 7
    positions = _trained_positions([sampler], 7)
    assert positions == [0, 4, 20, 24, 28, 32, 36]
    assert (sampler.epoch, sampler.consumed_in_epoch) == (1, 0)
    # The cursor counts the batches passed, skipped ones included, not the steps.
    assert sampler.batches_consumed == 10


def test_a_window_across_epochs_skips_the_end_of_one_and_the_start_of_the_next() -> None:
    # 5 batches of 5 per epoch (28 samples: the tail of 3 is dropped, not counted).
    sampler = GlobalBatchSampler(28, 5, rank=0, world_size=1, seed=7)
    sampler.skip_samples([(20, 35)])  # epoch 0 batch 4, epoch 1 batches 0 and 1
    sampler.advance(3)
    assert (sampler.epoch, sampler.consumed_in_epoch) == (0, 15)
    sampler.advance()
    assert (sampler.epoch, sampler.consumed_in_epoch) == (1, 10)
    assert len(sampler) == 3

    fresh = GlobalBatchSampler(28, 5, rank=0, world_size=1, seed=7)
    fresh.skip_samples([(20, 35)])
    assert _trained_positions([fresh], 6) == [0, 5, 10, 15, 35, 40]


def test_a_cursor_inside_a_new_window_moves_past_it_and_windows_merge() -> None:
    sampler = GlobalBatchSampler(40, 4, rank=0, world_size=1)
    sampler.advance(3)
    sampler.skip_samples([(12, 16), (30, 33)])
    assert sampler.consumed_total == 16
    sampler.skip_samples([(16, 20), (0, 1)])
    assert sampler.skipped == ((0, 4), (12, 20), (28, 36))
    assert sampler.consumed_total == 20


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_iteration_and_advance_agree_every_batch_but_the_skipped_trained_once(
    data: st.DataObject,
) -> None:
    dataset_len = data.draw(st.integers(2, 60))
    batch = data.draw(st.integers(1, dataset_len // 2))
    world_size = data.draw(st.integers(1, min(batch, 4)))
    per_epoch = dataset_len // batch
    total_batches = 3 * per_epoch
    windows = data.draw(
        st.lists(
            st.tuples(st.integers(0, total_batches * batch), st.integers(1, 3 * batch)), max_size=3
        )
    )
    ranges = [(start, start + length) for start, length in windows]
    skipped_batches = {
        position // batch
        for start, end in ranges
        for position in range(start, end)
        if position // batch < total_batches
    }
    wanted = [b for b in range(total_batches) if b not in skipped_batches]
    samplers = _ranks(dataset_len, batch, world_size, seed=9)
    for sampler in samplers:
        sampler.skip_samples(ranges)
    positions = _trained_positions(samplers, len(wanted)) if wanted else []
    assert [position // batch for position in positions] == wanted


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_samples_trained_with_a_skip_do_not_depend_on_the_world_size(world_size: int) -> None:
    def trained(world: int) -> list[list[int]]:
        samplers = _ranks(30, 6, world, seed=4)
        for sampler in samplers:
            sampler.skip_samples([(7, 13), (27, 31)])
        return _train(samplers, 8)

    assert trained(world_size) == trained(1)
    # [7, 13) widens to batches 1-2, [27, 31) to batches 4-5 (across the epoch boundary).
    reference = _reference(30, 6, 12, seed=4)
    assert trained(world_size) == [reference[b] for b in (0, 3, 6, 7, 8, 9, 10, 11)]


def test_skipped_windows_survive_a_state_dict_round_trip_and_merge_with_those_set() -> None:
    before = GlobalBatchSampler(40, 4, rank=0, world_size=2, seed=3)
    before.skip_samples([(8, 12)])
    before.advance(1)
    state = before.state_dict()
    assert state["skipped"] == [[8, 12]]

    after = GlobalBatchSampler(40, 4, rank=1, world_size=3, seed=3)
    after.skip_samples([(4, 6)])  # the cursor sits at 4 once the state is loaded
    after.load_state_dict(state)
    assert after.skipped == ((4, 12),)
    assert after.consumed_total == 12
    assert after.state_dict()["skipped"] == [[4, 12]]


def test_a_state_saved_before_skips_existed_loads_and_skips_nothing_more() -> None:
    state = _state()
    del state["skipped"]
    sampler = GlobalBatchSampler(100, 10, rank=0, world_size=1, seed=4)
    sampler.load_state_dict(state)
    assert (sampler.consumed_total, sampler.skipped) == (30, ())


@pytest.mark.parametrize(
    "ranges", [[(5, 5)], [(-1, 3)], [(3, 2)], [(True, 3)], [(0.0, 3)], [(1, 2, 3)]]
)
def test_a_range_that_is_not_two_ordered_ints_is_refused(ranges: list[Any]) -> None:
    sampler = GlobalBatchSampler(100, 10, rank=0, world_size=1, seed=4)
    with pytest.raises(ValueError, match="skipped range"):
        sampler.skip_samples(ranges)
    with pytest.raises(ValueError, match="skipped range"):
        sampler.load_state_dict(_state(skipped=[list(pair) for pair in ranges]))
    assert (sampler.consumed_total, sampler.skipped) == (0, ())
