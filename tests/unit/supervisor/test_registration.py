"""`resurgo submit`'s handshake: the held job is released only once the supervisor registered it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web

from agent.wire.auth import new_secret
from supervisor.api import MemoryDirectory, bound_port, build_app, serve, shutdown
from supervisor.jobs import SubmitError, submit
from supervisor.registration import Health, Registration, health, refusal, verdict, wait_registered
from supervisor.slurm import SlurmClient
from tests.fakes.slurm_runner import Recorder
from tests.unit.job_specs import spec

JOB = "4711"
SECRET = new_secret()
URL = "http://head:8740"


@pytest.mark.parametrize(
    ("status", "body", "seen"),
    [
        (200, b"{}", Registration.REGISTERED),
        (401, b'{"error": "unknown_job", "reason": "..."}', Registration.UNKNOWN),
        (401, b'{"error": "bad_signature", "reason": "..."}', Registration.OTHER_SECRET),
        (401, b'{"error": "stale_timestamp"}', Registration.NO_ANSWER),
        (502, b"<html>proxy</html>", Registration.NO_ANSWER),
        (401, b"[1]", Registration.NO_ANSWER),
    ],
)
def test_each_answer_to_the_signed_status_request_is_one_registration(
    status: int, body: bytes, seen: Registration
) -> None:
    assert verdict(status, body) is seen


def test_a_supervisor_watching_another_directory_is_named_with_the_fix(tmp_path: Path) -> None:
    message = refusal(URL, JOB, Registration.UNKNOWN, tmp_path / "mine", Health("/srv/jobs"), 15)
    assert f"job {JOB} was cancelled" in message
    assert "did not register it within 15 s" in message
    assert "registers jobs from /srv/jobs" in message and str(tmp_path / "mine") in message
    assert "--jobs-dir" in message and "RESURGO_STATE_DIR" in message


def test_the_same_directory_not_registered_in_time_points_at_the_supervisors_log(
    tmp_path: Path,
) -> None:
    message = refusal(URL, JOB, Registration.UNKNOWN, tmp_path, Health(str(tmp_path)), 15)
    assert f"'job {JOB} not registered'" in message and "--register-wait-s" in message
    assert "--jobs-dir" not in message


def test_a_job_known_with_another_secret_and_a_silent_supervisor_say_so(tmp_path: Path) -> None:
    other = refusal(URL, JOB, Registration.OTHER_SECRET, tmp_path, Health(None), 15)
    assert "another secret" in other and "--jobs-dir" in other
    silent = refusal(URL, JOB, Registration.NO_ANSWER, tmp_path, Health(None), 15)
    assert "stopped answering" in silent


async def _serving(
    directory: MemoryDirectory, jobs_dir: str | None = None
) -> tuple[str, web.AppRunner]:
    runner = await serve(build_app(directory, jobs_dir=jobs_dir), "127.0.0.1", 0)
    return f"http://127.0.0.1:{bound_port(runner)}", runner


def test_the_wait_ends_as_soon_as_the_supervisor_registered_the_job() -> None:
    async def scenario() -> tuple[Registration, Registration, Registration]:
        directory = MemoryDirectory()
        url, runner = await _serving(directory)
        try:
            asyncio.get_running_loop().call_later(0.7, directory.add_job, JOB, SECRET, ("n1",))
            registered = await wait_registered(url, JOB, SECRET, 10)
            unknown = await wait_registered(url, "4712", SECRET, 0.6)
            other = await wait_registered(url, JOB, new_secret(), 10)
        finally:
            await shutdown(runner)
        return registered, unknown, other

    registered, unknown, other = asyncio.run(scenario())
    assert registered is Registration.REGISTERED
    assert unknown is Registration.UNKNOWN
    assert other is Registration.OTHER_SECRET


def test_healthz_names_the_jobs_directory_and_no_job() -> None:
    async def scenario() -> Health | None:
        directory = MemoryDirectory()
        directory.add_job(JOB, SECRET, ("n1",))
        url, runner = await _serving(directory, "/srv/resurgo/jobs")
        try:
            return await asyncio.to_thread(health, url)
        finally:
            await shutdown(runner)

    assert asyncio.run(scenario()) == Health("/srv/resurgo/jobs")
    assert health("http://127.0.0.1:1") is None


def test_a_job_the_supervisor_did_not_register_is_cancelled_and_its_directory_removed(
    tmp_path: Path,
) -> None:
    runner = Recorder()
    asked: list[tuple[str, bytes]] = []

    async def refuse(job_id: str, secret: bytes) -> str | None:
        asked.append((job_id, secret))
        return "not registered: fix this"

    with pytest.raises(SubmitError, match="not registered: fix this"):
        asyncio.run(submit(spec(), tmp_path, SlurmClient(runner=runner), refuse))
    assert asked and asked[0][0] == "4711" and len(asked[0][1]) == 32
    assert runner.calls[-1] == ["scancel", "4711"]
    assert ["scontrol", "release", "4711"] not in runner.calls
    assert not (tmp_path / "4711").exists()


def test_a_registered_job_is_released(tmp_path: Path) -> None:
    async def accept(job_id: str, secret: bytes) -> str | None:
        return None

    runner = Recorder()
    assert asyncio.run(submit(spec(), tmp_path, SlurmClient(runner=runner), accept)) == "4711"
    assert runner.calls[-1] == ["scontrol", "release", "4711"]
