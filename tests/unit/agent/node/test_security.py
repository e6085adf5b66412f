"""Defences of docs/security.md that no other test file shows: the node agent's local surface.

The agent's run directory (heartbeat socket, exit records, event spool) has
a predictable default name under /tmp; a directory of that name made by
someone else is never used. A heartbeat the wire protocol cannot carry (a
user's ``beat(-1)``, or any local writer's datagram) is dropped instead of
silencing the node's heartbeat reports, which would make the supervisor
take the node for lost and drain it.
"""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path
from typing import Any

import pytest

from agent.node.agent import private_dir
from agent.node.hang import HangConfig
from agent.node.procs import RankProcess
from agent.node.watch import RankMonitor
from agent.wire import protocol
from agent.wire.datagram import (
    Phase,
    RankBeat,
    encode_beat,
    encode_step_report,
    parse_datagram,
)


async def _ignore(kind: protocol.EventKind, payload: dict[str, Any]) -> None:
    return None


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# -- the run directory ------------------------------------------------------------------------


def test_the_agents_run_directory_is_created_private(tmp_path: Path) -> None:
    run_dir = private_dir(tmp_path / "resurgo-agent-4711-node1-1")
    assert run_dir == tmp_path / "resurgo-agent-4711-node1-1"
    assert mode(run_dir) == 0o700


def test_an_own_run_directory_open_to_others_is_made_private(tmp_path: Path) -> None:
    wanted = tmp_path / "run"
    wanted.mkdir()
    wanted.chmod(0o777)
    (wanted / "spool").mkdir()
    assert private_dir(wanted) == wanted
    assert mode(wanted) == 0o700


def test_a_symlink_in_place_of_the_run_directory_is_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "someone-elses"
    elsewhere.mkdir()
    wanted = tmp_path / "resurgo-agent-4711-node1-1"
    wanted.symlink_to(elsewhere)
    run_dir = private_dir(wanted)
    assert run_dir != wanted and run_dir.parent == tmp_path
    assert not os.path.islink(run_dir) and mode(run_dir) == 0o700
    assert wanted.is_symlink() and list(elsewhere.iterdir()) == []


@pytest.mark.skipif(os.getuid() != 0, reason="making a directory another user's needs root")
def test_a_run_directory_another_user_made_first_is_not_used(tmp_path: Path) -> None:
    squatted = tmp_path / "resurgo-agent-4711-node1-1"
    squatted.mkdir(mode=0o777)
    os.chown(squatted, 65534, 65534)
    run_dir = private_dir(squatted)
    assert run_dir != squatted
    assert os.lstat(run_dir).st_uid == os.getuid() and mode(run_dir) == 0o700
    assert list(squatted.iterdir()) == []


# -- datagrams the protocol cannot carry -------------------------------------------------------


@pytest.mark.parametrize(
    "datagram",
    [
        encode_beat(rank=0, local_rank=0, pid=4242, step=-1, phase=Phase.INIT, wall_time_s=1.0),
        encode_beat(rank=0, local_rank=0, pid=-7, step=3, phase=Phase.TRAIN, wall_time_s=1.0),
        encode_beat(rank=-1, local_rank=0, pid=4242, step=3, phase=Phase.TRAIN, wall_time_s=1.0),
        encode_step_report(
            rank=0, local_rank=0, pid=0, step=3, loss=0.5, cursor=1, wall_time_s=1.0
        ),
    ],
)
def test_a_beat_the_protocol_cannot_carry_never_stops_the_nodes_heartbeat_reports(
    datagram: bytes,
) -> None:
    monitor = RankMonitor(HangConfig(), 5.0, _ignore)
    live = {0: RankProcess(0, 0, 4242)}
    assert parse_datagram(datagram) is None  # the agent's socket reader drops it
    # And should one reach the watcher another way, the watcher drops it too.
    header = struct.unpack_from("<2sBBBxiiiqd", datagram)
    rank, local_rank, pid, step = header[4:8]
    beat = RankBeat(rank, local_rank, pid, step, Phase.TRAIN, 1.0)
    monitor.on_beat(beat, 10.0)
    report = protocol.HeartbeatReport(
        "4711", "node1", 100.0, monitor.rank_statuses(live, 100.0, 10.0), "0123456789abcdef"
    )
    assert protocol.decode_heartbeat(protocol.encode_heartbeat(report)) == report
    assert monitor.progress == {}
