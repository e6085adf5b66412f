"""`resurgo nodes [--json]`, `resurgo nodes undrain NODE [--wrong]`, `resurgo nodes forgive NODE`.

Lists the nodes drained in Slurm (Resurgo's drains and anyone else's) with
the reason, the open drain tickets (what a supervisor without operator
rights asked the admins to drain, with the evidence), the supervisor's own
checks of nodes one job blamed (waiting, running, passed, failed), every node's blame
history across jobs, and the lemon list (nodes blamed too often, kept
out). ``undrain`` returns a node to service (``scontrol update
state=resume``) and records it in the audit as the
operator's act; with ``--wrong`` it also withdraws Resurgo's verdicts
against the node. ``forgive`` withdraws them alone (the node stays as Slurm
has it) and closes the node's drain tickets: withdrawn verdicts no longer
count towards the lemon list.
``--json`` prints :func:`supervisor.views.documents.nodes`.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import time
from typing import Any

from supervisor.cli.common import add_state_dir, duration, fail, open_store, print_json, table
from supervisor.core.policy import Policy
from supervisor.errors import SlurmCommandFailed, SlurmError, StoreError
from supervisor.slurm import Slurm, SlurmClient
from supervisor.store import Actor, Store
from supervisor.text import one_line
from supervisor.views import documents as views
from supervisor.views import words

# What scontrol prints when slurmctld refuses a caller without operator
# rights (22.05: "Invalid user id" for a uid it does not know,
# "Access/permission denied" for one it knows).
_NOT_PERMITTED = ("access/permission denied", "invalid user id", "access denied")
ACTIONS = ("undrain", "forgive")
OPERATOR_RIGHTS = (
    "Slurm refused: returning a node to service needs Slurm operator rights "
    "(root, the SlurmUser, or AdminLevel=Administrator); run it as one, or ask an admin"
)


def register(subparsers: Any) -> None:
    """Add the `nodes` subcommand."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "nodes",
        help="drained nodes with reasons, blame history, the lemon list; undrain",
        description="The nodes drained in Slurm (by Resurgo or anyone) with their reasons, "
        "open drain tickets, the supervisor's own checks of blamed nodes, every node's blame "
        "history and the lemon list. undrain NODE returns a node to service (Slurm operator "
        "rights needed); forgive NODE withdraws Resurgo's verdicts against it, so they no "
        "longer count towards the lemon list.",
    )
    parser.add_argument(
        "action",
        nargs="?",
        metavar="{undrain,forgive}",
        # Checked in run(), not by choices: `resurgo nodes node3` is a node named
        # where an action was due, and the answer should say which action fits.
        help="undrain NODE: return it to service; forgive NODE: Resurgo's verdicts were wrong",
    )
    parser.add_argument("node", nargs="?", metavar="NODE")
    parser.add_argument(
        "--wrong",
        action="store_true",
        help="with undrain: the drain was wrong; its blame stops counting towards lemon status",
    )
    parser.add_argument("--json", action="store_true", help="the documented JSON document")
    add_state_dir(parser)
    parser.set_defaults(func=run)


def render(document: dict[str, Any], now_s: float) -> str:
    """Drained nodes, open drain tickets, then history, then lemons."""
    lines = []
    if not document["slurm_answered"]:
        said = f" ({document['slurm_error']})" if document.get("slurm_error") else ""
        lines.append(f"warning: Slurm did not answer{said}; showing the supervisor's records only")
    drained = [
        [
            one_line(d["node"]),
            one_line(d["slurm_state"] or "?"),
            "resurgo" if d["by_resurgo"] else "other",
            one_line(d["reason"]),
        ]
        for d in document["drained"]
    ]
    lines.append(
        table(("NODE", "STATE", "BY", "REASON"), drained) if drained else "no drained nodes"
    )
    tickets = [
        [
            one_line(t["node"]),
            f"{duration(now_s - t['raised_s'])} ago",
            one_line(f"{t['cause']} (job {t['job_id']}{_of(t.get('user'))})"),
            one_line(t["slurm_state"] or "?"),
            one_line(t["evidence"])[:80],
            one_line(t["hook"] or "-")[:40],
        ]
        for t in document["tickets"]
    ]
    if tickets:
        lines.append("")
        lines.append("drain tickets (open; an admin should drain and check these nodes):")
        lines.append(table(("NODE", "RAISED", "CAUSE", "STATE", "EVIDENCE", "HOOK"), tickets))
    checks = [
        [
            one_line(c["node"]),
            f"{duration(now_s - c['raised_s'])} ago",
            one_line(f"{c['cause']} (job {c['job_id']}{_of(c.get('user'))})"),
            one_line(c["result"] or ("running" if c["slurm_job_id"] else "waiting")),
            one_line(c["detail"] or c["evidence"])[:80],
        ]
        for c in document.get("checks", [])
    ]
    if checks:
        lines.append("")
        lines.append("node checks (one job's blame; the supervisor's own check decides a drain):")
        lines.append(table(("NODE", "RAISED", "BLAMED FOR", "RESULT", "DETAIL"), checks))
    if document["history"]:
        lines.append("")
        lines.append("blame history:")
        for node, rows in sorted(document["history"].items()):
            for row in rows:
                back = "" if row["undrained_s"] is None else ", back in service"
                if row["undrained_by"] == Actor.OUTSIDE.value:
                    back = ", undone outside Resurgo"
                if row["withdrawn_s"] is not None:
                    back += f", verdict withdrawn {duration(now_s - row['withdrawn_s'])} ago"
                lines.append(one_line(
                    f"  {node}: {duration(now_s - row['drained_s'])} ago, {row['cause']} "
                    f"(job {row['job_id']}{_of(row.get('user'))}, by {row['by']}{back})"
                ))  # fmt: skip
    blames = [
        [
            one_line(b["node"]),
            f"{duration(now_s - b['blamed_s'])} ago",
            one_line(b["job_id"]),
            one_line(b["user"] or "?"),
            one_line(b["cause"]),
            one_line(b["outcome"]),
        ]
        for b in document.get("blames", [])
    ]
    if blames:
        lines.append("")
        lines.append("blames (who blamed which node, and what was done about it):")
        lines.append(table(("NODE", "WHEN", "JOB", "USER", "CAUSE", "OUTCOME"), blames))
    lemons = document["lemons"]
    lines.append("")
    lines.append(
        "lemons: "
        + (
            one_line(
                ", ".join(f"{x['node']} ({words.plural(x['drains'], 'drain')})" for x in lemons)
            )
            or "none"
        )
    )
    return "\n".join(lines)


