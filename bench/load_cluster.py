"""The supervisor load benchmark's fake cluster: jobs, Slurm's JSON, job directories.

Jobs of :data:`JOB_SIZES` nodes, one :class:`AgentPlan` per node; ``squeue``/``sinfo``
executables printing Slurm 22.05 JSON built from ``tests/fixtures/slurm/``; each job's
directory as ``resurgo submit`` writes it; checkpoint manifests the supervisor reads.
"""

from __future__ import annotations

import copy
import getpass
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from agent.checkpoint import format as fmt
from agent.wire.auth import load_secret
from supervisor.jobs import SECRET_NAME, JobSpec, write_job_dir
from supervisor.slurm.parse import compress_hostlist

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "slurm"
JOB_SIZES = (8, 16, 32, 64)


@dataclass(frozen=True)
class AgentPlan:
    """One simulated node agent: its job, node and ranks, and its job's training pace."""

    job_id: str
    node: str
    node_rank: int
    nnodes: int
    ranks_per_node: int
    secret_hex: str
    job_start_s: float
    step_time_s: float
    ckpt_root: str


def plan_jobs(agents: int, rng: random.Random) -> list[list[str]]:
    """Node names of each job: sizes drawn from :data:`JOB_SIZES`, ``agents`` nodes in all."""
    jobs: list[list[str]] = []
    index = 0
    while index < agents:
        size = min(rng.choice(JOB_SIZES), agents - index)
        jobs.append([f"n{number:05d}" for number in range(index, index + size)])
        index += size
    return jobs


# Jobs of an aggregated run, largest first: (nodes, how many); the rest of 8 nodes.
AGGREGATED_JOBS = ((2048, 2), (1024, 2), (512, 4), (256, 8), (128, 8), (64, 16), (32, 16),
                   (16, 32))  # fmt: skip


def plan_aggregated_jobs(agents: int) -> list[list[str]]:
    """Node names of each job of an aggregated run: :data:`AGGREGATED_JOBS` while they
    fit, then jobs of 8 nodes (16,384 nodes: 472 jobs of 8 to 2,048)."""
    sizes = []
    left = agents
    for size, count in AGGREGATED_JOBS:
        for _ in range(count):
            if size <= left:
                sizes.append(size)
                left -= size
    while left:
        sizes.append(min(8, left))
        left -= sizes[-1]
    jobs, index = [], 0
    for size in sizes:
        jobs.append([f"n{number:05d}" for number in range(index, index + size)])
        index += size
    return jobs


def squeue_json(jobs: dict[str, list[str]], user: str, now: int) -> str:
    """``squeue --json`` listing every job RUNNING, each record shaped like Slurm 22.05's."""
    fixture = json.loads((FIXTURES / "squeue_mixed.json").read_text())
    template = next(job for job in fixture["jobs"] if job["job_state"] == "RUNNING")
    records = []
    for job_id, nodes in jobs.items():
        record = copy.deepcopy(template)
        node_list = compress_hostlist(nodes)
        record.update(
            job_id=int(job_id), name=f"load-{job_id}", job_state="RUNNING", state_reason="None",
            nodes=node_list, node_count=len(nodes), batch_host=nodes[0], user_name=user,
            restart_cnt=0, start_time=now, submit_time=now, end_time=0,
            job_resources={"nodes": node_list, "allocated_hosts": len(nodes)},
        )  # fmt: skip
        records.append(record)
    return json.dumps({"meta": fixture["meta"], "errors": [], "jobs": records})


def sinfo_json(jobs: dict[str, list[str]]) -> str:
    """``sinfo --json`` with every node allocated and healthy (Slurm 22.05's records)."""
    fixture = json.loads((FIXTURES / "sinfo_drained.json").read_text())
    template = fixture["nodes"][0]
    records = []
    for nodes in jobs.values():
        for node in nodes:
            record = copy.deepcopy(template)
            record.update(name=node, hostname=node, state="allocated", state_flags=[], reason="",
                          reason_set_by_user=None, reason_changed_at=0)  # fmt: skip
            records.append(record)
    return json.dumps({"meta": fixture["meta"], "errors": [], "nodes": records})


