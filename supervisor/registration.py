"""Does the supervisor that answers register this job? ``resurgo submit``'s handshake.

A supervisor registers a job from its directory in *its* jobs directory
(:mod:`supervisor.jobs`). When ``resurgo submit`` writes the directory
somewhere else (another ``RESURGO_STATE_DIR`` or ``--jobs-dir``, another
supervisor's URL), the job would run unsupervised while the driver is told
``401 unknown_job`` for ever. So, with the job still held, submit asks the
supervisor about the job in the one way that proves registration: a
``GET /v1/jobs/<id>`` signed with the secret it just wrote. The answer is
200 once the supervisor read that very directory (the secret is in no other
place); ``401 unknown_job`` while it has not (yet); ``401 bad_signature``
when it knows a job of that id from some other directory. Nothing about the
job reaches anyone without its secret (docs/security.md); ``/healthz``
names the supervisor's jobs directory, so the refusal says what differs.

:func:`verdict` and :func:`refusal` are pure; :func:`wait_registered`
asks over HTTP.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from agent.wire import protocol

POLL_S = 0.5


class Registration(enum.Enum):
    """What the supervisor said about the job."""

    REGISTERED = "registered"
    UNKNOWN = "unknown"  # not (yet) registered: 401 unknown_job
    OTHER_SECRET = "other_secret"  # a job of this id, from another directory
    NO_ANSWER = "no_answer"  # connection failed or another answer


@dataclass(frozen=True)
class Health:
    """What ``/healthz`` said: it answered, the jobs directory it names (if any), its
    mode (``drain``, ``exclude``; None: not yet known or an older supervisor) and the
    nodes a user's next jobs should leave out, as (node, why) pairs."""

    jobs_dir: str | None
    mode: str | None = None
    avoid_nodes: tuple[tuple[str, str], ...] = ()


def verdict(status: int, body: bytes) -> Registration:
    """The registration an answer to the signed status request shows."""
    if status == 200:
        return Registration.REGISTERED
    try:
        cause = json.loads(body).get("error")
    except (ValueError, AttributeError):
        cause = None
    if status == 401 and cause == "unknown_job":
        return Registration.UNKNOWN
    if status == 401 and cause == "bad_signature":
        return Registration.OTHER_SECRET
    return Registration.NO_ANSWER


def refusal(
    url: str, job_id: str, seen: Registration, wrote_to: Path, health: Health, waited_s: float
) -> str:
    """Why the job was not released, and what to fix."""
    watched = health.jobs_dir
    where = (
        f"the supervisor at {url} registers jobs from {watched}; this submit wrote "
        f"job {job_id} to {wrote_to}"
        if watched is not None
        else f"this submit wrote job {job_id} to {wrote_to}"
    )
    fix = (
        "run resurgo submit with the supervisor's jobs directory (--jobs-dir DIR or "
        "RESURGO_JOBS_DIR, or its RESURGO_STATE_DIR), or point --supervisor/RESURGO_URL "
        "at the supervisor that watches this one"
    )
    if seen is Registration.OTHER_SECRET:
        return (
            f"job {job_id} was cancelled: the supervisor at {url} knows a job {job_id} with "
            f"another secret, so it reads job directories from another place ({where}): {fix}"
        )
    if seen is Registration.NO_ANSWER:
        return (
            f"job {job_id} was cancelled: the supervisor at {url} stopped answering while "
            f"job {job_id} waited to be registered ({waited_s:.0f} s); {where}"
        )
    same = watched is not None and Path(watched) == wrote_to.resolve()
    hint = (
        f"the directory is the one it watches: see its log for 'job {job_id} not registered' "
        "(a directory owned by another user than the job's), or give it longer with "
        "--register-wait-s"
        if same
        else fix
    )
    return (
        f"job {job_id} was cancelled: the supervisor at {url} did not register it within "
        f"{waited_s:.0f} s ({where}): {hint}"
    )


def health(url: str, timeout_s: float = 3.0, user: str | None = None) -> Health | None:
    """``/healthz`` of the supervisor at ``url``; None when it does not answer 200. With
    ``user``, the nodes to avoid are those for everyone and those for ``user``."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/healthz", timeout=timeout_s) as answer:
            if answer.status != 200:
                return None
            document: Any = json.loads(answer.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    if not isinstance(document, dict):
        return Health(None)
    watched = document.get("jobs_dir")
    mode = document.get("mode")
    avoid = document.get("avoid_nodes")
    return Health(
        watched if isinstance(watched, str) else None,
        mode if isinstance(mode, str) else None,
        tuple(
            (entry["node"], str(entry.get("why", "")))
            for entry in (avoid if isinstance(avoid, list) else [])
            if isinstance(entry, dict)
            and isinstance(entry.get("node"), str)
            and _avoided_by(entry.get("users"), user)
        ),
    )


def _avoided_by(users: Any, user: str | None) -> bool:
    """Whether an avoid-list entry for ``users`` (absent: everyone) applies to ``user``."""
    return not isinstance(users, list) or user is None or user in users


async def wait_registered(
    url: str,
    job_id: str,
    secret: bytes,
    wait_s: float,
    *,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> Registration:
    """Ask until the supervisor registered the job, knows it with another secret, or
    ``wait_s`` passed; the last registration seen."""
    path = f"/v1/jobs/{job_id}"
    started = time.monotonic()
    seen = Registration.NO_ANSWER
    async with aiohttp.ClientSession() as session:
        while True:
            headers = protocol.signed_headers(secret, "GET", path, job_id, int(clock()), b"")
            try:
                async with session.get(
                    url.rstrip("/") + path, headers=headers,
                    timeout=aiohttp.ClientTimeout(total=5),
                ) as answer:  # fmt: skip
                    seen = verdict(answer.status, await answer.read())
            except (aiohttp.ClientError, TimeoutError):
                seen = Registration.NO_ANSWER
            if seen in (Registration.REGISTERED, Registration.OTHER_SECRET):
                return seen
            if time.monotonic() - started >= wait_s:
                return seen
            await sleep(POLL_S)