def _not_an_action(word: str, node: str | None) -> str:
    """What to type instead of ``resurgo nodes WORD [NODE]``: a node named without an
    action is most likely one to return to service."""
    if node is None:
        return (
            f"{word!r} is not an action of resurgo nodes; to return {word} to service: "
            f"resurgo nodes undrain {word} (resurgo nodes forgive {word} withdraws Resurgo's "
            "verdicts on it; resurgo nodes lists every node)"
        )
    return (
        f"{word!r} is not an action: resurgo nodes undrain {node}, or resurgo nodes forgive {node}"
    )


def _of(user: str | None) -> str:
    """`` of USER`` after a job, when the store knows whose job it was."""
    return f" of {user}" if user else ""


def run(args: argparse.Namespace) -> int:
    """Show the nodes, undrain one, or forgive one."""
    if args.action is not None and args.action not in ACTIONS:
        return fail("nodes", _not_an_action(args.action, args.node), 2)
    if args.action and not args.node:
        return fail("nodes", f"which node? resurgo nodes {args.action} NODE", 2)
    if args.wrong and args.action != "undrain":
        return fail("nodes", "--wrong goes with undrain: resurgo nodes undrain NODE --wrong", 2)
    try:
        store = open_store(args.state_dir, write=args.action is not None)
    except StoreError as error:
        return fail("nodes", str(error))
    except (OSError, sqlite3.Error) as error:
        return fail("nodes", f"cannot open the store in {args.state_dir}: {error}")
    slurm = SlurmClient()
    with store:
        if args.action == "undrain":
            return undrain(store, slurm, args.node, wrong=args.wrong)
        if args.action == "forgive":
            if store.read_only:
                return fail("nodes", f"could not forgive {args.node}: {_read_only(store)}")
            withdrawn = store.withdraw_blames(args.node, now_s=time.time())
            print(
                f"{args.node}: {words.plural(withdrawn, 'verdict')} withdrawn (drain tickets "
                "closed); they no longer count towards lemon status, and your next jobs may "
                "use the node"
                if withdrawn
                else f"{args.node}: no standing verdict of Resurgo's to withdraw"
            )
            return 0
        slurm_said = ""
        try:
            slurm_nodes = asyncio.run(slurm.nodes())
        except SlurmError as error:
            slurm_nodes, slurm_said = None, one_line(str(error))[:300]
        policy = Policy()
        now = time.time()
        document = views.nodes(
            store, slurm_nodes, now, policy.lemon_blames, policy.lemon_window_s,
            policy.lemon_users,
        )  # fmt: skip
        if slurm_said:
            document["slurm_error"] = slurm_said
    if args.json:
        print_json(document)
    else:
        print(render(document, now))
    return 0


def undrain(store: Store, slurm: Slurm, node: str, *, wrong: bool) -> int:
    """Resume ``node`` in Slurm and audit it; plain words for a node not drained or a refusal."""
    try:
        known = asyncio.run(slurm.nodes())
        if node not in known:
            return fail("nodes", f"Slurm has no node {node}; see sinfo")
        if not known[node].drained:
            closed = not store.read_only and store.record_undrain(
                node, now_s=time.time(), by=Actor.OPERATOR
            )
            note = " (Resurgo's record of its drain closed)" if closed else ""
            state = known[node].state_text
            print(f"{node} is not drained (Slurm state {state}): nothing to undrain{note}")
            return _withdraw(store, node) if wrong else 0
        asyncio.run(slurm.resume(node))
    except SlurmCommandFailed as error:
        stderr = error.stderr.lower()
        if "invalid node state" in stderr:  # lifted between our sinfo and the resume
            print(f"{node} is not drained: nothing to undrain")
            return 0
        if any(text in stderr for text in _NOT_PERMITTED):
            return fail("nodes", f"could not undrain {node}: {OPERATOR_RIGHTS}")
        return fail("nodes", f"could not undrain {node}: {error}")
    except SlurmError as error:
        return fail("nodes", f"could not undrain {node}: {error}")
    if store.read_only:
        return fail(
            "nodes",
            f"{node} returned to service, but Resurgo's audit does not show it: "
            + _read_only(store),
        )
    store.record_undrain(node, now_s=time.time(), by=Actor.OPERATOR)
    print(f"{node} returned to service")
    return _withdraw(store, node) if wrong else 0


def _read_only(store: Store) -> str:
    return (
        f"this user may not write the store {store.path}; run it as the supervisor's user (or root)"
    )


def _withdraw(store: Store, node: str) -> int:
    if store.read_only:
        return fail("nodes", f"could not withdraw the verdicts on {node}: {_read_only(store)}")
    withdrawn = store.withdraw_blames(node, now_s=time.time())
    print(
        f"{node}: {words.plural(withdrawn, 'verdict')} withdrawn; they no longer count towards "
        "lemon status"
    )
    return 0
