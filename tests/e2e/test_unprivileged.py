"""A researcher's own supervisor, run as a local user with no Slurm operator rights.

The test (root) creates the user, runs the supervisor and every `resurgo`
command as it, and the user's job runs as it on the cluster's nodes. The
rank on the batch host (node1) is SIGKILLed: its node is excluded, never
drained, and the job resumes on the other three through a requeue, every
Slurm call of it made as the user; a drain ticket is raised (in `resurgo nodes`, on `/metrics`,
and to the operator hook as JSON); the user's next `resurgo submit` leaves
the node out. The same user cannot act on another user's job.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.slurm.parse import expand_hostlist
from tests.conftest import LiveCluster
from tests.e2e.jobs import (
    AGENTS,
    DAEMON,
    POLICY,
    STEPS,
    Run,
    attempts,
    finish,
    story,
)
from tests.other_users import python_for, reachable_by_others
from tests.supervisor_harness import TOY, LocalUser, SupervisorProcess

# One worker runs the whole module: its module fixture creates and removes one
# local user, which a second worker would remove under the first one's tests.
pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("local-user")]

USER = "resurgo-ada"
# What the hook writes: each ticket it received, one JSON object per line.
HOOK = """import json, sys
ticket = json.loads(sys.stdin.read())
with open(sys.argv[1], "a") as out:
    out.write(json.dumps(ticket) + "\\n")
print("mailed the admins about", ticket["node"])
"""


def _run_as(user: str, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, env=env, user=user, group=user, extra_groups=[], cwd="/",
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def local_user() -> Iterator[LocalUser]:
    """A local user created for the test, removed after it; root is needed to create it."""
    assert os.geteuid() == 0, "this test creates a local user: run it as root (CI does)"
    with contextlib.suppress(KeyError):
        pwd.getpwnam(USER)
        subprocess.run(["userdel", USER], check=False, capture_output=True)
    subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
        check=True, capture_output=True,
    )  # fmt: skip
    try:
        with reachable_by_others():
            python, path = python_for(USER)
            yield LocalUser(USER, python, path)
    finally:
        subprocess.run(["pkill", "-KILL", "-u", USER], check=False, capture_output=True)
        subprocess.run(["userdel", USER], check=False, capture_output=True)


@pytest.fixture
def home(local_user: LocalUser) -> Iterator[Path]:
    """The user's working directory: outside root's 0700 pytest directories."""
    where = Path(tempfile.mkdtemp(prefix="resurgo-user-", dir="/tmp"))
    where.chmod(0o755)
    shutil.chown(where, local_user.name, local_user.name)
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def supervisor(
    slurm_cluster: LiveCluster, local_user: LocalUser, home: Path
) -> Iterator[SupervisorProcess]:
    hook = home / "hook.py"
    hook.write_text(HOOK)
    hook.chmod(0o644)
    daemon = {
        **DAEMON,
        "RESURGO_SUPERVISOR_TICKET_HOOK": f"{local_user.python} {hook} {home / 'tickets.jsonl'}",
    }
    process = SupervisorProcess(slurm_cluster, home / "state", POLICY, AGENTS | daemon, local_user)
    process.start()
    try:
        yield process
    finally:
        process.stop()
        slurm_cluster.restore()


def submit(
    supervisor: SupervisorProcess, where: Path, *options: str, toy: tuple[str, ...] = ()
) -> tuple[Run, subprocess.CompletedProcess[str]]:
    run = Run(0, where / "job.out", where / "ckpt", where / "record")
    done = supervisor.resurgo(
        "submit", *options, f"--output={run.output}", "--ckpt-root", str(run.ckpt), "--parsable",
        "--", supervisor.python, "-m", "torch.distributed.run", "--nproc-per-node=1",
        str(TOY), "--steps", str(STEPS), "--save-every", "4", "--record", str(run.record), *toy,
    )  # fmt: skip
    return run, done


def test_a_user_without_operator_rights_gets_exclusion_a_ticket_and_a_lemon_free_next_job(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, local_user: LocalUser, home: Path
) -> None:
    said = f"no Slurm operator rights ({USER} is not root, not the SlurmUser (root)"
    slurm_cluster.wait_for("the supervisor to judge its rights", lambda: said in supervisor.log())

    run, done = submit(
        supervisor, home, "-N", "4", "--min-nodes", "2", toy=("--fault", "sigkill@6:node1")
    )
    assert done.returncode == 0, done.stderr
    run.job_id = int(done.stdout.strip())
    job = finish(slurm_cluster, supervisor, run)
    assert job["job_state"] == "COMPLETED", story(supervisor, run)
    assert job["user_name"] == USER
    (victim,) = run.faulted_nodes()

    # Excluded, relaunched on the other three, and drained nowhere.
    tries = attempts(supervisor, run.job_id)
    assert len(tries) == 2 and victim not in tries[-1].nodes and len(tries[-1].nodes) == 3, tries
    assert tries[-1].resumed_from == str(run.ckpt / "step-4"), tries
    with supervisor.store() as store:
        assert store.drains_since(0) == [], "a supervisor without operator rights drained"
        (ticket,) = store.all_tickets()
    assert (ticket.node, ticket.cause, ticket.job_id) == (victim, "rank_signal", str(run.job_id))
    nodes = slurm_cluster.nodes()
    assert not any("DRAIN" in node.get("state_flags", []) for node in nodes.values()), nodes
    assert "Invalid user id" not in supervisor.log(), "it tried to drain anyway"

    # The ticket: in `resurgo nodes`, on /metrics, and to the hook as JSON.
    shown = supervisor.resurgo("nodes")
    assert shown.returncode == 0, shown.stderr
    assert "drain tickets (open" in shown.stdout and victim in shown.stdout, shown.stdout
    assert f"mailed the admins about {victim}" in shown.stdout, shown.stdout
    with urllib.request.urlopen(f"{supervisor.url}/metrics", timeout=10) as answer:
        metrics = answer.read().decode()
    assert f'resurgo_drain_tickets_open{{node="{victim}"}} 1.0' in metrics
    assert "resurgo_may_drain 0.0" in metrics
    (received,) = [json.loads(line) for line in (home / "tickets.jsonl").read_text().splitlines()]
    assert received["node"] == victim and received["job_id"] == str(run.job_id), received
    assert received["cause"] == "rank_signal" and "SIGKILL" in received["evidence"], received
    status = supervisor.resurgo("status", str(run.job_id))
    assert "supervisor in exclude mode: no Slurm operator rights" in status.stdout, status.stdout

    # The user's next job leaves the node out.
    nxt = home / "next"
    nxt.mkdir()
    shutil.chown(nxt, USER, USER)
    _, done = submit(supervisor, nxt, "-N", "2")
    assert done.returncode == 0, done.stderr
    assert f"leaving out {victim} (drain ticket" in done.stderr, done.stderr
    later_id = int(done.stdout.strip())
    try:
        seen = slurm_cluster.job(later_id)
        assert seen is not None and victim in expand_hostlist(seen["excluded_nodes"]), seen
    finally:
        slurm_cluster.run(["scancel", str(later_id)])


def test_the_user_cannot_act_on_another_users_job(
    slurm_cluster: LiveCluster, local_user: LocalUser, home: Path
) -> None:
    """What Resurgo's Slurm adapter does to a job, run as the user on root's job, is refused,
    and the job is untouched."""
    theirs = slurm_cluster.run(
        ["sbatch", "--parsable", "--hold", "-N", "1", "-o", "/dev/null", "--wrap", "sleep 60"]
    )
    job_id = int(theirs.stdout.strip().split(";")[0])
    script = f"""
