"""A submitted job's state directory: its spec and signing secret, and how a job is submitted.

Layout under the jobs directory (the supervisor's ``jobs_dir``, by default
``<state_dir>/jobs``; it must be on a filesystem the compute nodes share,
since the job reads its secret there, while the store stays on a local disk)::

    <jobs_dir>/<slurm job id>/    0700, owned by the submitting user
        secret                    0600: the job's 256-bit signing key, hex
        spec.json                 0600: what was asked (sizes, command, checkpoints)

Submission (:func:`submit`): ``sbatch --hold`` the in-job driver, write the
directory for the id sbatch returned, then release the job; so the job never
runs before its secret exists. If writing fails the held job is cancelled:
nothing half-registered is left behind. The supervisor registers jobs by
scanning the jobs directory (:func:`read_spec`), so a job submitted while the
supervisor is down is picked up when it comes back. The supervisor checks that
the directory's owner is the Slurm job's user before it registers the job:
a user cannot register a secret for somebody else's job.
"""

from __future__ import annotations

import json
import math
import os
import pwd
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent.checkpoint.files import read_small
from agent.wire.auth import load_secret, new_secret, write_secret
from agent.wire.errors import ConfigError
from agent.wire.protocol import check_name
from supervisor.errors import SlurmError, SupervisorError
from supervisor.sbatch import parse_request, supervision_options
from supervisor.slurm import Slurm, SlurmActions

SPEC_NAME = "spec.json"
SECRET_NAME = "secret"
SPEC_VERSION = 1


class SubmitError(SupervisorError):
    """A job could not be submitted; the message says what to fix. Nothing is left running."""


@dataclass(frozen=True)
class JobSpec:
    """What the user asked for; the supervisor's record of the job starts from it.

    ``nodes`` is the size asked for, ``min_nodes`` the smallest size the job
    may shrink to, ``unit`` the multiple the parallelism needs;
    ``procs_per_node`` ranks run on each node (maps a global rank to its
    node). ``command`` runs on every node under the node agent (usually
    ``torchrun ...``). ``ckpt_root`` is where the job saves checkpoints.
    ``spares`` hot spare nodes are allocated besides ``nodes`` and run no
    ranks: after a fault one takes the blamed node's place, so the world
    keeps its size.
    """

    name: str
    nodes: int
    command: tuple[str, ...]
    ckpt_root: str
    min_nodes: int | None = None
    unit: int = 1
    procs_per_node: int = 1
    spares: int = 0
    supervisor_url: str = ""
    sbatch_options: tuple[str, ...] = ()
    directives: tuple[str, ...] = ()
    python: str = field(default_factory=lambda: sys.executable)
    user: str = ""
    submitted_s: float = 0.0

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"a job needs at least 1 node, got {self.nodes}")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nodes:
            raise ConfigError(f"--min-nodes must be 1..{self.nodes}, got {self.min_nodes}")
        if self.unit < 1 or self.nodes % self.unit:
            raise ConfigError(f"--unit {self.unit} must divide --nodes {self.nodes}")
        if self.procs_per_node < 1:
            raise ConfigError(f"procs per node must be >= 1, got {self.procs_per_node}")
        if self.spares < 0:
            raise ConfigError(f"--spares must be >= 0, got {self.spares}")
        if not self.command:
            raise ConfigError("no command to run: resurgo submit ... -- torchrun train.py")
        if not self.ckpt_root or not os.path.isabs(self.ckpt_root):
            raise ConfigError(f"the checkpoint root must be an absolute path: {self.ckpt_root!r}")

    @property
    def floor(self) -> int:
        """The smallest size the job runs at."""
        return self.nodes if self.min_nodes is None else self.min_nodes

    def to_json(self) -> str:
        """The spec document (with a version), as stored in ``spec.json``."""
        document = {"version": SPEC_VERSION, **asdict(self)}
        return json.dumps(document, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        """Read ``spec.json``; ConfigError naming the problem when it is not one.

        The file is the user's (the supervisor reads it from the user's job
        directory), so every field is checked for its type and range before
        anything is built from it.
        """
        try:
            document = json.loads(text)
            if not isinstance(document, dict) or document.pop("version", None) != SPEC_VERSION:
                raise ValueError(f"not a version {SPEC_VERSION} job spec")
            for name in document:
                if name not in _SPEC_FIELDS:
                    raise ValueError(f"unknown field {name[:64]!r}")
            for name, check in _SPEC_FIELDS.items():
                if name in document:
                    document[name] = check(name, document[name])
            return cls(**document)
        # RecursionError: JSON nested deeper than the parser's stack.
        except (ValueError, TypeError, KeyError, RecursionError) as error:
            raise ConfigError(f"job spec is malformed: {error}") from error


# Node counts and the like: far above any cluster, far below what SQLite's
# 64-bit integers or Slurm's 32-bit counts refuse.
_MAX_COUNT = 1 << 24
# What the supervisor reads of a spec.json; `resurgo submit` writes a few KiB.
MAX_SPEC_BYTES = 1 << 20


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string")
    return value


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_COUNT:
        raise ValueError(f"{name} must be an integer in 0..{_MAX_COUNT}")
    return value


def _optional_count(name: str, value: Any) -> int | None:
    return None if value is None else _count(name, value)


def _texts(name: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"{name} must be a list of strings")
    return tuple(value)


def _time(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be finite and >= 0")
    return number


_SPEC_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "name": _text,
    "nodes": _count,
    "command": _texts,
    "ckpt_root": _text,
    "min_nodes": _optional_count,
    "unit": _count,
    "procs_per_node": _count,
    "spares": _count,
    "supervisor_url": _text,
    "sbatch_options": _texts,
    "directives": _texts,
    "python": _text,
    "user": _text,
    "submitted_s": _time,
}


def job_dir(jobs_dir: Path | str, job_id: str) -> Path:
    """The job's directory in ``jobs_dir``."""
    return Path(jobs_dir) / check_name(job_id, "job_id")


def read_spec(directory: Path) -> JobSpec:
    """The spec in a job directory (ConfigError when missing, malformed, not a regular
    file, or larger than :data:`MAX_SPEC_BYTES`)."""
    path = directory / SPEC_NAME
    try:
        data = read_small(path, MAX_SPEC_BYTES)
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error}") from error
    except ValueError as error:
        raise ConfigError(f"{path} is too large: {error}") from error
    try:
        text = data.decode()
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path} is not UTF-8 text: {error}") from error
    return JobSpec.from_json(text)


