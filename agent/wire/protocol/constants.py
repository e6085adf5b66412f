"""The wire protocol's fixed values: version, headers, paths, time windows, size limits, names.

Both sides read these; a change to any of them is a change to the wire format
(``docs/protocol.md``).
"""

from __future__ import annotations

import re

PROTOCOL_VERSION = 1

HEADER_JOB = "X-Resurgo-Job"
HEADER_TIMESTAMP = "X-Resurgo-Timestamp"
HEADER_SIGNATURE = "X-Resurgo-Signature"
HEADER_PROTOCOL = "X-Resurgo-Protocol"

METHOD = "POST"
EVENTS_PATH = "/v1/events"
HEARTBEAT_PATH = "/v1/heartbeat"
# GET, upgraded to a WebSocket: heartbeats without a request's cost each.
HEARTBEAT_STREAM_PATH = "/v1/heartbeat/stream"
DRIVER_PATH = "/v1/driver"
# POST: a whole job's heartbeats at once, from the job's aggregator.
JOB_HEARTBEATS_PATH = "/v1/job/heartbeats"
# GET, upgraded to a WebSocket: the aggregator's requests without a request's cost each.
JOB_HEARTBEATS_STREAM_PATH = "/v1/job/heartbeats/stream"

# Requests whose timestamp is further than this from the verifier's clock are
# refused: it bounds how long a captured request can be replayed. Events are
# idempotent by id, so a replay inside the window changes nothing.
REPLAY_WINDOW_S = 300

# The longest an agent waits between two tries to reach an unreachable
# supervisor: one that comes back hears from every agent within this much.
RETRY_MAX_S = 10.0

# Size limits. A hang event carries the stack dump of every local rank, so the
# text limit is generous; the body limit leaves room for a batch of them.
MAX_BODY_BYTES = 8 << 20
MAX_EVENT_BYTES = 4 << 20
MAX_EVENTS_PER_BATCH = 1000
MAX_RANKS = 1024
MAX_COMMANDS = 100
# Nodes one job's heartbeats may list (a job of more nodes is refused at submit
# long before this), and whole node reports one request may carry.
MAX_JOB_NODES = 8192
MAX_JOB_REPORTS = 64
MAX_TEXT_CHARS = 256 << 10
MAX_SHORT_TEXT_CHARS = 4096
MAX_ARGV_ITEMS = 1024
MAX_STEPS_PER_EVENT = 4096
# Sample windows a driver answer may tell the ranks to skip.
MAX_SKIP_RANGES = 64
# Checkpoints one answer may send to quarantine, and one request report as moved.
MAX_QUARANTINE = 64
# What a driver's report may say of one failed spare (its failing check lines).
MAX_SPARE_DETAIL_CHARS = 500
# Integers are 64-bit signed on the wire: SQLite stores them as such.
_INT_LIMIT = 1 << 63

# A job id or node name, and an agent incarnation token.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}")
_INCARNATION = re.compile(r"[0-9a-f]{8,64}")
