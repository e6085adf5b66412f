"""Event batches that arrive together are stored in one durable commit.

Every event batch an agent sends is acknowledged only once it is durable, and
a durable commit is an fsync. One commit per batch bounds how many batches a
second the supervisor can take by the disk's fsync rate, whatever the CPU:
16,384 nodes sending an event a minute each are 270 batches a second. The
batches whose checks are done by the time the loop runs :meth:`GroupCommit._commit`
(those that arrived while one was being stored, under load) are stored in
one transaction instead (up to :data:`MOST_AT_ONCE` of them, for at most
:data:`HOLD_S`), each in a savepoint of its own, so that one that
fails undoes only its own writes; each gets its answer after the commit,
never before.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

_T = TypeVar("_T")

# Batches one commit takes at most: the loop is held while they are stored.
MOST_AT_ONCE = 64
# And the longest one commit stores batches before it commits and lets the loop go
# on (the rest wait for the next): a relayed batch holds a whole job's events, and
# 64 of them held the loop, and every heartbeat frame behind it, for 100 ms and more.
HOLD_S = 0.02


class GroupCommit:
    """Run ``take`` callables in shared durable transactions (``durably()``: one
    transaction; nested, a savepoint)."""

    def __init__(
        self,
        durably: Callable[[], AbstractContextManager[Any]],
        most: int = MOST_AT_ONCE,
        hold_s: float = HOLD_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._durably = durably
        self._most = most
        self._hold_s = hold_s
        self._clock = clock
        self._waiting: list[tuple[Callable[[], Any], asyncio.Future[Any]]] = []
        self.commits = 0
        self.taken = 0

    async def run(self, take: Callable[[], _T]) -> _T:
        """``take()``'s value once its writes are durable (or what it raised)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        self._waiting.append((take, future))
        if len(self._waiting) == 1:
            loop.call_soon(self._commit)
        return await future

    def _commit(self) -> None:
        waiting, self._waiting = self._waiting, []
        group: list[tuple[Callable[[], Any], asyncio.Future[Any]]] = []
        outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        started = self._clock()
        try:
            with self._durably():
                for take, future in waiting:
                    if group and (
                        len(group) >= self._most or self._clock() - started >= self._hold_s
                    ):
                        break
                    group.append((take, future))
                    try:
                        with self._durably():
                            outcomes.append((future, take(), None))
                    except Exception as error:
                        outcomes.append((future, None, error))
        except Exception as error:  # the commit itself failed: nothing of the group is stored
            for _, future in group:
                if not future.done():
                    future.set_exception(error)
            return
        finally:
            # What this commit had no room or time for goes first in the next.
            self._waiting[:0] = waiting[len(group) :]
            if self._waiting:
                asyncio.get_running_loop().call_soon(self._commit)
        self.commits += 1
        self.taken += len(group)
        for future, value, raised in outcomes:
            if future.done():  # its client went away
                continue
            if raised is not None:
                future.set_exception(raised)
            else:
                future.set_result(value)
