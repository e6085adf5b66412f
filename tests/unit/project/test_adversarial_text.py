"""A job owner's text in the supervisor's logs, decoders, Slurm reasons and store (issue 19).

The pure halves of what ``tests/integration/test_adversarial_text.py`` runs
against a live supervisor: escaping, the text log formatter, strict decoding
of lone surrogates and non-finite save statistics, drain reasons, the store's
file modes and its read-only open.
"""

from __future__ import annotations

import asyncio
import grp
import io
import json
import logging
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.checkpoint import format as fmt
from agent.node.agent import NodeAgent
from agent.wire import protocol
from agent.wire.datagram import Phase, encode_checkpoint
from agent.wire.errors import CheckpointInvalid, ConfigError
from agent.wire.protocol import EventKind, ProtocolError
from supervisor.core.intents import MAX_DRAIN_DETAIL_CHARS, DrainNode
from supervisor.core.model import Cause
from supervisor.errors import StoreMissing
from supervisor.logs import JsonFormatter, TextFormatter
from supervisor.store import Store
from supervisor.store.modes import make_private
from supervisor.text import fragment, one_line
from tests.unit.agent_socket import agent_with_socket

FORGED = "resurgo-supervisor 2026-01-01 00:00:00,000 ERROR ALERT node7 is on fire"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("plain text, é and 漢字", "plain text, é and 漢字"),
        ("a\nb", "a\\nb"),
        ("a\r\nb\tc", "a\\r\\nb\\tc"),
        ("nul\x00here", "nul\\x00here"),
        ("\x1b[31mred", "\\x1b[31mred"),
        ("lone \ud800", "lone \\ud800"),
        ("right-to-left \u202e override", "right-to-left \\u202e override"),
        ("line\u2028separator", "line\\u2028separator"),
        ("C:\\new", "C:\\\\new"),
    ],
)
def test_one_line_shows_every_unprintable_character_as_a_visible_escape(
    text: str, shown: str
) -> None:
    assert one_line(text) == shown
    assert one_line(text).isprintable()


def test_a_fragment_is_printable_ascii_and_bounded() -> None:
    text = f"stuck\n{FORGED}\x00 漢字 \ud800" * 20
    cut = fragment(text, 80)
    assert len(cut) == 80 and cut.endswith("...")
    assert cut.isascii() and cut.isprintable()
    assert fragment("short", 80) == "short"


