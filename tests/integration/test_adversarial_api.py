"""A stranger and a hostile job owner against a live ``resurgo-supervisor`` (docs/security.md, 7).

One real daemon (fake Slurm, a job submitted and running) for the module,
from ``tests/adversarial_world.py``; every attack goes over 127.0.0.1 with
raw sockets, in bounded loops. What the attacks cost in memory and in
``/healthz`` latency is measured by ``bench/api_abuse.py``, not here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.wire import protocol
from agent.wire.protocol import EventKind
from tests.adversarial_world import (
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    MIB,
    World,
    read_all,
    stranger_head,
    waves,
)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    built = World(tmp_path_factory.mktemp("adversarial"))
    try:
        yield built
    finally:
        built.close()


@pytest.mark.parametrize(
    "what, head, body",
    [
        ("announces 1000 bytes, sends 10", "length", b"x" * 10),
        ("announces 1000 bytes, sends none", "length", b""),
        ("a chunked body that never ends", "chunked", b"10\r\n" + b"y" * 16 + b"\r\n"),
    ],
)
def test_an_upload_that_stalls_is_answered_408_and_closed_within_the_body_timeout(
    world: World, what: str, head: str, body: bytes
) -> None:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", world.daemon.port), timeout=5) as sock:
        sock.sendall(stranger_head(world.job_id, 1000 if head == "length" else None) + body)
        answer = read_all(sock, BODY_TIMEOUT_S + 3)
    took = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), (what, answer[:200])
    assert b"body_timeout" in answer
    assert BODY_TIMEOUT_S - 0.5 <= took <= BODY_TIMEOUT_S + 2, (what, took)


def test_300_connections_trickling_their_headers_are_closed_within_the_header_timeout(
    world: World,
) -> None:
    sockets = []
    try:
        started = time.monotonic()
        for _ in range(300):
            sock = socket.create_connection(("127.0.0.1", world.daemon.port), timeout=5)
            sock.sendall(b"POST /v1/events HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            sockets.append(sock)
        open_ones = list(sockets)
        closed_after: list[float] = []
        deadline = started + HEADER_TIMEOUT_S + 20
        while open_ones and time.monotonic() < deadline:
            for sock in list(open_ones):
                try:
                    sock.sendall(b"a")  # one byte of the header, never its end
                    sock.setblocking(False)
                    try:
                        gone = sock.recv(4096) == b""
                    except BlockingIOError:
                        gone = False
                    finally:
                        sock.setblocking(True)
                except OSError:  # reset: closed by the server
                    gone = True
                if gone:
                    open_ones.remove(sock)
                    closed_after.append(time.monotonic() - started)
            time.sleep(0.5)
        assert not open_ones, f"{len(open_ones)} of 300 still open"
        # Each closed within the header timeout of its opening; the slack is for
        # opening 300 connections and for a loaded machine.
        assert max(closed_after) < HEADER_TIMEOUT_S + 10, max(closed_after)
        assert world.healthz()["status"] == "ok"
    finally:
        for sock in sockets:
            sock.close()


def test_a_trickling_chunked_body_is_closed_within_the_body_timeout(world: World) -> None:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", world.daemon.port), timeout=5) as sock:
        sock.sendall(stranger_head(world.job_id, None))
        sock.setblocking(False)
        closed = False
        # Without the timeout a trickle is held for ever; the slack is for a loaded machine.
        while time.monotonic() - started < BODY_TIMEOUT_S + 10 and not closed:
            with contextlib.suppress(BlockingIOError):
                sock.send(b"1\r\nz\r\n")  # 16 bytes a second, one byte per chunk
            with contextlib.suppress(BlockingIOError):
                data = sock.recv(65536)
                closed = data == b"" or b"408" in data
            time.sleep(1 / 16)
    assert closed
    assert time.monotonic() - started <= BODY_TIMEOUT_S + 5


def test_a_stale_or_unknown_request_is_refused_from_its_headers_before_its_body(
    world: World,
) -> None:
    for head in (
        stranger_head(world.job_id, 8 * MIB, timestamp=str(int(time.time()) - 3600)),
        stranger_head("999999", 8 * MIB),
    ):
        with socket.create_connection(("127.0.0.1", world.daemon.port), timeout=5) as sock:
            sock.sendall(head)  # and not a byte of the body
            answer = read_all(sock, 2)
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]


def test_a_client_that_hangs_up_mid_body_is_no_error_and_a_flood_grows_the_log_boundedly(
    world: World,
) -> None:
    before = world.daemon.log_path.stat().st_size
    asyncio.run(waves(world.daemon.port, world.job_id, 200, 64 * 1024, 50))
    for _ in range(500):  # refused from the headers: unknown job, bad timestamp spelling
        with socket.create_connection(("127.0.0.1", world.daemon.port), timeout=5) as sock:
            head = stranger_head("424242", 0)
            sock.sendall(head.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
            read_all(sock, 5)
    time.sleep(0.5)
    with open(world.daemon.log_path, "rb") as log:
        log.seek(before)
        grown = log.read()
    assert b"Traceback" not in grown and b" ERROR " not in grown, grown[-3000:]
    # 20 lines per cause per minute (and a summary line), whatever the flood.
    assert grown.count(b"\n") <= 80, grown.count(b"\n")
    assert len(grown) <= 40_000
    refused = world.healthz()["refused"]
    assert isinstance(refused, dict) and refused.get("client_gone", 0) >= 100


def test_a_timestamp_with_leading_zeros_is_refused_for_requests_and_stream_frames(
    world: World,
) -> None:
    body = protocol.encode_events([world.event(EventKind.AGENT_STOPPED, {"reason": "x"})])
    now = int(time.time())
    headers = protocol.signed_headers(
        world.api.secret, "POST", protocol.EVENTS_PATH, world.job_id, now, body
    )
    head = [f"POST {protocol.EVENTS_PATH} HTTP/1.1", "Host: x", f"Content-Length: {len(body)}"]
    head += [f"{k}: {'0' + v if k == protocol.HEADER_TIMESTAMP else v}" for k, v in headers.items()]
    with socket.create_connection(("127.0.0.1", world.daemon.port), timeout=5) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        answer = read_all(sock, 5)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
    frame = protocol.sign_frame(world.api.secret, world.job_id, now, b"{}")
    with pytest.raises(protocol.AuthError):
        protocol.open_frame(world.api.secret, world.job_id, b"0" + frame, now)
    assert protocol.open_frame(world.api.secret, world.job_id, frame, now) == b"{}"


def test_a_protocol_field_spelled_1_0_or_true_is_refused(world: World) -> None:
    event = world.event(EventKind.AGENT_STOPPED, {"reason": "x"})
    good = protocol.encode_events([event])
    for spelling in (b'"protocol":1.0', b'"protocol":true'):
        status, answer = world.api.post(
            protocol.EVENTS_PATH, good.replace(b'"protocol":1', spelling, 1)
        )
        assert status == 400 and b"malformed" in answer, (spelling, status, answer)


def _waiting_reader_detector(fifo: Path) -> threading.Event:
    """Set once anyone opens ``fifo`` for reading (a writer's open returns then)."""
    opened = threading.Event()

    def wait() -> None:
        with contextlib.suppress(OSError):
            fd = os.open(fifo, os.O_WRONLY)
            opened.set()
            os.close(fd)

    threading.Thread(target=wait, daemon=True).start()
    return opened


def test_checkpoint_paths_outside_the_root_are_refused_403_and_never_opened(
    world: World,
) -> None:
    secret_step = world.other / "step-5"
    secret_step.mkdir(parents=True)
    os.mkfifo(secret_step / "resurgo.manifest.json")
    opened = _waiting_reader_detector(secret_step / "resurgo.manifest.json")
    (world.ckpt_root / "step-6").symlink_to(secret_step)
    (world.ckpt_root / "step-7").mkdir()
    (world.ckpt_root / "step-7" / "resurgo.manifest.json").symlink_to(
        secret_step / "resurgo.manifest.json"
    )
    (world.ckpt_root / "nested").symlink_to(world.other)
    for step, path in (
        (5, secret_step),
        (5, f"{world.ckpt_root}/../other-user/step-5"),
        (6, world.ckpt_root / "step-6"),
        (5, world.ckpt_root / "nested" / "step-5"),
        (5, "relative/step-5"),
    ):
        status, answer = world.commit(step, path)
        assert status == 403 and b"outside_root" in answer, (path, status, answer)
        # A checkpoint the script wrote itself counts as the job's progress too.
        status, answer = world.written(step, path)
        assert status == 403 and b"outside_root" in answer, (path, status, answer)
    # Inside the root, but its manifest is a symlink out: taken, never followed.
    status, _ = world.commit(7, world.ckpt_root / "step-7")
    assert status == 200
    time.sleep(1)
    assert not opened.is_set(), "the supervisor opened a file outside the job's root"
    refused = world.healthz()["refused"]
    assert isinstance(refused, dict) and refused.get("outside_root", 0) >= 10
    # Let the detector's thread go.
    with contextlib.suppress(OSError):
        os.close(os.open(secret_step / "resurgo.manifest.json", os.O_RDONLY | os.O_NONBLOCK))


def test_metrics_listen_serves_metrics_on_its_own_listener_and_not_on_the_apis(
    tmp_path: Path,
) -> None:
    """For a local Prometheus: /metrics (job ids and states, docs/security.md) off the
    agents' listener, which then answers it 404."""
    import urllib.error
    import urllib.request

    from tests.conftest import free_port

    port = free_port()
    world = World(tmp_path, extra_env={"RESURGO_SUPERVISOR_METRICS_LISTEN": f"127.0.0.1:{port}"})
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        assert f'job_id="{world.job_id}"' in text
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{world.daemon.url}/metrics", timeout=10)
        assert refused.value.code == 404
    finally:
        world.close()