def read_secret(directory: Path) -> bytes:
    """The job's signing secret (ConfigError when missing or readable by others)."""
    return load_secret(directory / SECRET_NAME)


def owner_name(directory: Path) -> str:
    """The user name owning ``directory`` (the uid as text when it has no name)."""
    uid = directory.stat().st_uid
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def write_job_dir(jobs_dir: Path | str, job_id: str, spec: JobSpec) -> Path:
    """Create ``<jobs_dir>/<id>/`` with a fresh secret and the spec; return the directory."""
    directory = job_dir(jobs_dir, job_id)
    directory.parent.mkdir(parents=True, exist_ok=True)
    directory.mkdir(mode=0o700)
    write_secret(directory / SECRET_NAME, new_secret())
    # The spec appears whole or not at all: the supervisor polls the directory
    # and sets aside a job whose spec it finds malformed.
    partial = directory / f".{SPEC_NAME}.partial"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(spec.to_json())
        handle.flush()
        os.fsync(handle.fileno())
    os.rename(partial, directory / SPEC_NAME)
    return directory


def batch_script(spec: JobSpec, jobs_dir: Path | str) -> str:
    """The batch script: the in-job driver, which runs ``spec.command`` under the agents."""
    # The user's own --signal lead times the planned stop before the time limit.
    lead = parse_request(spec.sbatch_options, spec.directives).signal_lead_s
    driver = [
        spec.python, "-m", "agent.driver",
        "--jobs-dir", str(Path(jobs_dir).resolve()),
        "--supervisor-url", spec.supervisor_url,
        "--ckpt-root", spec.ckpt_root,
        "--procs-per-node", str(spec.procs_per_node),
        *(["--world-nodes", str(spec.nodes)] if spec.spares else []),
        *(["--time-limit-lead-s", f"{lead:g}"] if lead is not None else []),
        "--", *spec.command,
    ]  # fmt: skip
    directives = "".join(f"#SBATCH {shlex.quote(option)}\n" for option in spec.directives)
    return (
        "#!/bin/bash\n"
        f"{directives}"
        "# Written by resurgo submit: the in-job driver launches one node agent per node\n"
        "# with srun; each agent runs the command below and watches its ranks. After a\n"
        "# fault the driver relaunches on the nodes the supervisor names.\n"
        f"exec {shlex.join(driver)}\n"
    )


