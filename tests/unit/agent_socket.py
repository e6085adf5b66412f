"""A real node agent whose heartbeat socket is one end of a socket pair: the test plays the ranks.

Shared by ``test_steps.py`` and ``test_adversarial_text.py``, which send the
agent datagrams as its ranks would and read what it buffered.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

from agent.node.agent import Clocks, NodeAgent
from agent.node.config import load_config


@contextlib.contextmanager
def agent_with_socket(tmp_path: Path) -> Iterator[tuple[NodeAgent, socket.socket]]:
    """An agent (clocks fixed) whose heartbeat socket is one end of a pair; the other end."""
    config, command = load_config(
        ["--job-id", "77", "--node", "node1", "--run-dir", str(tmp_path), "--", "true"], {}
    )
    agent = NodeAgent(config, command, clocks=Clocks(monotonic=lambda: 50.0, wall=lambda: 1.0))
    receiver, sender = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.setblocking(False)
    agent._socket = receiver
    try:
        yield agent, sender
    finally:
        receiver.close()
        sender.close()
