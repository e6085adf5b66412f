"""The environment the node agent sets for the ranks it launches: the names both
ends read.

The agent writes them into every launch shape (:mod:`agent.node.launch`);
the in-rank library reads them (:mod:`agent.train`, :mod:`agent.stopfiles`).
``RANK`` and ``LOCAL_RANK`` are torchrun's, named here because a rank's
heartbeat carries them. Names only: no values are read at import.
"""

from __future__ import annotations

# Resurgo's job id and this node, for a script's own logs.
ENV_JOB_ID = "RESURGO_JOB_ID"
ENV_NODE = "RESURGO_NODE"
# The agent's Unix datagram socket, where a rank's heartbeats go (agent.wire.datagram).
ENV_AGENT_SOCKET = "RESURGO_AGENT_SOCKET"
# Where a rank notes its uncaught exception and the end of its script (agent.wire.raised).
ENV_EXIT_DIR = "RESURGO_EXIT_DIR"
ENV_RESTART_COUNT = "RESURGO_RESTART_COUNT"
# The checkpoint the supervisor chose to resume from; unset: the newest valid one.
ENV_RESUME_FROM = "RESURGO_RESUME_FROM"
ENV_CKPT_ROOT = "RESURGO_CKPT_ROOT"
ENV_CKPT_INTERVAL_S = "RESURGO_CKPT_INTERVAL_S"
# The supervisor's interval override, followed by the ranks while they run.
ENV_CKPT_INTERVAL_FILE = "RESURGO_CKPT_INTERVAL_FILE"
# The agent's request for a save now (agent.stopfiles), polled by the ranks.
ENV_SAVE_REQUEST_FILE = "RESURGO_SAVE_REQUEST_FILE"
# torchrun's, for every rank.
ENV_RANK = "RANK"
ENV_LOCAL_RANK = "LOCAL_RANK"
