"""The e2e tests' jobs: the settings they run under, submitting the demo trainer, waiting, reading.

Shared by the e2e modules (and ``conftest.py``'s supervisor fixture): the
policy, daemon and agent settings that shorten the windows a test is not about
(``POLICY``, ``DAEMON``, ``AGENTS``); ``submit`` and ``finish`` for a demo
job; what the supervisor's store says about it (``drained``, ``attempts``,
``story``); the unfaulted reference run and the checks against it; and
``submit_job``, ``ended``, ``status`` and ``victim_of`` for a job of any command.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import ENDED, LiveCluster
from tests.run_once import key_of, once_per_run
from tests.supervisor_harness import TORCHRUN, TOY, SupervisorProcess

POLICY = {
    "max_drain_share_per_hour": "0.5",  # two drains per hour on 4 nodes
    "max_user_drain_share": "1",  # ... both for one user (every test job is root's)
    "backoff_base_s": "2",
    # Under CI load a killed rank's own report can trail its peers' by seconds;
    # the window closes as soon as every node's launcher has ended.
    "exit_evidence_window_s": "20",
    "hang_evidence_window_s": "8",
    "validation_level": "full",
    "straggler_min_steps": "4",  # a 16-step job: judge a straggler after 4 of its steps
    "relaunch_start_timeout_s": "60",
    # Drain on one job's word, as these tests look for; test_corroboration.py checks first.
    "corroborate_drains": "false",
}
DAEMON = {"RESURGO_SUPERVISOR_LEASE_S": "8", "RESURGO_SUPERVISOR_STRAGGLER_CHECK_S": "2"}
# Agents: quick reports, short hang floors so a hang is declared within seconds.
AGENTS = {
    "RESURGO_AGENT_HANG_FLOOR_S": "8",
    "RESURGO_AGENT_STACK_SAMPLE_S": "1",
    "RESURGO_AGENT_STACK_TIMEOUT_S": "8",
    "RESURGO_AGENT_STOP_GRACE_S": "3",
    "RESURGO_AGENT_HEARTBEAT_REPORT_S": "1",
}
STEPS = 16


@dataclass
class Run:
    job_id: int
    output: Path
    ckpt: Path
    record: Path

    def text(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def steps(self) -> dict[int, dict]:  # type: ignore[type-arg]
        """Step -> the last record of it (a replayed step's newest run)."""
        found: dict[int, dict] = {}  # type: ignore[type-arg]
        for line in (self.record / "steps.jsonl").read_text().splitlines():
            entry = json.loads(line)
            found[entry["step"]] = entry
        return found

    def final(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = torch.load(self.record / "final.pt")
        return state

    def faulted_nodes(self) -> list[str]:
        return re.findall(r"toy: injecting \w+ at step \d+ on (node\d)", self.text())


def submit(
    supervisor: SupervisorProcess,
    where: Path,
    *toy_args: str,
    nodes: int = 4,
    env: dict[str, str] | None = None,
    spares: int = 0,
    min_nodes: int = 2,
) -> Run:
    run = Run(0, where / "job.out", where / "ckpt", where / "record")
    with_spares = ["--spares", str(spares)] if spares else []
    done = supervisor.resurgo(
        "submit", "-N", str(nodes), *with_spares, "--min-nodes", str(min_nodes),
        f"--output={run.output}",
        "--ckpt-root", str(run.ckpt), "--parsable", "--",
        *TORCHRUN, str(TOY), "--steps", str(STEPS), "--save-every", "4",
        "--record", str(run.record), *toy_args, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    run.job_id = int(done.stdout.strip())
    return run


def finish(cluster: LiveCluster, supervisor: SupervisorProcess, run: Run) -> dict:  # type: ignore[type-arg]
    """Slurm's record of the demo job once it ended for good (see :func:`ended`)."""
    return ended(cluster, supervisor, run.job_id, run.output)[0]


def story(supervisor: SupervisorProcess, run: Run) -> str:
    """The job's decisions, its output's tail and its checkpoints: what a failed
    assertion should show."""
    return "\n".join([story_of(supervisor, run.job_id, run.text()), checkpoints_story(run)])


# What the job's own output says of its checkpoints: which one each attempt chose,
# and what was moved aside, quarantined, deleted or refused.
_CHECKPOINT_LINES = re.compile(
    r"resum|moved aside|quarantin|retention|leftover|passing over|checkpoint root|"
    r"attempt \d+:|starting at step|CheckpointError|CheckpointInvalid"
)


def checkpoints_story(run: Run) -> str:
    """The checkpoint root as it is now (quarantine included) and the job's output lines
    about its checkpoints: where a resume that found no checkpoint went wrong."""
    listing = []
    if run.ckpt.is_dir():
        for path in sorted(run.ckpt.rglob("*")):
            if path.is_dir() or path.parent == run.ckpt:
                listing.append(str(path.relative_to(run.ckpt)))
            elif path.name.startswith("resurgo."):
                listing.append(f"{path.relative_to(run.ckpt)} ({path.stat().st_size} bytes)")
    said = [line[:400] for line in run.text().splitlines() if _CHECKPOINT_LINES.search(line)]
    return "\n".join(
        ["--- checkpoint root now ---", *listing, "--- the job on its checkpoints ---", *said[-40:]]
    )


def story_of(supervisor: SupervisorProcess, job_id: int, text: str) -> str:
    """Job ``job_id``'s decisions, the tail of its output ``text`` and the supervisor's
    log lines that name it (the Slurm calls and their answers: what a CI log keeps)."""
    with supervisor.store() as store:
        decisions = [
            f"{d.from_state}->{d.to_state} [{d.cause}] {d.detail.get('explanation', '')}"
            for d in store.decisions_for(str(job_id))
        ]
    said = [line for line in supervisor.log().splitlines() if str(job_id) in line]
    return "\n".join(
        ["--- decisions ---", *decisions, "--- job ---", text[-3000:],
         "--- supervisor on the job ---", *said[-40:]]
    )  # fmt: skip


def supervisor_state(supervisor: SupervisorProcess, job_id: int) -> str | None:
    with supervisor.store() as store:
        row = store.get_job(str(job_id))
        return None if row is None else row.state


def drained(supervisor: SupervisorProcess, job_id: int) -> list[tuple[str, str]]:
    with supervisor.store() as store:
        return [(d.node, d.cause) for d in store.drains_since(0) if d.job_id == str(job_id)]


def attempts(supervisor: SupervisorProcess, job_id: int) -> list:  # type: ignore[type-arg]
    with supervisor.store() as store:
        return list(store.attempts_for(str(job_id)))


def unfaulted(cluster: LiveCluster, factory: pytest.TempPathFactory, nodes: int = 4) -> Run:
    """The demo job without faults on ``nodes`` nodes, made once per pytest run (every
    worker and module that asks shares it; tests only read its record)."""

    def make(where: Path) -> None:
        supervisor = SupervisorProcess(cluster, where / "state", POLICY)
        supervisor.start()
        try:
            run = submit(supervisor, where, nodes=nodes)
            job = finish(cluster, supervisor, run)
            assert job["job_state"] == "COMPLETED", story(supervisor, run)
            assert run.steps()[STEPS]["world"] == nodes
        finally:
            supervisor.stop()

    key = key_of((STEPS, nodes, sorted(POLICY.items())), files=[TOY])
    where = once_per_run(factory, f"unfaulted-{nodes}", key, make)
    return Run(0, where / "job.out", where / "ckpt", where / "record")


def assert_same_samples(run: Run, reference: Run) -> None:
    """Every step trained on exactly the reference's global samples, whatever the world size."""
    got, want = run.steps(), reference.steps()
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert sorted(got[step]["samples"]) == sorted(want[step]["samples"]), f"step {step}"


def assert_resumed_from(supervisor: SupervisorProcess, run: Run, step: int) -> None:
    last = attempts(supervisor, run.job_id)[-1]
    assert last.resumed_from == str(run.ckpt / f"step-{step}"), last


def anomaly_events(supervisor: SupervisorProcess, job_id: int) -> list[dict]:  # type: ignore[type-arg]
    with supervisor.store() as store:
        return [e.payload for e in store.events_for(str(job_id), kinds=["training_anomaly"])]


def submit_job(
    supervisor: SupervisorProcess,
    where: Path,
    command: list[str],
    sizes: tuple[str, ...] = ("-N", "4", "--min-nodes", "2"),
) -> tuple[int, Path]:
    """``resurgo submit`` of ``command`` (its own checkpoints in ``where/out``, its output
    in ``where/job.out``); (the job id, the output file)."""
    output = where / "job.out"
    done = supervisor.resurgo(
        "submit", *sizes, f"--output={output}", "--parsable",
        "--ckpt-root", str(where / "out"), "--", *command,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip()), output


def status(supervisor: SupervisorProcess, job_id: int) -> dict:  # type: ignore[type-arg]
    done = supervisor.resurgo("status", "--json", str(job_id))
    assert done.returncode == 0, done.stderr
    (job,) = json.loads(done.stdout)["jobs"]
    return job  # type: ignore[no-any-return]


def victim_of(output: Path, what: str) -> str:
    """The node named in the script's own fault line (``rank R <what> ... on nodeK``)."""
    found = re.findall(rf"rank \d+ {what} .* on (node\d) ", output.read_text(errors="replace"))
    assert found, output.read_text(errors="replace")[-3000:]
    return str(found[0])


def ended(
    cluster: LiveCluster,
    supervisor: SupervisorProcess,
    job_id: int,
    output: Path,
    timeout_s: float = 300.0,
) -> tuple[dict, str]:  # type: ignore[type-arg]
    """Slurm's record of the job once it ended for good, and its output.

    The supervisor's end comes first: while a requeue takes the job back (a killed
    rank on the batch host), Slurm may show the old run as ended for a moment, and
    status read then is not the end's. A wait that times out fails with the job's
    story and the supervisor's log.
    """
    try:
        cluster.wait_for(
            "the supervisor to record the job's end",
            lambda: supervisor_state(supervisor, job_id) in ("completed", "failed", "cancelled"),
            timeout_s=timeout_s,
        )
        # A job stopped for good is left 30 s to its driver (exit 93), then cancelled.
        job = cluster.wait_job_state(job_id, ENDED, timeout_s=120)
    except AssertionError as error:
        text = output.read_text(errors="replace") if output.exists() else ""
        raise AssertionError(
            f"{error}\n{story_of(supervisor, job_id, text)}\n--- supervisor ---\n"
            f"{supervisor.log()[-4000:]}"
        ) from None
    return job, output.read_text(errors="replace")
