"""The store's timeline summaries: each job's goodput accounting up to a time.

The metrics keep one per job (:class:`supervisor.views.timeline.JobTimeline`
makes and reads the documents; the store only keeps them), so that a
restarted supervisor's first scrape goes on from it instead of reading every
job's whole history. Derived data, written without an fsync: a summary a
power loss took back, or one that cannot be read, costs one longer read of
that job's history.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from supervisor.store.core import StoreCore, locked
from supervisor.store.rows import dumps, loads

logger = logging.getLogger(__name__)

# Job ids per query: well under SQLite's limit on bound parameters.
_CHUNK = 500


class Summaries(StoreCore):
    """Timeline summaries by job; a base of :class:`supervisor.store.Store`."""

    @locked
    def timeline_summaries(self, job_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The summaries kept for ``job_ids``, by job; a job with none (or with one
        that is not JSON, logged) is left out."""
        wanted = list(dict.fromkeys(job_ids))
        found: dict[str, dict[str, Any]] = {}
        for start in range(0, len(wanted), _CHUNK):
            chunk = wanted[start : start + _CHUNK]
            rows = self._db.execute(
                "SELECT job_id, summary FROM timeline_summaries"
                f" WHERE job_id IN ({', '.join('?' * len(chunk))})",
                chunk,
            )
            for job_id, text in rows:
                try:
                    document = loads(text)
                except ValueError as error:
                    logger.warning("job %s: its timeline summary is not JSON (%s); its "
                                   "history is read again instead", job_id, error)  # fmt: skip
                    continue
                if isinstance(document, dict):
                    found[job_id] = document
        return found

    @locked
    def keep_timeline_summaries(
        self, summaries: Iterable[tuple[str, float, Mapping[str, Any]]], now_s: float
    ) -> int:
        """Keep each (job, up to when, summary) in place of the job's previous one, in
        one transaction; return how many."""
        rows = [
            (job_id, upto_s, dumps(summary, f"job {job_id} timeline summary"), now_s)
            for job_id, upto_s, summary in summaries
        ]
        if not rows:
            return 0
        with self._tx(durable=False):
            self._db.executemany(
                "INSERT INTO timeline_summaries (job_id, upto_s, summary, saved_s)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (job_id) DO UPDATE SET"
                " upto_s = excluded.upto_s, summary = excluded.summary,"
                " saved_s = excluded.saved_s",
                rows,
            )
        return len(rows)
