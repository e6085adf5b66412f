"""Exclude mode, for a supervisor without Slurm operator rights: rights detection, drain
tickets in the store, the executor's ticket (with a real hook command), the avoid list
and `resurgo submit`'s --exclude."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from aiohttp import web

from supervisor.act.executor import ALERT_KIND, Executor
from supervisor.act.ticket_hook import ticket_hook
from supervisor.api import bound_port
from supervisor.cli.submit import leave_out
from supervisor.core.intents import DrainTicket
from supervisor.core.model import Cause
from supervisor.core.policy import Policy
from supervisor.core.probation import avoid_list
from supervisor.errors import SlurmCommandFailed, SlurmUnavailable
from supervisor.jobs import JobSpec
from supervisor.registration import Health, health
from supervisor.slurm import rights
from supervisor.store import Actor, Store
from supervisor.store.rows import TicketRow
from tests.fakes.slurm import FakeSlurm

NOW = 1_700_000_000.0
JOB = "4242"
TICKET = DrainTicket(
    JOB, 2, "node3", Cause.RANK_SIGNAL, "rank 2 ended by SIGKILL at step 15", "alice"
)
CONFIG = "Configuration data as of 2026-12-03T07:00:00\nSlurmUser               = slurm(64030)\n"
DBD = CONFIG + "AccountingStorageType   = accounting_storage/slurmdbd\n"


# --- rights ---------------------------------------------------------------------


def test_slurm_user_and_admin_level_are_read_from_slurms_output():
    assert rights.slurm_user(CONFIG) == "slurm"
    assert rights.slurm_user("SlurmUser = root(0)\n") == "root"
    assert rights.slurm_user("nothing here") is None
    assert rights.has_accounting_database(DBD)
    assert not rights.has_accounting_database(
        CONFIG + "AccountingStorageType = accounting_storage/none"
    )
    assert rights.admin_level("Operator\n") == "operator"
    assert rights.admin_level("\n") == ""


@pytest.mark.parametrize(
    ("setting", "uid", "user", "level", "operator", "why"),
    [
        ("auto", 0, "root", None, True, "running as root"),
        ("auto", 1000, "slurm", None, True, "slurm is the SlurmUser"),
        ("auto", 1000, "ada", "administrator", True, "ada has AdminLevel Administrator"),
        ("auto", 1000, "ada", "operator", False, "AdminLevel Operator (draining needs Admin"),
        ("auto", 1000, "ada", "", False, "AdminLevel None"),
        ("auto", 1000, "ada", None, False, "no accounting database"),
        ("user", 0, "root", None, False, "slurm_rights = user"),
        ("operator", 1000, "ada", None, True, "slurm_rights = operator"),
    ],
)
def test_rights_are_judged_from_uid_slurm_user_and_admin_level(
    setting: str, uid: int, user: str, level: str | None, operator: bool, why: str
) -> None:
    found = rights.judge(setting, uid, user, "slurm", level)
    assert found.operator is operator
    assert why in found.why
    assert found.mode == ("drain" if operator else "exclude")
    if not operator:
        assert "drain ticket asks the admins" in found.describe()


class Asks:
    def __init__(self, config: str, level: str | Exception) -> None:
        self.config = config
        self.level = level
        self.asked: list[str] = []

    async def show_config(self) -> str:
        self.asked.append("config")
        return self.config

    async def admin_level(self, user: str) -> str:
        self.asked.append(f"level {user}")
        if isinstance(self.level, Exception):
            raise self.level
        return self.level


def test_detection_without_an_accounting_database_is_user_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rights.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(rights.getpass, "getuser", lambda: "ada")
    asks = Asks(CONFIG, AssertionError("not asked without slurmdbd"))
    found = asyncio.run(rights.detect(asks, "auto"))
    assert not found.operator and "no accounting database" in found.why
    assert asks.asked == ["config"]
    failed = SlurmCommandFailed(["sacctmgr"], 1, "sacctmgr: error: Problem talking to the database")
    for level in (failed, SlurmUnavailable("slurmdbd does not answer")):
        asks = Asks(DBD, level)
        found = asyncio.run(rights.detect(asks, "auto"))
        assert not found.operator and "no accounting database" in found.why
        assert asks.asked == ["config", "level ada"]
    assert asyncio.run(rights.detect(Asks(DBD, "Administrator\n"), "auto")).operator
    assert not asyncio.run(rights.detect(Asks(DBD, "Operator\n"), "auto")).operator


def test_detection_as_the_slurm_user_asks_no_database(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rights.os, "geteuid", lambda: 64030)
    monkeypatch.setattr(rights.getpass, "getuser", lambda: "slurm")
    asks = Asks(CONFIG, AssertionError("not asked"))
    assert asyncio.run(rights.detect(asks, "auto")).operator
    assert asks.asked == ["config"]


def test_a_slurmctld_that_does_not_answer_leaves_the_rights_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rights.os, "geteuid", lambda: 1000)

    class Down(Asks):
        async def show_config(self) -> str:
            raise SlurmUnavailable("slurmctld is down")

    with pytest.raises(SlurmUnavailable):
        asyncio.run(rights.detect(Down("", ""), "auto"))


# --- the store ------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Store:
    opened = Store.open(tmp_path / "store.db")
    opened.upsert_job(
        JOB, state="running", record={}, now_s=NOW, name="toy", original_nodes=4, min_nodes=2
    )
    return opened


def test_a_ticket_is_recorded_once_and_counts_as_a_blame_until_forgiven(store: Store) -> None:
    first = store.record_ticket(
        "node3", cause=Cause.HANG, job_id=JOB, evidence="e", now_s=NOW, action_id="a"
    )
    again = store.record_ticket(
        "node3", cause=Cause.HANG, job_id=JOB, evidence="other", now_s=NOW + 5, action_id="a"
    )
    assert again == first and len(store.all_tickets()) == 1
    assert store.open_tickets(NOW - 1) == [first]
    assert store.open_tickets(NOW + 1) == []  # raised before the window: expired
    # One ticket and one drain of the same node make a lemon at two blames.
    assert store.lemons(2, 3600, NOW + 10) == []
    store.record_drain("node3", cause=Cause.HANG, job_id=JOB, reason="r", now_s=NOW + 20)
    (lemon,) = store.lemons(2, 3600, NOW + 30)
    assert (lemon.node, lemon.drains, lemon.last_drained_s) == ("node3", 2, NOW + 20)
    assert store.withdraw_blames("node3", now_s=NOW + 40) == 2
    assert store.lemons(2, 3600, NOW + 50) == []
    (closed,) = store.all_tickets()
    assert closed.closed_s == NOW + 40 and closed.closed_by is Actor.OPERATOR
    assert store.open_tickets(0) == []


def test_the_supervisors_facts_are_kept_and_replaced(store: Store) -> None:
    assert store.fact("rights") is None
    store.set_fact("rights", {"mode": "drain"}, NOW)
    store.set_fact("rights", {"mode": "exclude"}, NOW + 1)
    assert store.fact("rights") == {"mode": "exclude", "updated_s": NOW + 1}


# --- the executor and the hook -------------------------------------------------------


def hook_command(tmp_path: Path, body: str) -> str:
    script = tmp_path / "hook.py"
    script.write_text(body)
    return f"{sys.executable} {script} {tmp_path / 'received.json'}"


def test_a_ticket_reaches_the_hook_as_json_and_the_store_and_an_alert(
    store: Store, tmp_path: Path
) -> None:
    command = hook_command(
        tmp_path,
        "import sys\nopen(sys.argv[1], 'w').write(sys.stdin.read())\n"
        "print('ticket INC-7 opened')\n",
    )
    slurm = FakeSlurm()
    executor = Executor(
        store,
        slurm,
        checkpoint_root_of=lambda job_id: None,
        clock=lambda: NOW,
        ticket_hook=ticket_hook(command),
    )
    executor.plan(JOB, [TICKET], NOW)
    asyncio.run(executor.execute(JOB, [TICKET], NOW))
    received = json.loads((tmp_path / "received.json").read_text())
    assert received == {
        "kind": "resurgo_drain_ticket",
        "node": "node3",
        "cause": "rank_signal",
        "job_id": JOB,
        "user": "alice",
        "attempt": 2,
        "evidence": TICKET.evidence,
        "ticket": TICKET.action_id,
        "asks": 'scontrol update nodename=node3 state=drain reason="..."',
    }
    (ticket,) = store.all_tickets()
    assert (ticket.node, ticket.cause, ticket.job_id) == ("node3", "rank_signal", JOB)
    assert ticket.hook == "hook ok: ticket INC-7 opened"
    (alert,) = store.events_for(JOB, kinds=[ALERT_KIND])
    assert "drain ticket for node3" in alert.payload["message"]
    assert f"job {JOB} of alice goes on without node3" in alert.payload["message"]
    assert slurm.calls == []  # nothing asked of Slurm: no drain
    # Executed again (a replayed decision), nothing runs twice.
    (tmp_path / "received.json").unlink()
    asyncio.run(executor.execute(JOB, [TICKET], NOW))
    assert not (tmp_path / "received.json").exists()
    assert len(store.all_tickets()) == 1


@pytest.mark.parametrize(
    ("body", "timeout_s", "said"),
    [
        # A limit no interpreter start on a loaded machine comes near: the exit is told.
        (
            "import sys\nsys.stdin.read()\nprint('no tracker')\nsys.exit(3)\n",
            60.0,
            "hook exited 3: no tracker",
        ),
        ("import time\ntime.sleep(30)\n", 0.5, "hook killed after 0.5 s"),
    ],
)
def test_a_failing_or_hanging_hook_never_stops_the_ticket(
    store: Store, tmp_path: Path, body: str, timeout_s: float, said: str
) -> None:
    executor = Executor(
        store,
        FakeSlurm(),
        checkpoint_root_of=lambda job_id: None,
        clock=lambda: NOW,
        ticket_hook=ticket_hook(hook_command(tmp_path, body), timeout_s=timeout_s),
    )
    executor.plan(JOB, [TICKET], NOW)
    asyncio.run(executor.execute(JOB, [TICKET], NOW))
    (ticket,) = store.all_tickets()
    assert ticket.hook == said


def test_a_hook_that_cannot_start_is_said_so(store: Store) -> None:
    hook = ticket_hook("/nonexistent/notify-admins --now")
    assert hook is not None
    assert asyncio.run(hook({"node": "node3"})).startswith("hook did not start:")
    assert ticket_hook("  ") is None


# --- the avoid list and submit ------------------------------------------------------


def test_the_avoid_list_names_ticketed_nodes_for_the_probation_and_lemons_for_their_window(
    store: Store,
) -> None:
    policy = Policy(probation_s=600.0, lemon_window_s=86400.0, lemon_blames=2)
    store.record_ticket("node3", cause="hang", job_id=JOB, evidence="e", now_s=NOW)
    store.record_drain("node2", cause="hang", job_id=JOB, reason="r", now_s=NOW)
    store.record_drain("node2", cause="hang", job_id=JOB, reason="r", now_s=NOW + 1)
    lemons = store.lemons(policy.lemon_blames, policy.lemon_window_s, NOW + 2)
    listed = avoid_list(lemons, store.open_tickets(NOW - policy.probation_s), policy)
    assert listed == [
        {
            "node": "node2",
            "why": "lemon: blamed 2 times within 1 d",
            "until_s": NOW + 1 + 86400.0,
        },
        {"node": "node3", "why": "drain ticket 1: hang in job 4242", "until_s": NOW + 600.0},
    ]


def test_a_ticketed_node_is_left_out_of_its_blaming_users_next_jobs_only(store: Store) -> None:
    """One user's word (a ticket from their job's blame) keeps a node out of their own
    next jobs; a second user's ticket adds theirs; a job of unknown user, everyone's."""
    for job_id, user in (("7", "alice"), ("8", "bob")):
        store.upsert_job(job_id, state="running", record={}, now_s=NOW, name="t",
                         original_nodes=4, min_nodes=2, slurm_user=user)  # fmt: skip
    for node, job_id in (("node3", "7"), ("node3", "8"), ("node4", "7"), ("node5", JOB)):
        store.record_ticket(node, cause="hang", job_id=job_id, evidence="e", now_s=NOW)
    policy = Policy(probation_s=600.0)
    listed = avoid_list([], store.open_tickets(NOW - policy.probation_s), policy)
    assert [(entry["node"], entry.get("users")) for entry in listed] == [
        ("node3", ["alice", "bob"]), ("node4", ["alice"]), ("node5", None),
    ]  # fmt: skip

    async def seen_by(users: list[str | None]) -> list[list[str]]:
        async def healthz(request: web.Request) -> web.Response:
            return web.json_response({"jobs_dir": None, "avoid_nodes": listed})

        app = web.Application()
        app.router.add_get("/healthz", healthz)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = bound_port(runner)
        try:
            found = [
                await asyncio.to_thread(health, f"http://127.0.0.1:{port}", 3.0, user)
                for user in users
            ]
        finally:
            await runner.cleanup()
        return [[node for node, _ in seen.avoid_nodes] for seen in found if seen is not None]

    assert asyncio.run(seen_by(["alice", "bob", "carol", None])) == [
        ["node3", "node4", "node5"], ["node3", "node5"], ["node5"], ["node3", "node4", "node5"],
    ]  # fmt: skip


def test_a_relaunch_leaves_out_the_nodes_its_own_users_jobs_ticketed_and_the_lemons() -> None:
    from supervisor.core.model import ClusterView
    from supervisor.core.probation import ticketed
    from supervisor.core.recovery import exclusions

    store_rows = [
        TicketRow(1, "node3", "hang", "7", "e", NOW, None, None, "", None, "alice"),
        TicketRow(2, "node4", "hang", "8", "e", NOW, None, None, "", None, "bob"),
        TicketRow(3, "node4", "hang", "7", "e", NOW, None, None, "", None, "alice"),
        TicketRow(4, "node5", "hang", "9", "e", NOW, None, None, "", None, None),
    ]
    view = ClusterView(lemons=frozenset({"node1"}), ticketed=ticketed(store_rows))
    assert view.ticketed == (("node3", ("alice",)), ("node4", ("alice", "bob")), ("node5", ()))
    assert view.avoided_by("alice") == {"node1", "node3", "node4", "node5"}
    assert view.avoided_by("bob") == {"node1", "node4", "node5"}
    assert view.avoided_by("carol") == {"node1", "node5"}
    assert view.avoided_by("") == {"node1", "node3", "node4", "node5"}  # unknown: all
    said = exclusions(set(), "in this job", (), view, "carol")
    assert said == "excluding node1 (lemon), node5 (drain ticket open)"


def spec(*options: str, directives: tuple[str, ...] = ()) -> JobSpec:
    return JobSpec(
        name="train",
        nodes=4,
        command=("torchrun", "train.py"),
        ckpt_root="/ckpt",
        sbatch_options=options,
        directives=directives,
    )


AVOID = Health("/jobs", "exclude", (("node3", "drain ticket 1: hang in job 7"),))


def test_submit_adds_the_avoided_nodes_to_the_users_own_exclude() -> None:
    mine, notes = leave_out(spec("-N", "4", "-x", "node[1-2]"), AVOID)
    assert mine.sbatch_options == ("-N", "4", "-x", "node[1-2]", "--exclude=node[1-3]")
    assert notes == [
        "leaving out node3 (drain ticket 1: hang in job 7); `resurgo nodes forgive node3` clears it"
    ]
    scripted, _ = leave_out(spec(directives=("--exclude=node4",)), AVOID)
    assert scripted.sbatch_options == ("--exclude=node[3-4]",)
    plain, _ = leave_out(spec(), AVOID)
    assert plain.sbatch_options == ("--exclude=node3",)


def test_submit_leaves_a_node_the_user_asks_for_or_already_excludes_alone() -> None:
    for options in (("-w", "node[1-4]"), ("--nodelist=node3",), ("--exclude=node3",)):
        same, notes = leave_out(spec(*options), AVOID)
        assert same.sbatch_options == options and notes == []
    same, notes = leave_out(spec("-N", "2"), Health("/jobs"))
    assert same.sbatch_options == ("-N", "2") and notes == []
