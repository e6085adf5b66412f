"""The ``srun`` command lines the driver runs: pure, settings and nodes in, argv out."""

from __future__ import annotations

from collections.abc import Sequence

from agent.driver.settings import DriverSettings
from agent.skips import SampleRange, format_skip_samples


def agent_argv(
    settings: DriverSettings,
    nodes: Sequence[str],
    master_addr: str,
    attempt: int,
    resume_from: str | None,
    master_port: int,
    skip_samples: Sequence[SampleRange] = (),
    aggregator_url: str = "",
    warm_pool: bool = False,
) -> list[str]:
    """``srun`` running one node agent per node of ``nodes``, each launching the command
    (``master_port``: from :func:`agent.ports.rendezvous_port`; ``skip_samples``: the
    windows of the global sample cursor the ranks leave out; ``aggregator_url``: where
    the agents send their heartbeats, when the driver aggregates them; ``warm_pool``: the
    nodes' warm pools run, the agents fork torchrun and the ranks from them).

    ``--overlap``: a step with a task on a dead node stays "completing" until Slurm
    marks that node DOWN (``SlurmdTimeout``, 300 s by default), even after the job
    was shrunk off the node, and holds its CPUs on the live nodes all that time:
    without it, the relaunch after a lost node waits for them ("Requested nodes
    are busy"). Steps of one job run one after the other here, the earlier one
    ended first, so sharing its resources in Slurm's books takes nothing from
    anyone.
    """
    return [
        *_one_task_per_node(nodes),
        settings.python, "-m", "agent.node.agent",
        "--supervisor-url", settings.supervisor_url,
        "--secret-file", str(settings.job_dir / "secret"),
        "--master-addr", master_addr,
        "--master-port", str(master_port),
        # The first node hosts the rendezvous store, wherever the address resolves; each
        # node's rank is its place in the order (torchrun's static rendezvous).
        "--master-node", nodes[0],
        "--node-order", ",".join(nodes),
        "--launch-nonce", str(attempt),
        "--attempt", str(attempt),
        "--ckpt-root", settings.ckpt_root,
        "--time-limit-file", str(settings.job_dir / "time-limit.json"),
        "--stop-grace-s", str(settings.stop_grace_s),
        "--procs-per-node", str(settings.procs_per_node),
        *(["--resume-from", resume_from] if resume_from else []),
        *(["--skip-samples", format_skip_samples(skip_samples)] if skip_samples else []),
        *(["--aggregator-url", aggregator_url] if aggregator_url else []),
        *(["--warm-pool", "true"] if warm_pool else []),
        "--", *settings.command,
    ]  # fmt: skip


def spare_check_argv(
    settings: DriverSettings, spares: Sequence[str], master_addr: str, master_port: int
) -> list[str]:
    """``srun`` running :mod:`agent.node.sparecheck` once on each idle spare of ``spares``,
    with the rendezvous address of the world it would join. ``--overlap``: the check
    holds no resources a relaunch onto the spare would wait for."""
    return [
        *_one_task_per_node(spares),
        settings.python, "-m", "agent.node.sparecheck",
        "--master-addr", master_addr,
        "--master-port", str(master_port),
        "--ckpt-root", settings.ckpt_root,
        "--", *settings.command,
    ]  # fmt: skip


def warm_pool_argv(settings: DriverSettings, nodes: Sequence[str]) -> list[str]:
    """``srun`` running :mod:`agent.node.warmpool` on every node of ``nodes`` for as long
    as the job runs (:mod:`agent.driver.warm`). ``--overlap``: the pools hold nothing a
    training step waits for; ``--no-kill``: a lost node ends its own pool, not the
    others'."""
    return [
        *_one_task_per_node(nodes, "--no-kill"),
        settings.python, "-m", "agent.node.warmpool",
        "--job-id", settings.job_id,
        "--secret-file", str(settings.job_dir / "secret"),
    ]  # fmt: skip


def _one_task_per_node(nodes: Sequence[str], *options: str) -> list[str]:
    """``srun`` with one task on each of ``nodes``, sharing their resources with the job's
    other steps (``--overlap``), each task's exit its own (``--kill-on-bad-exit=0``)."""
    count = str(len(nodes))
    return [
        "srun", f"--nodes={count}", f"--ntasks={count}", "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}", "--overlap", *options, "--kill-on-bad-exit=0",
        "--export=ALL",
    ]  # fmt: skip
