"""The data a rollback skips: global sample ranges, computed when the rollback relaunches; pure.

A rollback after a training anomaly (:mod:`supervisor.core.rollback`) resumes
from a checkpoint before the onset and skips a window of global batches
around it, in the units of the ranks' global sample cursor
(:attr:`agent.train.sampler.GlobalBatchSampler.consumed_total`). The window
is fixed once the checkpoint is chosen: it starts
``anomaly_skip_lead_batches`` before the onset batch, but never before the
chosen checkpoint's own position (samples trained before the checkpoint are
not retrained, so skipping them would only be a false record), and spans
``anomaly_skip_batches`` batches from there. Every later launch of the job
is told every range skipped so far (``RESURGO_SKIP_SAMPLES``), so a resume
from an earlier checkpoint skips them again.
"""

from __future__ import annotations

from dataclasses import replace

from agent.skips import merge
from supervisor.core.decision import Policy
from supervisor.core.model import AnomalySeen, Cause, JobRecord

# Ranges kept on the record (merged): beyond this many the job has a data problem
# no skipping solves, and the rollback budget stops it long before.
MAX_SKIPPED_RANGES = 64


def window(seen: AnomalySeen, resume_step: int | None, policy: Policy) -> tuple[int, int] | None:
    """The global sample range a rollback from ``resume_step`` skips for ``seen``.

    None when the script reports no cursor (nothing can be skipped) or the
    policy skips no batch. The lead is cut to the steps between the
    checkpoint and the onset: the checkpoint of step S was saved before step
    S + 1, whose cursor is ``onset cursor - (onset - S - 1) batches`` at the
    latest (an earlier skip in between only moves it back).
    """
    if seen.cursor is None or seen.batch is None or policy.anomaly_skip_batches == 0:
        return None
    since = seen.onset_step - 1 - (resume_step or 0)
    lead = max(0, min(policy.anomaly_skip_lead_batches, since))
    start = max(0, seen.cursor - lead * seen.batch)
    return start, start + policy.anomaly_skip_batches * seen.batch


def with_skip(record: JobRecord, policy: Policy) -> JobRecord:
    """``record`` with its rollback's skip fixed, once the checkpoint is chosen.

    Only for a recovery caused by a training anomaly whose newest entry was
    rolled back and has no window yet; anything else is returned unchanged.
    """
    pending = record.recovery
    if pending is None or pending.cause is not Cause.TRAINING_ANOMALY or not record.anomalies:
        return record
    seen = record.anomalies[-1]
    if seen.action != "rollback" or seen.resumed_step is not None:
        return record
    skipped = window(seen, pending.resume_step, policy)
    done = replace(seen, skipped=skipped, resumed_step=pending.resume_step or 0)
    ranges = record.skipped_samples
    if skipped is not None:
        ranges = merge((*ranges, skipped))[-MAX_SKIPPED_RANGES:]
    return replace(record, anomalies=(*record.anomalies[:-1], done), skipped_samples=ranges)


def describe(seen: AnomalySeen) -> str:
    """A rollback's skip in words: its samples and batches, or why there is none."""
    if seen.skipped is None:
        if seen.cursor is None or seen.batch is None:
            return "no data skipped: the script reports no global sample cursor"
        return "no data skipped (anomaly_skip_batches is 0)"
    (start, end), batch = seen.skipped, seen.batch
    batches = f" ({(end - start) // batch} global batches)" if batch else ""
    return f"skipping global samples [{start}, {end}){batches}"