def _record(message: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("supervisor.intake", logging.WARNING, __file__, 1, message, args,
                             exc_info)  # fmt: skip


def test_a_text_log_record_with_a_forged_line_and_a_nul_stays_one_line() -> None:
    formatter = TextFormatter("resurgo-supervisor %(asctime)s %(levelname)s %(message)s")
    line = formatter.format(
        _record("job %s: no save statistics from %s", "42", f"/ckpt/step-7\n{FORGED}\x00")
    )
    assert "\n" not in line and "\x00" not in line
    assert line.endswith(f"/ckpt/step-7\\n{FORGED}\\x00")


def test_a_traceback_follows_its_record_indented_so_no_line_at_the_margin_is_forged() -> None:
    try:
        raise ValueError(f"bad path /ckpt\n{FORGED}")
    except ValueError as error:
        caught = error
    text = TextFormatter("resurgo-supervisor %(levelname)s %(message)s").format(
        _record("tick failed", exc=caught)
    )
    first, *rest = text.split("\n")
    assert first == "resurgo-supervisor WARNING tick failed"
    assert rest and all(line.startswith("    ") for line in rest)
    assert not any(line.startswith(FORGED) for line in text.split("\n"))


def test_a_json_log_record_stays_one_valid_json_line() -> None:
    text = f"/ckpt/step-7\n{FORGED}\x00\ud800"
    line = JsonFormatter().format(_record("job %s: no save statistics from %s", "42", text))
    assert "\n" not in line and "\x00" not in line
    assert json.loads(line)["message"] == f"job 42: no save statistics from {text}"


def test_the_cli_log_handler_writes_escaped_lines() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(TextFormatter("resurgo: %(levelname)s: %(message)s"))
    handler.emit(_record("%s", f"x\n{FORGED}"))
    assert stream.getvalue() == f"resurgo: WARNING: x\\n{FORGED}\n"


def _hang_event_body(reason: str) -> bytes:
    event = protocol.make_event(
        EventKind.HANG, "42", "node1", "0001000100000001", 1, 1_700_000_000.0,
        {
            "hung": [{"global_rank": 0, "local_rank": 0, "pid": 10, "last_step": 5,
                      "phase": "train", "seconds_since_progress": 61.0, "timeout_s": 60.0,
                      "detector": "heartbeat"}],
            "stacks": {},
            "culprits": [{"global_rank": 0, "last_step": 5, "in_collective": False,
                          "reason": reason}],
        },
    )  # fmt: skip
    return protocol.encode_events([event])


@pytest.mark.parametrize("escape", [b"\\ud800", b"\\udfff", b"\\ude00x", b"\\ud83d\\u0041"])
def test_a_lone_surrogate_in_an_event_is_refused_naming_where(escape: bytes) -> None:
    body = _hang_event_body("PLACEHOLDER").replace(b"PLACEHOLDER", escape)
    with pytest.raises(ProtocolError, match=r"culprits\[0\]\.reason holds a lone surrogate"):
        protocol.decode_events(body)


def test_a_surrogate_pair_is_one_character_and_accepted() -> None:
    body = _hang_event_body("PLACEHOLDER").replace(b"PLACEHOLDER", b"\\ud83d\\ude00")
    (event,) = protocol.decode_events(body)
    assert event.payload["culprits"][0]["reason"] == "\U0001f600"


def test_a_lone_surrogate_in_a_heartbeat_is_refused_not_an_encoding_error() -> None:
    report = protocol.HeartbeatReport(
        "42", "node1", 1_700_000_000.0,
        (protocol.RankStatus(0, 0, 10, 5, "PLACEHOLDER", 1_700_000_000.0, 0.3, 0.3, 0.3, 10),),
        "0001000100000001", 1,
    )  # fmt: skip
    body = protocol.encode_heartbeat(report).replace(b"PLACEHOLDER", b"\\ud800")
    with pytest.raises(ProtocolError, match="lone surrogate"):
        protocol.decode_heartbeat(body)


def _manifest(stats: str) -> bytes:
    manifest = fmt.Manifest(
        step=7, world_size=2, contents=(), files=(), created_unix_s=1.0,
        stats=fmt.SaveStats(stall_s=1.5, write_s=3.0, total_bytes=10, filesystem="ext4",
                            mode="async"),
    )  # fmt: skip
    document = json.loads(fmt.manifest_to_bytes(manifest))
    text = json.dumps(document).replace('"stall_s": 1.5', f'"stall_s": {stats}')
    assert text != json.dumps(document)
    return text.encode()


def test_finite_save_statistics_are_read() -> None:
    stats = fmt.manifest_from_bytes(_manifest("2.5")).stats
    assert stats is not None and stats.stall_s == 2.5


@pytest.mark.parametrize("stats", ['"nan"', '"inf"', '"-inf"', "NaN", "Infinity", "1e999", "-1",
                                   '"1.5"', "true"])  # fmt: skip
def test_a_save_statistic_that_is_not_a_finite_number_makes_the_manifest_malformed(
    stats: str,
) -> None:
    with pytest.raises(CheckpointInvalid, match=r"stats\.stall_s must be a finite number >= 0"):
        fmt.manifest_from_bytes(_manifest(stats))


def test_a_drain_reason_is_the_supervisors_words_then_the_evidence_as_one_bounded_line() -> None:
    evidence = f"node2 rank 3: stuck\n{FORGED}\x00 " + "x" * 500
    reason = DrainNode("42", 1, "node2", Cause.HANG, evidence).slurm_reason
    assert reason.startswith("resurgo: hang job=42 node2 rank 3: stuck\\n")
    assert reason.isascii() and reason.isprintable()
    assert len(reason) <= len("resurgo: hang job=42 ") + MAX_DRAIN_DETAIL_CHARS


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022() -> Iterator[None]:
    previous = os.umask(0o022)
    yield
    os.umask(previous)


@pytest.mark.usefixtures("umask_022")
def test_the_state_directory_and_store_files_are_private_whatever_the_umask(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    with Store.open(state / "resurgo.db"):
        assert _mode(state / "resurgo.db") == 0o644  # what SQLite makes under umask 022
        make_private(state, state / "resurgo.db")
        assert _mode(state) == 0o700
        for name in ("resurgo.db", "resurgo.db-wal", "resurgo.db-shm"):
            assert _mode(state / name) == 0o600, name


@pytest.mark.usefixtures("umask_022")
def test_with_an_operators_group_the_store_is_group_readable_and_new_files_inherit_it(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    group = os.getgid()  # a group this test may always set: its own
    name = grp.getgrgid(group).gr_name
    make_private(state, state / "resurgo.db", group=name, others_search=True)
    assert _mode(state) == 0o2751  # setgid: later files get the group; others may only pass
    with Store.open(state / "resurgo.db"):
        make_private(state, state / "resurgo.db", group=name, others_search=True)
        for file in ("resurgo.db", "resurgo.db-wal", "resurgo.db-shm"):
            assert _mode(state / file) == 0o640, file
            assert (state / file).stat().st_gid == group, file


def test_an_unknown_operators_group_is_a_config_error_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="state_group: no group 'no-such-group-19'"):
        make_private(tmp_path, tmp_path / "resurgo.db", group="no-such-group-19")


def test_a_store_opened_read_only_closes_without_writing_its_leases(tmp_path: Path) -> None:
    path = tmp_path / "resurgo.db"
    with Store.open(path) as store:
        store.upsert_job("42", state="running", record={}, now_s=100.0, name="t",
                         original_nodes=2, min_nodes=1)  # fmt: skip
        store.touch_lease("42", "node1", "0001000100000001", 100.0)
    reader = Store.open(path, read_only=True)
    assert reader.read_only
    reader.touch_lease("42", "node1", "0001000100000001", 200.0)
    reader.close()  # a read-only connection: a flush here would raise
    with Store.open(path, read_only=True) as again:
        assert [lease.last_seen_s for lease in again.leases_for("42")] == [100.0]


def test_a_read_only_open_refuses_a_missing_store_and_writes_never_reach_the_file(
    tmp_path: Path,
) -> None:
    with pytest.raises(StoreMissing):
        Store.open(tmp_path / "resurgo.db", read_only=True)
    Store.open(tmp_path / "resurgo.db").close()
    with (
        Store.open(tmp_path / "resurgo.db", read_only=True) as reader,
        pytest.raises(sqlite3.OperationalError, match="readonly"),
    ):
        reader.upsert_job("42", state="running", record={}, now_s=1.0, name="t",
                          original_nodes=2, min_nodes=1)  # fmt: skip


def test_a_checkpoint_path_that_is_not_utf8_is_logged_by_the_agent_not_sent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The supervisor refuses a lone surrogate, so the agent never builds such an event."""
    emitted: list[str] = []

    async def emit(kind: protocol.EventKind, payload: dict[str, Any]) -> None:
        emitted.append(payload["path"])

    async def drain(agent: NodeAgent) -> None:
        agent._drain_socket()
        await asyncio.sleep(0)  # the emit tasks run

    with agent_with_socket(tmp_path) as (agent, sender):
        agent.events.emit = emit  # type: ignore[method-assign]
        for path in (os.fsdecode(b"/ckpt/step-8\xff"), "/ckpt/step-9"):
            note = encode_checkpoint(rank=0, local_rank=0, pid=9, step=9, path=path,
                                     phase=Phase.CHECKPOINT, wall_time_s=0.0)  # fmt: skip
            sender.send(note)
        asyncio.run(drain(agent))
    assert emitted == ["/ckpt/step-9"]
    assert "checkpoint path '/ckpt/step-8\\udcff' is not UTF-8" in caplog.text
