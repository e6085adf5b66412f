"""Errors raised by the supervisor package."""

from agent.wire.errors import ResurgoError


class SupervisorError(ResurgoError):
    """Base of the supervisor's own errors."""


class SlurmError(SupervisorError):
    """A Slurm command failed; the outcome it asked about is unknown, never 'gone'."""


class SlurmUnavailable(SlurmError):
    """Slurm could not be reached at all (no binary on PATH, controller down, timeout)."""


class SlurmNotSettled(SlurmError):
    """A job did not reach the state a step waits for in time (a requeued job still
    COMPLETING while its old processes end): asking again later can succeed."""


class RequestRefused(SupervisorError):
    """The API refused a request: ``status`` is the HTTP status, ``cause`` a stable short code.

    The message is the reason sent back to the client; it names what to fix and
    never carries a secret.
    """

    def __init__(self, status: int, cause: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.cause = cause
        self.reason = reason


class StoreError(SupervisorError):
    """The supervisor's SQLite store cannot be used as asked; the message says what to do."""


class StoreMissing(StoreError):
    """The store file does not exist and the caller asked not to create it."""


class StoreCorrupt(StoreError):
    """The store file is damaged or not an SQLite database; restore it from a backup."""


class StoreSchemaError(StoreError):
    """The store's schema is newer than this Resurgo, or the file is not a Resurgo store."""


class UnknownJob(StoreError):
    """A write names a job the store has no record of; ``upsert_job`` it first."""


class ActionStateError(StoreError):
    """An action transition is not allowed from its current state (e.g. done -> started)."""


class SlurmCommandFailed(SlurmError):
    """Slurm answered and refused: the command exited non-zero."""

    def __init__(self, argv: list[str], returncode: int, stderr: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        detail = stderr.strip() or "(no stderr)"
        super().__init__(f"`{' '.join(argv)}` failed with exit code {returncode}: {detail}")


class SlurmParseError(SlurmError):
    """Slurm's output did not have the expected shape; treat the answer as unknown."""


class SlurmRequeueFailed(SlurmError):
    """A step of requeue-smaller failed; ``step`` names it, the Slurm error is chained."""

    def __init__(self, job_id: int, step: str, error: SlurmError) -> None:
        self.job_id = job_id
        self.step = step
        self.error = error
        super().__init__(
            f"requeue of job {job_id} stopped at step {step!r}: {error}; "
            "check `scontrol show job` and call requeue_smaller again (it resumes)"
        )
