"""The cluster as the daemon last saw it, shared by the Slurm poll and the decision task.

:class:`Cluster` holds the :class:`~supervisor.core.model.ClusterView` the core
decides on: the poll replaces it after each read of Slurm's nodes, and the
decision task refreshes its drain count and blames from the store before a
decision that blames a node (:meth:`Cluster.fresh`). ``known`` is set once
Slurm answered: nothing is decided before (a relaunch decided on an empty
view would requeue the job with the few nodes it still holds).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace

from supervisor.act.reconcile import KIND_OF
from supervisor.core.decision import Policy
from supervisor.core.intents import DrainNode
from supervisor.core.model import ClusterView
from supervisor.store import Actor, BlameOutcome, Store

# Blames whose node was drained or ticketed (or would have been): a user's share.
_ACTED = frozenset(
    {BlameOutcome.DRAINED, BlameOutcome.TICKETED, BlameOutcome.WOULD_DRAIN,
     BlameOutcome.WOULD_TICKET}
)  # fmt: skip


class Cluster:
    """The shared cluster view, and the store's drains and blames folded into it."""

    def __init__(self, store: Store, policy: Policy, *, observe_only: bool) -> None:
        self.store = store
        self.policy = policy
        self.observe_only = observe_only
        self.view = ClusterView()
        self.known = asyncio.Event()

    def drains_counted(self, now: float) -> int:
        """Resurgo's drains of the last hour, done or decided and not done yet (in
        observe-only mode, those it would have done count as done)."""
        done = len(self.store.drains_since(now - 3600, by=Actor.SUPERVISOR))
        if self.observe_only:
            done += self.store.observed_count(KIND_OF[DrainNode], now - 3600)
        return done + self.store.unfinished_count(KIND_OF[DrainNode])

    def blamed(self, view: ClusterView, now: float) -> ClusterView:
        """``view`` with the store's blames, in one read: (node, job) of those within the
        storm brake's window, (user, node) of those within the lemon window, and per
        user the nodes drained or ticketed for their jobs within the hour."""
        storm_since = now - self.policy.storm_window_s
        lemon_since = now - self.policy.lemon_window_s
        hour_since = now - 3600
        rows = self.store.blames_since(min(storm_since, lemon_since, hour_since))
        acts = Counter(
            b.slurm_user
            for b in rows
            if b.slurm_user and b.blamed_s >= hour_since and b.outcome in _ACTED
        )
        return replace(
            view,
            recent_blames=tuple((b.node, b.job_id) for b in rows if b.blamed_s >= storm_since),
            user_blames=tuple(
                (b.slurm_user, b.node) for b in rows if b.slurm_user and b.blamed_s >= lemon_since
            ),
            user_acts=tuple(sorted(acts.items())),
        )

    def fresh(self, now: float) -> ClusterView:
        """The cluster view with the store's drain count and blames as of now.

        A decision that blames a node is taken again on this: the view of the
        last poll does not hold what the decisions since then planned, and
        faults of several jobs decided between two polls would each take the
        hourly share's last drain, or miss a storm.
        """
        counted = replace(self.view, drains_last_hour=self.drains_counted(now))
        self.view = self.blamed(counted, now)
        return self.view
