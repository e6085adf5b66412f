"""Only the core decides: the daemon's components and the API observe, persist and act.

The check (``tests/unit/decision_rules.py`` defines its three rules exactly):
in each module of :data:`CHECKED`, no call constructs an intent of
:mod:`supervisor.core.intents` or a ``JobRecord`` (nor ``replace``-s a record),
and no branch tests a job's state or a driver's question, or orders anything
against a policy threshold or against arithmetic on the clock. What to do,
when, and to which job is the pure core's (``supervisor/core/``, where
``test_purity.py`` keeps the clock out).

Not checked: ``supervisor/act/`` carries intents out, and its comparisons are
about how an action is carried out (a node check's own wait for its Slurm
job, a StopJob's own status; Slurm's job states share the name ``JobState``);
the views, metrics and CLI only read the store.

:data:`ALLOWED` lists the places that pass a rule's letter but not its
intent, each with its reason. An allowed place that no longer decides is an
error too, so the list cannot go stale.
"""

from __future__ import annotations

import pytest

from tests.paths import REPO
from tests.unit.decision_rules import Finding, decisions

# The daemon's component modules, and the API (every module of it, one added tomorrow too).
CHECKED = tuple(
    sorted(
        {
            "supervisor/daemon.py",
            "supervisor/intake.py",
            "supervisor/polling.py",
            "supervisor/deciding.py",
            "supervisor/timers.py",
            "supervisor/jobtable.py",
            "supervisor/cluster.py",
        }
        | {str(path.relative_to(REPO)) for path in (REPO / "supervisor/api").rglob("*.py")}
    )
)

# (module, function, rule) -> why it is not a decision.
ALLOWED = {
    ("supervisor/deciding.py", "_persist", "branch"): (
        "which store rows a transition writes (an attempt row once a launch has its nodes): "
        "persisting what the core decided"
    ),
    ("supervisor/intake.py", "driver", "branch"): (
        "the driver reports that it started a relaunch: the intake has the executor finish "
        "that action (acting), and every other question goes to core.driver_answer"
    ),
    ("supervisor/api/directory.py", "driver", "branch"): (
        "MemoryDirectory, the in-memory JobDirectory for tests and for the API before the "
        "store exists: a scripted stand-in for the daemon, which never runs in it"
    ),
    ("supervisor/api/refusals.py", "flush", "branch"): (
        "the refusal log's own rate limit: when a log line is written, not a decision on a job"
    ),
}


def _findings(module: str) -> list[Finding]:
    return decisions((REPO / module).read_text())


def test_the_checked_modules_are_the_daemons_components_and_the_api() -> None:
    assert "supervisor/intake.py" in CHECKED and "supervisor/api/app.py" in CHECKED
    assert all((REPO / module).is_file() for module in CHECKED)


@pytest.mark.parametrize("module", CHECKED)
def test_a_module_outside_the_core_makes_no_decision(module: str) -> None:
    found = [
        f"{module}:{each.line} in {each.function}: {each.rule}: {each.text}"
        for each in _findings(module)
        if (module, each.function, each.rule) not in ALLOWED
    ]
    assert found == [], "decided outside supervisor/core/: " + "; ".join(found)


@pytest.mark.parametrize(("module", "function", "rule"), sorted(ALLOWED))
def test_every_allowed_place_still_needs_its_exception(
    module: str, function: str, rule: str
) -> None:
    assert any((each.function, each.rule) == (function, rule) for each in _findings(module)), (
        f"{module} {function} no longer {rule}s: take it off ALLOWED"
    )


PLANTED = """
from dataclasses import replace
from supervisor.core.intents import DrainNode
from supervisor.core.model import JobState


class Intake:
    def lease_lost(self, job, node, now):
        if now - job.last_report_s > self.policy.lease_s:
            self.act(job.job_id, (DrainNode(job.job_id, job.record.attempt, node, "lost"),))

    def on_exit(self, job, code):
        if job.record.state is JobState.RUNNING and code:
            job.record = replace(job.record, state=JobState.RECOVERING)

    def retry_s(self, record, now):
        return 0.2 if record.state.value == "recovering" else 2.0

    def spares_due(self, job):
        return [node for node in job.spares if self.clock() - job.checked_s >= 60]

    def progress(self, job, step):
        waiting = job.record.state in (JobState.STARTING, JobState.RELAUNCHING)
        return waiting and step != job.progress_step
"""


def test_the_check_flags_a_planted_decision_of_each_kind() -> None:
    found = {(each.function, each.rule) for each in decisions(PLANTED)}
    assert found == {
        ("lease_lost", "branch"),  # clock arithmetic against a policy threshold
        ("lease_lost", "intent"),  # a drain decided outside the core
        ("on_exit", "branch"),  # a JobState member tested
        ("on_exit", "record"),  # a record replaced outside the core
        ("retry_s", "branch"),  # a state's text compared
        ("spares_due", "branch"),  # the clock's arithmetic in a comprehension's test
        ("progress", "branch"),  # a state test kept in a name for later
    }


def test_the_check_lets_observing_persisting_and_acting_pass() -> None:
    source = """
def poll(self, jobs, now):
    for job_id, job in jobs.items():
        if job.record.state.terminal:
            continue
        if job.watch is not None and job.step > job.seen_step:
            self.store.record_progress(job_id, job.step, now)
        verdict = decide_lease(job.record, now, self.policy)
        if verdict is not None:
            self.enqueue(job_id, verdict)
"""
    assert decisions(source) == []
