"""The node agent, ``resurgo-agent``: one per node of a job, between torchrun and the supervisor.

It launches the ranks (:mod:`~agent.node.launch`), watches them
(:mod:`~agent.node.procs`, :mod:`~agent.node.watch`, :mod:`~agent.node.hang`,
:mod:`~agent.node.stacks`), reports to the supervisor
(:mod:`~agent.node.client`, :mod:`~agent.node.events`) and carries its
commands out (:mod:`~agent.node.commands`); :mod:`~agent.node.agent` holds the
loop. The in-rank library is elsewhere (``agent/train/``,
``agent/checkpoint/``), and so is what the agent and the supervisor share
(``agent/wire/``).

Importing this package imports nothing else: :mod:`~agent.node.rankexec` and
:mod:`~agent.node.torchrunshim` start inside every rank.
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """``resurgo-agent`` (the entry point keeps its name ``agent.node:main``)."""
    from agent.node.agent import main as run

    return run(argv)
