"""A restarted supervisor's first scrape, from the store's timeline summaries, says what
a scrape that walks every job's whole history says: the same exposition, byte for byte.

Two jobs live through recoveries (a killed rank resumed from a checkpoint, a hang
requeued and resumed from the script's own checkpoint, a node loss), save stalls and,
for one, a clean end, while supervisors scrape, keep summaries and restart in
between. At the end a fresh collector on the store (from the summaries) and a fresh
collector on a copy of it without any summary (the whole history) scrape at the same
time. Everything runs on a real SQLite store.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from supervisor.metrics import StoreCollector, build_registry, exposition
from supervisor.store import Store
from supervisor.views.timeline import CHECKPOINT_STATS_KIND

RUNNING, ENDED = "4711", "4712"
END_S = 500.0

Write = Callable[[Store], object]


def _history() -> list[tuple[float, Write]]:
    """Every write of both jobs' histories, with when it happens (in time order)."""
    ops: list[tuple[float, Write]] = []

    def at(t: float, write: Write) -> None:
        ops.append((t, write))

    def decide(job: str, t: float, source: str, target: str, cause: str = "none") -> None:
        at(t, lambda s: s.record_decision(job, None, source, target, cause, {}, t))

    def attempt(job: str, t: float, number: int, resumed_from: str | None) -> None:
        at(t, lambda s: s.start_attempt(job, number, nodes=["n1"], resumed_from=resumed_from,
                                        now_s=t))  # fmt: skip

    def step(job: str, t: float, number: int) -> None:
        at(t, lambda s: s.record_progress(job, number, t))

    def save(job: str, t: float, number: int, stall_s: float) -> None:
        at(t, lambda s: s.record_checkpoint(job, number, f"/ckpt/{job}/step-{number}", t))
        stats = {"stall_s": stall_s, "write_s": 2.0 + stall_s}
        at(t + 0.5, lambda s: s.record_observation(job, CHECKPOINT_STATS_KIND, stats, t + 0.5))

    def state(job: str, t: float, name: str) -> None:
        at(t, lambda s: s.upsert_job(job, state=name, record=RECORD, now_s=t))

    # RUNNING: a killed rank (the cause named 3 s after the window opened) resumed
    # from step 9; a hang requeued by Slurm, resumed from the script's own checkpoint.
    decide(RUNNING, 10, "submitted", "starting")
    attempt(RUNNING, 10, 1, None)
    for t in range(20, 120, 7):
        step(RUNNING, t, t // 7)
        if t % 3 == 0:
            save(RUNNING, t + 0.25, t // 7, 0.25)
    decide(RUNNING, 125, "running", "recovering")
    decide(RUNNING, 128, "recovering", "recovering", "rank_signal")
    decide(RUNNING, 140, "recovering", "relaunching", "rank_signal")
    attempt(RUNNING, 140, 2, f"/ckpt/{RUNNING}/step-9")
    for t in range(150, 250, 5):
        step(RUNNING, t, 9 + (t - 150) // 5)
        if t % 20 == 0:
            save(RUNNING, t + 0.25, 9 + (t - 150) // 5, 0.5)
    decide(RUNNING, 252, "running", "recovering", "hang")
    decide(RUNNING, 260, "recovering", "requeued", "hang")
    state(RUNNING, 260, "requeued")
    decide(RUNNING, 300, "requeued", "starting")
    state(RUNNING, 300, "running")
    attempt(RUNNING, 300, 3, None)
    for t in range(320, 480, 4):
        step(RUNNING, t, 20 + (t - 320) // 4)
        if t % 5 == 0:
            save(RUNNING, t + 0.5, 20 + (t - 320) // 4, 0.75)

    # ENDED: a node lost, resumed from its newest checkpoint, then a clean end.
    decide(ENDED, 15, "submitted", "running")
    attempt(ENDED, 15, 1, None)
    for t in range(20, 150, 6):
        step(ENDED, t, t // 6)
        if t % 4 == 0:
            save(ENDED, t + 0.25, t // 6, 0.5)
    decide(ENDED, 152, "running", "recovering", "node_lost")
    decide(ENDED, 160, "recovering", "relaunching", "node_lost")
    attempt(ENDED, 160, 2, f"/ckpt/{ENDED}/step-20")
    for t in range(170, 300, 6):
        step(ENDED, t, 20 + (t - 170) // 6)
    decide(ENDED, 301, "running", "completed", "slurm_ended")
    state(ENDED, 301, "completed")
    return sorted(ops, key=lambda op: op[0])


RECORD = {"attempt": 1, "nodes": ["n1", "n2"], "restarts": [["hang", 1]], "final_reason": ""}


def _register(store: Store) -> None:
    for job, created_s in ((RUNNING, 0.0), (ENDED, 5.0)):
        store.upsert_job(job, state="running", record=RECORD, now_s=created_s,
                         name="llm", original_nodes=2, min_nodes=1)  # fmt: skip


class Supervisor:
    """One supervisor's metrics over the store at ``path``: its clock is set by the test."""

    def __init__(self, path: Path, summary_every_s: float = 60.0) -> None:
        self.store = Store.open(path)
        self.now = 0.0
        self.collector = StoreCollector(
            self.store,
            cluster_nodes=lambda: 8,
            connected_agents=lambda: 2,
            drains_allowed_per_hour=lambda: 1,
            clock=lambda: self.now,
            summary_every_s=summary_every_s,
        )
        self.registry = build_registry(self.collector)

    def scrape(self, now: float) -> str:
        self.now = now
        return exposition(self.registry).decode()


def _live(path: Path, plan: list[tuple[float, str]], summary_every_s: float) -> Supervisor:
    """Write the whole history while supervisors scrape, keep summaries and restart as
    ``plan`` says; return the last supervisor (its store open, the test closes it)."""
    ops = _history()
    with Store.open(path) as store:
        _register(store)
    supervisor = Supervisor(path, summary_every_s)
    for when, what in sorted(plan):
        while ops and ops[0][0] <= when:
            ops.pop(0)[1](supervisor.store)
        if what == "scrape":
            supervisor.scrape(when)
        elif what == "keep":
            supervisor.now = when
            supervisor.collector.keep_summaries()
        else:  # restart: the next supervisor starts from the store alone
            supervisor.store.close()
            supervisor = Supervisor(path, summary_every_s)
    for _, write in ops:
        write(supervisor.store)
    return supervisor


def _compared(path: Path, where: Path, plan: list[tuple[float, str]], every_s: float) -> str:
    """After ``plan``: a restarted supervisor's first scrape at END_S (from the summaries
    the plan left), which must be a scrape of the whole history; so must the last
    supervisor's next one. Returns the whole history's."""
    last = _live(path, plan, every_s)
    try:
        cold = _cold(path)
        whole = _whole_history(path, where)
        assert cold == whole
        assert last.scrape(END_S) == whole
    finally:
        last.store.close()
    return whole


def _cold(path: Path) -> str:
    """A restarted supervisor's first scrape at END_S."""
    supervisor = Supervisor(path)
    try:
        return supervisor.scrape(END_S)
    finally:
        supervisor.store.close()


def _whole_history(path: Path, where: Path) -> str:
    """The scrape at END_S of a copy of the store without its summaries."""
    copy = where / "whole.db"
    with Store.open(path) as store:
        store.backup(copy)
    db = sqlite3.connect(copy)
    with db:
        db.execute("DELETE FROM timeline_summaries")
    db.close()
    return _cold(copy)


def _kept(path: Path) -> dict[str, dict[str, object]]:
    with Store.open(path) as store:
        return store.timeline_summaries([RUNNING, ENDED])


# Restarts between a fault and its resume (the restored timeline reads the failed
# run's steps back), inside a requeue's queue wait, in a run, and after a job ended.
PLANS = {
    "restart between a fault and its resume": [(100, "scrape"), (132, "scrape"),
                                                (133, "restart"), (170, "scrape")],
    "restart in a requeue's wait": [(60, "scrape"), (200, "keep"), (280, "scrape"),
                                    (281, "restart"), (290, "scrape"), (400, "scrape")],
    "restarts in a run and after an end": [(50, "scrape"), (230, "scrape"), (231, "restart"),
                                           (240, "keep"), (330, "scrape"), (331, "restart"),
                                           (450, "scrape")],
    "restart before any summary": [(3, "scrape"), (4, "restart"), (200, "scrape")],
}  # fmt: skip


@pytest.mark.parametrize("summary_every_s", [0.0, 60.0])
@pytest.mark.parametrize("plan", PLANS.values(), ids=list(PLANS))
def test_a_first_scrape_from_the_summaries_equals_a_walk_of_the_whole_history(
    tmp_path: Path, plan: list[tuple[float, str]], summary_every_s: float
) -> None:
    path = tmp_path / "resurgo.db"
    whole = _compared(path, tmp_path, plan, summary_every_s)
    # What is compared holds the recoveries: each job's lost work, the requeue's wait.
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(whole)
        for sample in family.samples
    }
    for job in (RUNNING, ENDED):
        assert samples["resurgo_job_badput_seconds", (("cause", "lost_work"), ("job_id", job))] > 0
    queued = samples["resurgo_job_badput_seconds", (("cause", "queue_wait"), ("job_id", RUNNING))]
    assert queued == 10 + 40  # submitted at 0, started at 10; requeued at 260, started at 300
    assert samples["resurgo_job_time_to_recover_seconds_count", (("job_id", RUNNING),)] == 2


def test_a_store_without_summaries_gets_them_from_its_first_scrape(tmp_path: Path) -> None:
    path = tmp_path / "resurgo.db"
    _live(path, [], summary_every_s=60.0).store.close()
    assert _kept(path) == {}
    first = _cold(path)
    kept = _kept(path)
    assert set(kept) == {RUNNING, ENDED}
    window = kept[RUNNING]["window"]
    assert isinstance(window, dict)
    assert window["upto_s"] == END_S - 5.0  # everything but the settling seconds
    assert _cold(path) == first


def test_a_scrape_whose_summaries_cannot_be_kept_still_answers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    supervisor = _live(tmp_path / "resurgo.db", [(200, "scrape")], summary_every_s=0.0)
    try:
        supervisor.store._db.execute("DROP TABLE timeline_summaries")
        assert "resurgo_job_goodput_ratio" in supervisor.scrape(END_S)
    finally:
        supervisor.store.close()
    assert "keeping the jobs' timeline summaries in the store failed" in caplog.text


# Each summary made wrong in one place: the comparison above must see every one.
BREAKS: dict[str, tuple[str, Callable[[float | None], float]]] = {
    "watermark one step back (a decision fed twice)": (
        "$.window.upto_s", lambda upto_s: (upto_s or 0.0) - 6.0),
    "one save stall left out": ("$.accountant.stalled_s", lambda total: (total or 0.0) - 0.5),
    "the failed run read back without the row that reached the resume's step": (
        "$.accountant.walk.run_from_s", lambda from_s: 123.0 if from_s is None else from_s),
}  # fmt: skip


@pytest.mark.parametrize(("field", "change"), BREAKS.values(), ids=list(BREAKS))
def test_a_summary_wrong_by_one_row_gives_other_numbers_than_the_whole_history(
    tmp_path: Path, field: str, change: Callable[[float | None], float]
) -> None:
    """Summaries kept up to 152 s: RUNNING resumed at 140 s; ENDED's fault was detected
    at 152 s, and its resume (step 20) at 160 s reads its first run back, where step 20
    was reached at 122 s."""
    path = tmp_path / "resurgo.db"
    _live(path, [(130, "scrape"), (157, "keep")], summary_every_s=0.0).store.close()
    db = sqlite3.connect(path)
    with db:
        for job, text in db.execute("SELECT job_id, summary FROM timeline_summaries").fetchall():
            old = db.execute("SELECT json_extract(?, ?)", (text, field)).fetchone()[0]
            db.execute(
                "UPDATE timeline_summaries SET summary = json_set(summary, ?, json(?))"
                " WHERE job_id = ?",
                (field, json.dumps(change(old)), job),
            )
    db.close()
    assert _cold(path) != _whole_history(path, tmp_path)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(
            st.floats(min_value=0, max_value=END_S - 1),
            st.sampled_from(["scrape", "scrape", "keep", "restart"]),
        ),
        max_size=10,
    ),
    st.sampled_from([0.0, 60.0]),
)
def test_however_supervisors_scrape_and_restart_the_summaries_give_the_whole_history(
    tmp_path_factory: pytest.TempPathFactory, plan: list[tuple[float, str]], every_s: float
) -> None:
    where = tmp_path_factory.mktemp("store")
    _compared(where / "resurgo.db", where, plan, every_s)
