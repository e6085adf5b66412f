"""A valid job spec to submit, changed where a test says: shared by the submission tests.

Used by ``test_jobs.py`` and ``test_registration.py``.
"""

from __future__ import annotations

from supervisor.jobs import JobSpec


def spec(**changes: object) -> JobSpec:
    """A 4-node job (at least 2) of ``torchrun train.py``, with ``changes`` applied."""
    values: dict[str, object] = {
        "name": "llm",
        "nodes": 4,
        "command": ("torchrun", "--nproc-per-node=8", "train.py"),
        "ckpt_root": "/ckpt/llm",
        "min_nodes": 2,
        "supervisor_url": "http://head:8740",
    }
    values.update(changes)
    return JobSpec(**values)  # type: ignore[arg-type]