def install_fake_slurm(where: Path, jobs: dict[str, list[str]], user: str) -> Path:
    """Executables ``squeue``/``sinfo`` (print the JSON) and no-op admin commands; the bin dir."""
    bin_dir = where / "bin"
    bin_dir.mkdir()
    now = int(time.time())
    for name, text in (("squeue", squeue_json(jobs, user, now)), ("sinfo", sinfo_json(jobs))):
        data = where / f"{name}.json"
        data.write_text(text)
        _executable(bin_dir / name, f"#!/bin/sh\nexec cat {data}\n")
    for name in ("scontrol", "sbatch", "scancel"):
        _executable(bin_dir / name, "#!/bin/sh\nexit 0\n")
    return bin_dir


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def write_jobs(
    jobs_dir: Path, jobs: dict[str, list[str]], ranks_per_node: int, url: str, where: Path,
    rng: random.Random,
) -> list[AgentPlan]:  # fmt: skip
    """Each job's directory as ``resurgo submit`` writes it; one :class:`AgentPlan` per node."""
    user = getpass.getuser()
    now = time.time()
    plans = []
    for job_id, nodes in jobs.items():
        ckpt_root = where / "ckpt" / job_id
        spec = JobSpec(
            name=f"load-{job_id}", nodes=len(nodes), command=("python", "train.py"),
            ckpt_root=str(ckpt_root), procs_per_node=ranks_per_node, supervisor_url=url,
            user=user, submitted_s=now,
        )  # fmt: skip
        directory = write_job_dir(jobs_dir, job_id, spec)
        secret = load_secret(directory / SECRET_NAME).hex()
        step_time_s = rng.uniform(0.5, 2.0)
        start = now - rng.uniform(0, 600)  # jobs have been training for a while
        for node_rank, node in enumerate(nodes):
            plans.append(AgentPlan(job_id, node, node_rank, len(nodes), ranks_per_node, secret,
                                   start, step_time_s, str(ckpt_root)))  # fmt: skip
    return plans


def write_manifest(root: Path, step: int, world_size: int) -> Path:
    """A checkpoint directory holding only its manifest (the supervisor reads its save stats).

    The bytes are :func:`~agent.checkpoint.format.manifest_to_bytes`'s, from a
    template encoded once per world size (512 file entries took the generator
    6 ms to encode, each checkpoint event: 0.5 ms now, with the write); the
    first of each size is compared with the encoder's output, byte for byte.
    """
    directory = root / fmt.step_dir_name(step)
    directory.mkdir(parents=True, exist_ok=True)
    created = time.time()
    template = _MANIFEST_TEMPLATES.get(world_size)
    if template is None:
        template = _MANIFEST_TEMPLATES[world_size] = fmt.manifest_to_bytes(
            _manifest(_STEP_MARK, world_size, _TIME_MARK)
        )
    data = template.replace(b"%d" % _STEP_MARK, b"%d" % step, 1).replace(
        repr(_TIME_MARK).encode(), repr(created).encode(), 1
    )
    if world_size not in _MANIFEST_CHECKED:
        assert data == fmt.manifest_to_bytes(_manifest(step, world_size, created))
        _MANIFEST_CHECKED.add(world_size)
    (directory / fmt.MANIFEST_NAME).write_bytes(data)
    return directory


def _manifest(step: int, world_size: int, created_unix_s: float) -> fmt.Manifest:
    files = tuple(
        fmt.FileEntry(f"__{rank}_0.distcp", 1 << 30, "0" * 32) for rank in range(world_size)
    )
    return fmt.Manifest(
        step=step, world_size=world_size, contents=(fmt.StateKind.MODEL, fmt.StateKind.OPTIMIZER),
        files=files, created_unix_s=created_unix_s,
        stats=fmt.SaveStats(stall_s=2.5, write_s=40.0, total_bytes=world_size << 30,
                            filesystem="lustre", mode="async"),
    )  # fmt: skip


# Marks no real step or time equals, replaced in a manifest template's bytes.
_STEP_MARK = 987_654_321_987
_TIME_MARK = 1234567.890625
_MANIFEST_TEMPLATES: dict[int, bytes] = {}
_MANIFEST_CHECKED: set[int] = set()
