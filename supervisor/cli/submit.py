"""`resurgo submit`: sbatch a training job under Resurgo's supervision.

    resurgo submit -N 4 --time=2-00:00:00 --gres=gpu:8 --ckpt-root /ckpt/llm \\
        -- torchrun --nproc-per-node=8 train.py --config big.toml
    resurgo submit --script job.sbatch --ckpt-root /ckpt/llm --dry-run -- torchrun train.py

Every option Resurgo does not know is an sbatch option and passes to sbatch
unchanged (so do the ``#SBATCH`` lines of ``--script FILE``); Resurgo adds only
``--requeue``, one agent task per node (unless you set task counts) and a
``USR1`` warning before the time limit. ``--nodes=2-4`` starts the job on 4
nodes and lets it shrink down to 2 after faults; ``--unit-nodes 2`` keeps its
size a multiple of 2 (``--unit``, the old spelling, still works). ``--spares 1`` allocates one
node more than the world and keeps it ready: after a fault it takes the
blamed node's place, so the world keeps its size (the job shrinks only when
no healthy spare is left). The job id is printed as
sbatch prints it. Before the job is released, the supervisor must have
registered it (``--register-wait-s``): one that reads its jobs from another
directory gets the job cancelled, with the directories named. If no
supervisor answers at all, the job is submitted anyway and runs unsupervised
until the supervisor registers it. The nodes the supervisor keeps out (its
lemons, and the nodes it raised a drain ticket for when it may not drain)
are added to ``--exclude``, each named on stderr, unless ``--nodelist``
asks for them.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import pwd
import shlex
import shutil
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from agent.node.launch import Shape, launch_shape, split_srun, srun_tasks_per_node
from agent.node.launch import refusal as launch_refusal
from agent.wire.errors import ConfigError
from agent.wire.settings import plain_text
from supervisor.cli.common import ENV_JOBS_DIR, add_state_dir, jobs_dir
from supervisor.config import DEFAULT_PORT
from supervisor.errors import SlurmParseError
from supervisor.jobs import JobSpec, SubmitError, batch_script, sbatch_options, submit
from supervisor.registration import Health, Registration, health, refusal, wait_registered
from supervisor.sbatch import (
    SbatchRequest,
    directives_of,
    parse_request,
    procs_per_node,
    script_commands,
    training_script,
)
from supervisor.slurm import SlurmClient
from supervisor.slurm.parse import compress_hostlist, expand_hostlist

USAGE = "resurgo submit [resurgo options] [sbatch options...] -- COMMAND..."
DESCRIPTION = plain_text(__doc__ or "")
ENV_URL = "RESURGO_URL"
ENV_CKPT_ROOT = "RESURGO_CKPT_ROOT"
# A few of the supervisor's Slurm polls (2 s by default), each with its squeue.
REGISTER_WAIT_S = 15.0


def build_parser() -> argparse.ArgumentParser:
    """Resurgo's own submit options; everything else goes to sbatch."""
    parser = argparse.ArgumentParser(
        prog="resurgo submit", usage=USAGE, description=DESCRIPTION, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument(
        "--ckpt-root",
        default=os.environ.get(ENV_CKPT_ROOT),
        help=f"where the job saves checkpoints (absolute; default ${ENV_CKPT_ROOT})",
    )
    parser.add_argument("--min-nodes", type=int, help="smallest size after faults (or -N MIN-MAX)")
    parser.add_argument(
        "--unit-nodes",
        type=int,
        default=1,
        help="the world size stays a multiple of this (default: 1)",
    )
    # The name before --unit-nodes (simulate's): scripts still use it.
    parser.add_argument(
        "--unit", dest="unit_nodes", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--spares",
        type=int,
        default=0,
        help="hot spare nodes allocated besides -N: after a fault a healthy spare takes the "
        "blamed node's place and the world keeps its size (default 0)",
    )
    parser.add_argument("--procs-per-node", type=int, help="ranks per node (default: torchrun's)")
    parser.add_argument("--script", type=Path, help="a batch script whose #SBATCH lines to use")
    parser.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    parser.add_argument("--parsable", action="store_true", help="print only the job id")
    parser.add_argument(
        "--supervisor",
        default=os.environ.get(ENV_URL, f"http://localhost:{DEFAULT_PORT}"),
        help=f"the supervisor's URL (default ${ENV_URL} or http://localhost:{DEFAULT_PORT})",
    )
    parser.add_argument(
        "--register-wait-s",
        type=_wait_seconds,
        default=REGISTER_WAIT_S,
        help=f"how long the held job waits for the supervisor to register it before it is "
        f"cancelled (default {REGISTER_WAIT_S:g})",
    )
    add_state_dir(parser)
    parser.add_argument(
        "--jobs-dir",
        help=f"the supervisor's jobs directory, shared with the compute nodes "
        f"(default ${ENV_JOBS_DIR} or STATE_DIR/jobs)",
    )
    return parser


def _wait_seconds(text: str) -> float:
    """``--register-wait-s``: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"give seconds > 0 (default {REGISTER_WAIT_S:g}), not {text!r}"
        )
    return value


def register(subparsers: Any) -> None:
    """List `submit` in `resurgo --help`; :func:`main` parses its arguments itself."""
    subparsers.add_parser(
        "submit",
        help="sbatch a training job under supervision",
        description=DESCRIPTION,
        usage=USAGE,
        add_help=False,
    )


def _fail(message: str, status: int = 1) -> int:
    print(f"resurgo submit: {message}", file=sys.stderr)
    return status


def _confirm(
    url: str, found: Health, jobs: Path, wait_s: float
) -> Callable[[str, bytes], Awaitable[str | None]]:
    """The handshake :func:`supervisor.jobs.submit` runs while the job is held."""

    async def confirm(job_id: str, secret: bytes) -> str | None:
        seen = await wait_registered(url, job_id, secret, wait_s)
        if seen is Registration.REGISTERED:
            return None
        return refusal(url, job_id, seen, jobs, found, wait_s)

    return confirm


def spec_from(args: argparse.Namespace, sbatch_args: list[str], command: list[str]) -> JobSpec:
    """The job spec from parsed options; ConfigError with what to fix."""
    directives: tuple[str, ...] = ()
    if args.script is not None:
        try:
            text = args.script.read_text()
        except OSError as error:
            raise ConfigError(f"cannot read --script {args.script}: {error.strerror}") from None
        commands = script_commands(text)
        if commands:
            raise ConfigError(
                f"--script {args.script}: only its #SBATCH lines are used, and its commands "
                f"would not run (first: {commands[0][:80]!r}); give the training command "
                "after --, or keep only #SBATCH lines in the file"
            )
        directives = directives_of(text)
    request = parse_request(sbatch_args, directives)
    if not command:
        raise ConfigError(f"no training command after --: {USAGE}")
    problem = launch_refusal(command, request.nodes)
    if problem is not None:
        raise ConfigError(problem)
    workdir = Path(request.chdir) if request.chdir else Path.cwd()
    script = training_script(command)
    if script is not None and not (workdir / script).exists():
        raise ConfigError(
            f"training script {script} not found (from {workdir}): give its path as the "
            "compute nodes see it"
        )
    for option, pattern in (("--output", request.output), ("--error", request.error)):
        folder = (workdir / pattern).parent if pattern else None
        if folder is not None and "%" not in str(folder) and not folder.is_dir():
            raise ConfigError(
                f"{option}={pattern}: the folder {folder} does not exist, and Slurm would "
                "fail the job at its start (JobLaunchFailure): create it first"
            )
    if args.unit_nodes < 1 or request.nodes % args.unit_nodes:
        raise ConfigError(
            f"--unit-nodes {args.unit_nodes} must divide the job's node count {request.nodes} (-N)"
        )
    if args.procs_per_node is not None and args.procs_per_node < 1:
        raise ConfigError(f"--procs-per-node must be 1 or more, got {args.procs_per_node}")
    if not args.ckpt_root:
        raise ConfigError(
            f"where should checkpoints go? pass --ckpt-root DIR or set {ENV_CKPT_ROOT}"
        )
    name = request.job_name or (Path(script).stem if script else Path(command[0]).name)
    return JobSpec(
        name=name,
        nodes=request.nodes,
        command=tuple(command),
        ckpt_root=os.path.abspath(args.ckpt_root),
        min_nodes=args.min_nodes if args.min_nodes is not None else request.min_nodes,
        unit=args.unit_nodes,
        spares=args.spares,
        procs_per_node=args.procs_per_node or ranks_per_node(command, request),
        supervisor_url=args.supervisor.rstrip("/"),
        sbatch_options=tuple(sbatch_args),
        directives=directives,
    )


def ranks_per_node(command: Sequence[str], request: SbatchRequest) -> int:
    """torchrun's ``--nproc-per-node``; for a per-rank command srun's task counts, else
    the job's (``--ntasks-per-node``); else 1."""
    if launch_shape(command) is Shape.PER_RANK:
        from_srun = None
        if Path(command[0]).name == "srun":
            from_srun = srun_tasks_per_node(split_srun(command)[0], request.nodes)
        return from_srun or request.tasks_per_node or 1
    return procs_per_node(command) or 1


def leave_out(spec: JobSpec, found: Health) -> tuple[JobSpec, list[str]]:
    """``spec`` with the supervisor's nodes to avoid added to ``--exclude``; what was
    added, in words (one line per node).

    The user's own ``--exclude`` (command line or ``#SBATCH``) is kept: the
    merged list goes last on the command line, which overrides both. A node
    the user names in ``--nodelist`` is theirs to use and is not excluded.
    """
    if not found.avoid_nodes:
        return spec, []
    request = parse_request(spec.sbatch_options, spec.directives)
    try:
        wanted = set(expand_hostlist(request.nodelist or ""))
        already = set(expand_hostlist(request.exclude or ""))
    except SlurmParseError:
        return spec, []  # a hostlist file or a form Slurm reads itself: leave it to Slurm
    added = [(node, why) for node, why in found.avoid_nodes if node not in wanted | already]
    if not added:
        return spec, []
    nodes = sorted(already | {node for node, _ in added})
    options = (*spec.sbatch_options, f"--exclude={compress_hostlist(nodes)}")
    notes = [
        f"leaving out {node} ({why}); `resurgo nodes forgive {node}` clears it"
        for node, why in added
    ]
    return replace(spec, sbatch_options=options), notes


def _user() -> str | None:
    """Who submits: the name Slurm records as the job's user (None: no passwd entry)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return None


def main(argv: Sequence[str]) -> int:
    """Run ``resurgo submit``; ``argv`` follows the word ``submit``."""
    words = list(argv)
    split = words.index("--") if "--" in words else len(words)
    options, command = words[:split], words[split + 1 :]
    parser = build_parser()
    if any(word in ("-h", "--help") for word in options):
        parser.print_help()
        return 0
    args, sbatch_args = parser.parse_known_args(options)
    try:
        spec = spec_from(args, sbatch_args, command)
    except ConfigError as error:
        return _fail(str(error), 2)
    if args.dry_run:
        print(batch_script(spec, jobs_dir(args.state_dir, args.jobs_dir)), end="")
        print(f"# sbatch {shlex.join(['--parsable', '--hold', *sbatch_options(spec)])} SCRIPT")
        return 0
    if shutil.which("sbatch") is None:
        return _fail("sbatch is not on PATH: run resurgo submit where Slurm's commands are")
    found = health(spec.supervisor_url, user=_user())
    supervised = found is not None
    if found is not None:
        spec, notes = leave_out(spec, found)
        for note in notes:
            print(f"resurgo submit: {note}", file=sys.stderr)
    try:
        jobs = jobs_dir(args.state_dir, args.jobs_dir)
        confirm = (
            None
            if found is None
            else _confirm(spec.supervisor_url, found, Path(jobs), args.register_wait_s)
        )
        job_id = asyncio.run(submit(spec, jobs, SlurmClient(), confirm))
    except SubmitError as error:
        return _fail(str(error))
    print(job_id if args.parsable else f"Submitted batch job {job_id}")
    if not supervised:
        print(
            f"resurgo submit: warning: the supervisor at {spec.supervisor_url} does not answer; "
            f"job {job_id} runs unsupervised until the supervisor starts and registers it "
            "(start it: systemctl start resurgo-supervisor)",
            file=sys.stderr,
        )
    return 0
