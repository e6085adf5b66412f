"""The supervisor load benchmark's server under load, and waiting for it.

:class:`Supervisor` runs ``python -m supervisor.daemon`` (or, with ``floor``, the bare
aiohttp server of :func:`floor_main`) on a loopback port with the fake Slurm.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil

from agent.wire import protocol
from bench.load_cluster import REPO


def floor_main(port: int) -> int:
    """``--floor-server``: aiohttp answering every POST or frame with an empty Reply, nothing else.

    What serving HTTP or a WebSocket alone costs (aiohttp, the kernel's
    loopback TCP): the floor under the supervisor's own cost per heartbeat.
    """
    from aiohttp import web

    reply = protocol.encode_reply(protocol.Reply())

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=reply, content_type="application/json")

    async def stream(request: web.Request) -> web.WebSocketResponse:
        socket = web.WebSocketResponse(compress=False)
        await socket.prepare(request)
        async for _ in socket:
            await socket.send_bytes(reply)
        return socket

    app = web.Application()
    app.router.add_post(protocol.HEARTBEAT_PATH, answer)
    app.router.add_post(protocol.EVENTS_PATH, answer)
    app.router.add_get(protocol.HEARTBEAT_STREAM_PATH, stream)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
    return 0


class Supervisor:
    """``python -m supervisor.daemon`` in a temporary state directory, with the fake Slurm.

    With ``floor``, :func:`floor_main` instead: no supervisor, only HTTP.
    """

    def __init__(
        self, where: Path, bin_dir: Path, port: int, floor: bool = False, metrics_port: int = 0
    ) -> None:
        """``metrics_port``: ``/metrics`` on a listener of its own (``metrics_listen``), as
        an operator of thousands of agents sets it: a scrape then never waits behind the
        agents' connections for the API listener's accept queue (0: the API's listener)."""
        self.where = where
        self.url = f"http://127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}" if metrics_port else self.url
        self.log_path = where / "supervisor.log"
        env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
            "RESURGO_SUPERVISOR_STATE_DIR": str(where / "state"),
            "RESURGO_SUPERVISOR_LISTEN_HOST": "127.0.0.1",
            "RESURGO_SUPERVISOR_LISTEN_PORT": str(port),
            "RESURGO_SUPERVISOR_URL": self.url,
            "RESURGO_SUPERVISOR_LOG_JSON": "no",
        }
        if metrics_port:
            env["RESURGO_SUPERVISOR_METRICS_LISTEN"] = f"127.0.0.1:{metrics_port}"
        argv = [sys.executable, "-m", "supervisor.daemon"]
        if floor:
            argv = [sys.executable, "-m", "bench.supervisor_load", "--floor-server", str(port)]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        self.ps = psutil.Process(self.process.pid)

    @property
    def store_path(self) -> Path:
        return self.where / "state" / "resurgo.db"

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def log_counts(self) -> dict[str, int]:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return {level: text.count(f" {level} ") for level in ("WARNING", "ERROR")}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


async def wait_registered(url: str, secrets_by_job: dict[str, bytes], timeout_s: float) -> None:
    """Until every job answers ``GET /v1/jobs/<id>`` as started by Slurm (or raise)."""
    deadline = time.monotonic() + timeout_s
    waiting = dict(secrets_by_job)
    async with aiohttp.ClientSession() as session:
        while waiting:
            for job_id, secret in list(waiting.items()):
                path = f"/v1/jobs/{job_id}"
                headers = protocol.signed_headers(secret, "GET", path, job_id, int(time.time()),
                                                  b"")  # fmt: skip
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(url + path, headers=headers) as response:
                        if response.status == 200:
                            state = (await response.json())["status"]["state"]
                            if state != "submitted":
                                del waiting[job_id]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(waiting)} jobs not registered after {timeout_s} s")
            await asyncio.sleep(0.25)


async def wait_listening(url: str, timeout_s: float) -> None:
    """Until something answers HTTP at ``url`` (or raise)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url + "/"):
                    return
            await asyncio.sleep(0.25)
    raise RuntimeError(f"nothing listens at {url} after {timeout_s} s")


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
