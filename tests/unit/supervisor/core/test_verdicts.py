"""Verdicts can be corrected: drains lifted outside Resurgo, forgiven blames, reasons per exclusion.

The pure parts (which drains were lifted, the exclusion explanation) are table
tests; the store, the daemon's poll and the CLI run on a real store with a
fake Slurm. The live counterpart is tests/integration/test_verdicts_live.py.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from supervisor.act.reconcile import KIND_OF, args_of
from supervisor.cli import nodes as nodes_cli
from supervisor.cli.main import main
from supervisor.config import SupervisorConfig
from supervisor.core.decision import Context
from supervisor.core.intents import RequeueSmaller, ResumeNode
from supervisor.core.model import Cause, ClusterView, JobState, Recovery, new_record
from supervisor.core.policy import Policy
from supervisor.core.probation import lifted_outside
from supervisor.core.recovery import exclusions, relaunch
from supervisor.daemon import Supervisor
from supervisor.errors import SlurmCommandFailed
from supervisor.slurm.parse import drain_reason
from supervisor.store import Actor, Store, schema
from supervisor.views import documents as views
from tests.fakes.slurm import FakeSlurm, node

NOW = 1_760_000_000.0
OURS = drain_reason("rank_signal", 7)


@pytest.mark.parametrize(
    ("drained_s", "seen", "lifted"),
    [
        (NOW - 60, node("node3"), ("node3",)),  # resumed by an admin
        (NOW - 60, node("node3", drained=True, reason=OURS), ()),  # still ours
        (NOW - 60, node("node3", drained=True, reason="bad DIMM"), ()),  # re-drained: theirs
        (NOW + 1, node("node3"), ()),  # drained after the read started: not visible yet
        (NOW - 60, None, ()),  # Slurm does not list it: unknown, not lifted
    ],
)
def test_a_drain_counts_as_lifted_only_when_a_read_after_it_shows_the_node_undrained(
    drained_s: float, seen: Any, lifted: tuple[str, ...]
) -> None:
    sinfo = {} if seen is None else {"node3": seen}
    assert lifted_outside([("node3", drained_s)], sinfo, NOW) == lifted


LEMONS = ClusterView(lemons=frozenset({"node2"}), lemon_blames=(("node2", 3),),
                     lemon_window_s=7 * 86400.0)  # fmt: skip


@pytest.mark.parametrize(
    ("blamed", "cluster", "text"),
    [
        ({"node1"}, LEMONS, "excluding node1 (blamed in this job (hang)), "
                            "node2 (lemon: 3 blames in 7 d)"),
        ({"node2"}, LEMONS, "excluding node2 (blamed in this job (hang), "
                            "lemon: 3 blames in 7 d)"),
        (set(), ClusterView(down=frozenset({"node4"}), drained=frozenset({"node3"})),
         "excluding no node; left out: node3 (drained by Slurm/admin), node4 (down)"),
        (set(), ClusterView(lemons=frozenset({"node2"})), "excluding node2 (lemon)"),
    ],
)  # fmt: skip
def test_every_excluded_node_is_named_with_its_reason(
    blamed: set[str], cluster: ClusterView, text: str
) -> None:
    job_nodes = ("node1", "node2", "node3", "node4")
    assert exclusions(blamed, "in this job (hang)", job_nodes, cluster) == text


def drained_twice(store: Store, node: str, now_s: float = NOW) -> None:
    """``node`` drained twice, by jobs of two users (a lemon by the default policy)."""
    for job_id, user in (("7", "alice"), ("8", "bob")):
        store.upsert_job(job_id, state="running", record={}, now_s=now_s, name="t",
                         original_nodes=4, min_nodes=1, slurm_user=user)  # fmt: skip
    for i, (job_id, at) in enumerate((("7", now_s - 7200), ("8", now_s - 3600))):
        store.record_drain(node, cause=Cause.RANK_SIGNAL, job_id=job_id, reason=OURS, now_s=at,
                           action_id=f"{job_id}/{i}/drain/{node}")  # fmt: skip
        if i == 0:
            store.record_undrain(node, now_s=at + 60)


def test_a_drain_lifted_outside_resurgo_is_closed_as_such_and_stops_making_a_lemon(
    tmp_path: Path,
) -> None:
    with Store.open(tmp_path / "s.db") as store:
        drained_twice(store, "node3")
        assert [x.node for x in store.lemons(2, 86400, NOW)] == ["node3"]
        assert store.record_lifted_outside("node3", now_s=NOW) == 1
        assert store.open_drains() == []
        assert [x.node for x in store.lemons(2, 86400, NOW)] == []
        last = store.blame_history("node3")[-1]
        assert (last.undrained_by, last.withdrawn_by, last.withdrawn_s) == (
            Actor.OUTSIDE, Actor.OUTSIDE, NOW)  # fmt: skip


def test_forgiving_a_node_withdraws_every_standing_verdict_and_keeps_the_audit(
    tmp_path: Path,
) -> None:
    with Store.open(tmp_path / "s.db") as store:
        drained_twice(store, "node3")
        assert store.withdraw_blames("node3", now_s=NOW) == 2
        assert store.withdraw_blames("node3", now_s=NOW) == 0
        assert store.lemons(1, 86400, NOW) == []
        assert len(store.blame_history("node3")) == 2
        assert [d.node for d in store.open_drains()] == ["node3"]  # still drained in Slurm


def test_a_store_from_before_withdrawn_verdicts_opens_with_its_drains_standing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    schema.migrate(db, path, schema.MIGRATIONS[:2])
    db.execute("INSERT INTO drains (node, cause, job_id, reason, drained_by, drained_s)"
               " VALUES ('node3', 'hang', NULL, 'r', 'supervisor', ?)", (NOW,))  # fmt: skip
    db.commit()
    db.close()
    with Store.open(path) as store:
        (drain,) = store.open_drains()
        assert drain.withdrawn_s is None and drain.counts_as_blame
        assert [x.node for x in store.lemons(1, 86400, NOW)] == ["node3"]


class Slurm(FakeSlurm):
    async def jobs(self) -> dict[int, Any]:
        return {}


def test_the_poll_records_a_drain_an_admin_lifted_and_the_cluster_view_forgets_the_lemon(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        clock = [NOW]
        slurm = Slurm()
        supervisor = Supervisor(SupervisorConfig(state_dir=str(tmp_path / "state")),
                                Policy(lemon_blames=2, lemon_users=1), slurm=slurm,  # type: ignore[arg-type]
                                clock=lambda: clock[0])  # fmt: skip
        try:
            drained_twice(supervisor.store, "node3")
            slurm.nodes_by_name["node3"] = node("node3", drained=True, reason=OURS)
            await supervisor.polling.poll()
            assert supervisor.cluster.view.lemons == {"node3"}
            assert supervisor.cluster.view.lemon_blames == (("node3", 2),)
            slurm.nodes_by_name["node3"] = node("node3")  # scontrol ... state=resume
            await supervisor.polling.poll()
            assert supervisor.cluster.view.lemons == frozenset()
            assert supervisor.store.blame_history("node3")[-1].undrained_by is Actor.OUTSIDE
        finally:
            supervisor.store.close()

    asyncio.run(scenario())


def test_a_node_resurgo_itself_is_resuming_is_not_taken_for_an_outside_resume(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        slurm = Slurm()
        supervisor = Supervisor(SupervisorConfig(state_dir=str(tmp_path / "state")), Policy(),
                                slurm=slurm, clock=lambda: NOW)  # type: ignore[arg-type]  # fmt: skip
        try:
            drained_twice(supervisor.store, "node3")
            resume = ResumeNode("7", 1, "node3")
            supervisor.store.plan_action(resume.action_id, "7", KIND_OF[ResumeNode],
                                         args_of(resume), NOW)  # fmt: skip
            await (
                supervisor.polling.poll()
            )  # the fake shows node3 resumed, the executor not done yet
            assert [d.node for d in supervisor.store.open_drains()] == ["node3"]
        finally:
            supervisor.store.close()

    asyncio.run(scenario())


class CliSlurm(FakeSlurm):
    """What `resurgo nodes undrain` talks to: resume refused with ``refusal`` when set."""

    refusal = ""

    def __init__(self) -> None:
        super().__init__()
        self.nodes_by_name["node2"] = node("node2", drained=True, reason=OURS)

    async def resume(self, name: str) -> None:
        if self.refusal:
            argv = ["scontrol", "update", f"NodeName={name}", "State=RESUME"]
            raise SlurmCommandFailed(argv, 1, self.refusal)
        await super().resume(name)


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    state = tmp_path / "state"
    state.mkdir()
    with Store.open(state / "resurgo.db") as store:
        drained_twice(store, "node2", time.time())  # the CLI reads the real clock
    monkeypatch.setattr(nodes_cli, "SlurmClient", CliSlurm)
    return state


@pytest.mark.parametrize(
    ("node_name", "refusal", "status", "said"),
    [
        ("node1", "", 0, "node1 is not drained (Slurm state idle): nothing to undrain"),
        ("node2", "slurm_update error: Invalid node state specified", 0,
         "node2 is not drained: nothing to undrain"),
        ("node2", "slurm_update error: Access/permission denied", 1,
         "needs Slurm operator rights"),
        ("node2", "slurm_update error: Invalid user id", 1, "needs Slurm operator rights"),
        ("node2", "", 0, "node2 returned to service"),
    ],
)  # fmt: skip
def test_undrain_says_plainly_when_a_node_is_not_drained_or_slurm_refuses_the_user(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    node_name: str, refusal: str, status: int, said: str,
) -> None:  # fmt: skip
    monkeypatch.setattr(CliSlurm, "refusal", refusal)
    assert main(["nodes", "undrain", node_name, "--state-dir", str(state_dir)]) == status
    captured = capsys.readouterr()
    assert said in captured.out + captured.err
    assert "Traceback" not in captured.err and "Invalid" not in captured.err


def test_undrain_wrong_and_forgive_take_the_node_off_the_lemon_list(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def lemons() -> list[str]:
        assert main(["nodes", "--json", "--state-dir", str(state_dir)]) == 0
        return [x["node"] for x in json.loads(capsys.readouterr().out)["lemons"]]

    assert lemons() == ["node2"]
    assert main(["nodes", "undrain", "node2", "--wrong", "--state-dir", str(state_dir)]) == 0
    assert "2 verdicts withdrawn" in capsys.readouterr().out
    assert lemons() == []
    history = main(["nodes", "--state-dir", str(state_dir)])
    assert history == 0 and "verdict withdrawn" in capsys.readouterr().out
    assert main(["nodes", "forgive", "node2", "--state-dir", str(state_dir)]) == 0
    assert "no standing verdict" in capsys.readouterr().out


def test_a_requeue_decision_names_why_each_node_is_excluded() -> None:
    recovering = replace(
        new_record("7", 4, NOW, min_nodes=2), state=JobState.RECOVERING,
        nodes=("node1", "node2", "node3", "node4"),
        recovery=Recovery(Cause.NODE_LOST, NOW, exclude=("node1",), requeue=True, validated=True,
                          resume_from="/ckpt/step-10"),
    )  # fmt: skip
    cluster = replace(LEMONS, usable=frozenset({"node1", "node2", "node3", "node4", "node5"}),
                      drained=frozenset({"node4"}))  # fmt: skip
    made = relaunch(recovering, Context(NOW, Policy(), cluster))
    (requeue,) = made.intents
    assert isinstance(requeue, RequeueSmaller) and requeue.exclude == ("node1", "node2")
    assert made.explanation == (
        "requeue with 2 node(s) excluding node1 (blamed in this job (node_lost)), "
        "node2 (lemon: 3 blames in 7 d); left out: node4 (drained by Slurm/admin) "
        "from /ckpt/step-10"
    )


def test_resurgo_nodes_shows_slurms_state_with_its_drain_flag(tmp_path: Path) -> None:
    drained = node("node2", drained=True, reason="bad DIMM")
    with Store.open(tmp_path / "resurgo.db") as store:
        document = views.nodes(store, {"node1": node("node1"), "node2": drained}, NOW, 2, 86400)
    assert [(d["node"], d["slurm_state"]) for d in document["drained"]] == [("node2", "idle+drain")]
    row = nodes_cli.render(document, NOW).splitlines()[1]
    assert row.split()[:3] == ["node2", "idle+drain", "other"]
