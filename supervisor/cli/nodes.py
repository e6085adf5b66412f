"""`resurgo nodes [--json]` and `resurgo nodes undrain NODE`: drained nodes and their history.

Lists the nodes drained in Slurm (Resurgo's drains and anyone else's) with
the reason, every node's blame history across jobs, and the lemon list
(nodes blamed too often, kept out). ``undrain`` returns a node to service
(``scontrol update state=resume``) and records it in the audit as the
operator's act. ``--json`` prints :func:`supervisor.views.nodes`.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from supervisor import views
from supervisor.cli.common import add_state_dir, duration, fail, open_store, print_json, table
from supervisor.errors import SlurmError, StoreError
from supervisor.policy import Policy
from supervisor.slurm import SlurmClient
from supervisor.store import Actor


def register(subparsers: Any) -> None:
    """Add the `nodes` subcommand."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "nodes", help="drained nodes with reasons, blame history, the lemon list; undrain"
    )
    parser.add_argument("action", nargs="?", choices=["undrain"], help="undrain NODE")
    parser.add_argument("node", nargs="?", metavar="NODE")
    parser.add_argument("--json", action="store_true", help="the documented JSON document")
    add_state_dir(parser)
    parser.set_defaults(func=run)


def render(document: dict[str, Any], now_s: float) -> str:
    """Drained nodes, then history, then lemons."""
    lines = []
    if not document["slurm_answered"]:
        lines.append("warning: Slurm did not answer; showing the supervisor's records only")
    drained = [
        [d["node"], d["slurm_state"] or "?", "resurgo" if d["by_resurgo"] else "other", d["reason"]]
        for d in document["drained"]
    ]
    lines.append(
        table(("NODE", "STATE", "BY", "REASON"), drained) if drained else "no drained nodes"
    )
    if document["history"]:
        lines.append("")
        lines.append("blame history:")
        for node, rows in sorted(document["history"].items()):
            for row in rows:
                back = "" if row["undrained_s"] is None else ", back in service"
                lines.append(
                    f"  {node}: {duration(now_s - row['drained_s'])} ago, {row['cause']} "
                    f"(job {row['job_id']}, by {row['by']}{back})"
                )
    lemons = document["lemons"]
    lines.append("")
    lines.append(
        "lemons: " + (", ".join(f"{x['node']} ({x['drains']} drains)" for x in lemons) or "none")
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Show the nodes, or undrain one."""
    if args.action == "undrain" and not args.node:
        return fail("nodes", "which node? resurgo nodes undrain NODE", 2)
    try:
        store = open_store(args.state_dir)
    except StoreError as error:
        return fail("nodes", str(error))
    slurm = SlurmClient()
    with store:
        if args.action == "undrain":
            try:
                known = asyncio.run(slurm.nodes())
                if args.node not in known:
                    return fail("nodes", f"Slurm has no node {args.node}; see sinfo")
                asyncio.run(slurm.resume(args.node))
            except SlurmError as error:
                return fail("nodes", f"could not undrain {args.node}: {error}")
            store.record_undrain(args.node, now_s=time.time(), by=Actor.OPERATOR)
            print(f"{args.node} returned to service")
            return 0
        try:
            slurm_nodes = asyncio.run(slurm.nodes())
        except SlurmError:
            slurm_nodes = None
        policy = Policy()
        now = time.time()
        document = views.nodes(store, slurm_nodes, now, policy.lemon_blames, policy.lemon_window_s)
    if args.json:
        print_json(document)
    else:
        print(render(document, now))
    return 0