def sbatch_options(spec: JobSpec) -> list[str]:
    """sbatch's options: the user's, verbatim, then what supervision needs (see
    :func:`supervisor.sbatch.supervision_options`); a job name when the user gave none."""
    request = parse_request(spec.sbatch_options, spec.directives)
    named = [] if request.job_name else [f"--job-name={spec.name}"]
    # A MIN-MAX range starts the job on MAX (Slurm would take MIN and Resurgo then
    # grow it back at once, a restart for nothing); MIN is only the shrink floor.
    # Spares are allocated besides the world: the count goes last, over the user's.
    ranged = request.min_nodes is not None
    asked = request.sets_nodes and not ranged and not spec.spares
    sized = [] if asked else [f"--nodes={spec.nodes + spec.spares}"]
    return [*spec.sbatch_options, *named, *sized, *supervision_options(request)]


async def submit(
    spec: JobSpec,
    jobs_dir: Path | str,
    slurm: Slurm,
    confirm: Callable[[str, bytes], Awaitable[str | None]] | None = None,
) -> str:
    """Submit ``spec`` held, write its directory, release it; return the Slurm job id.

    ``confirm(job_id, secret)``, called while the job is held, returns None
    when the supervisor registered the job, else why not (``resurgo submit``'s
    handshake, :mod:`supervisor.registration`): the job is then cancelled and
    its directory removed.

    Raises :class:`SubmitError` with what to do; a job that was submitted but
    could not be registered is cancelled.
    """
    if not spec.supervisor_url:
        raise SubmitError("no supervisor URL: pass --supervisor-url or set RESURGO_URL")
    spec = JobSpec(**{**asdict(spec), "user": spec.user or _current_user(),
                      "submitted_s": spec.submitted_s or time.time()})  # fmt: skip
    jobs = Path(jobs_dir)
    try:
        jobs.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SubmitError(f"cannot create {jobs}: {error}; check --jobs-dir") from error
    with tempfile.NamedTemporaryFile("w", dir=jobs, prefix=".batch-", suffix=".sh") as script:
        script.write(batch_script(spec, jobs_dir))
        script.flush()
        try:
            doubt = await slurm.test_only(sbatch_options(spec), script.name)
            job_id = await slurm.submit_held(sbatch_options(spec), script.name)
        except SlurmError as error:
            raise SubmitError(f"sbatch refused the job: {error}") from error
    try:
        write_job_dir(jobs_dir, str(job_id), spec)
    except OSError as error:
        await _cancel_quietly(slurm, job_id)
        raise SubmitError(
            f"job {job_id} was cancelled: its state directory could not be written ({error})"
        ) from error
    if confirm is not None:
        problem = await confirm(str(job_id), read_secret(job_dir(jobs_dir, str(job_id))))
        if problem is not None:
            await _cancel_quietly(slurm, job_id)
            shutil.rmtree(job_dir(jobs_dir, str(job_id)), ignore_errors=True)
            raise SubmitError(problem)
    try:
        await slurm.release(job_id)
    except SlurmError as error:
        raise SubmitError(
            f"job {job_id} is submitted but held: `scontrol release {job_id}` starts it ({error})"
        ) from error
    if doubt is not None:
        await _refuse_if_never_runs(slurm, job_id, doubt)
    return str(job_id)


# How long a released job whose request `sbatch --test-only` refused is watched for
# the scheduler's verdict (it looks at a released job within a second or two).
NEVER_RUNS_SETTLE_S = 15.0


async def _refuse_if_never_runs(slurm: Slurm, job_id: int, doubt: str) -> None:
    """Cancel a released job that no node can ever run, as plain sbatch would have refused it.

    A held submission is accepted whatever it asks for; ``sbatch --test-only``
    refused this one (``doubt``), which may be for now only (a drained node).
    The scheduler's pending reason decides.
    """
    try:
        reason = await slurm.never_runs(job_id, NEVER_RUNS_SETTLE_S)
    except SlurmError:
        return  # unknown is not never: the job stays, as sbatch left it
    if reason is None:
        return
    await _cancel_quietly(slurm, job_id)
    raise SubmitError(
        f"job {job_id} was cancelled: Slurm can never run it as requested (pending reason "
        f"{reason}; sbatch --test-only: {doubt}). Ask for what the partition has: "
        "`sinfo -o '%P %D %c %m %l'` lists its nodes, CPUs and memory per node, and time "
        "limit; then change -N, --ntasks-per-node, --cpus-per-task, --mem or --time"
    )


async def _cancel_quietly(slurm: SlurmActions, job_id: int) -> None:
    try:
        await slurm.cancel(job_id)
    except SlurmError as error:
        print(f"resurgo: could not cancel held job {job_id}: {error}", file=sys.stderr)


def _current_user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def spec_summary(spec: JobSpec) -> dict[str, Any]:
    """The fields ``resurgo status`` shows about a spec."""
    return {
        "name": spec.name,
        "nodes": spec.nodes,
        "min_nodes": spec.floor,
        "unit": spec.unit,
        "spares": spec.spares,
    }