import asyncio, sys
from supervisor.errors import SlurmError
from supervisor.slurm import SlurmClient
slurm = SlurmClient()
for name, act in [
    ("requeue", lambda: slurm.requeue_smaller({job_id}, 1, 1, ("node1",))),
    ("release", lambda: slurm.release({job_id})),
    ("cancel", lambda: slurm.cancel({job_id})),
    ("drain", lambda: slurm.drain("node2", "resurgo: test")),
]:
    try:
        asyncio.run(act())
    except SlurmError as error:
        print(name, "refused:", str(error).replace("\\n", " "))
    else:
        print(name, "DONE")
"""
    try:
        done = _run_as(
            USER, [local_user.python, "-c", script],
            {**slurm_cluster.env, **local_user.env(home), "PATH": os.environ["PATH"]},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        said = dict(re.findall(r"^(\w+) (.*)$", done.stdout, re.M))
        assert set(said) == {"requeue", "release", "cancel", "drain"}, done.stdout
        assert all(what.startswith("refused:") for what in said.values()), said
        assert "Invalid user id for job" in said["requeue"], said
        assert "Invalid user id for job" in said["release"], said
        assert "Access/permission denied" in said["cancel"], said
        assert "Invalid user id" in said["drain"], said
        job = slurm_cluster.job(job_id)
        assert job is not None and job["job_state"] == "PENDING" and job["node_count"] == 1, job
    finally:
        slurm_cluster.run(["scancel", str(job_id)])
    nodes = slurm_cluster.nodes()
    assert "DRAIN" not in nodes["node2"].get("state_flags", []), nodes["node2"]
