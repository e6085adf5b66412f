"""What failed: a dead rank's evidence mapped to a failure class, by an ordered rule table.

A rank's exit carries its status and, where known, its uncaught exception
(type, message start, an ``OSError``'s errno), its last lines on standard
error, and the kernel's out-of-memory kill or GPU Xid line
(``rank_exited``, docs/protocol.md). :func:`classify` walks the rules in
order, the operator's (``[[failure_rules]]`` in the supervisor's TOML) before
the defaults (:data:`DEFAULT_RULES`), and the first that matches names the
class, its action and its budget, and quotes the line that matched. No rule
matching is ``unknown``: today's decision by how the rank ended.

The classes and what each does (:class:`Action`):

- ``user_error`` (an import, syntax or attribute error, bad arguments, an
  assertion, before the attempt's first step): no retry can help; the job
  stops as FAILED (exit 93), no node blamed;
- ``oom`` (the kernel's OOM kill, a CUDA or Python out-of-memory error): the
  script's memory use, not the node: retried without blame within the
  budget, then stopped with the numbers;
- ``storage`` (no space, quota, an I/O error, a stale NFS handle): no node
  blamed; the relaunch waits until the checkpoint root is writable again;
- ``network`` (gloo's and NCCL's connection errors and timeouts): peers of a
  dead rank say this; the earliest death stays the root cause;
- ``hardware`` (a GPU Xid, an uncorrectable ECC error): the node is blamed
  as a machine fault;
- ``preempted``, ``time_limit``, ``cancelled``: Slurm's word, not a rank's
  (:mod:`supervisor.core.follow_slurm`);
- ``unknown``: no rule matched.

Pure: evidence and rules in, a :class:`Classified` out.
"""

from __future__ import annotations

import enum
import errno as errnos
import re
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_RULES",
    "Action",
    "Classified",
    "Evidence",
    "FailureClass",
    "Rule",
    "classify",
]

# How much of a matched line a verdict quotes.
QUOTE_CHARS = 240


class FailureClass(enum.Enum):
    """What kind of failure a rank's death was."""

    USER_ERROR = "user_error"
    OOM = "oom"
    STORAGE = "storage"
    NETWORK = "network"
    HARDWARE = "hardware"
    PREEMPTED = "preempted"
    TIME_LIMIT = "time_limit"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"


class Action(enum.Enum):
    """What a class makes the supervisor do."""

    STOP = "stop"  # FAILED at once, no blame, the evidence quoted
    RETRY = "retry"  # relaunch without blame, within the rule's budget; then stop
    WAIT_STORAGE = "wait_storage"  # no blame; relaunch once the checkpoint root takes writes
    BLAME_NODE = "blame_node"  # the node is at fault (drain or ticket, as the policy says)
    DEFAULT = "default"  # decide as by how the rank ended (signals, exceptions, root cause)


@dataclass(frozen=True)
class Evidence:
    """One failed rank's evidence, each piece optional."""

    exit_code: int | None = None
    signal: int | None = None
    raised: str | None = None  # the uncaught exception's type name
    message: str = ""  # its message's start
    errno: int | None = None
    stderr_tail: str = ""
    oom_kill: str | None = None  # the kernel's line (or the cgroup count's rise)
    xid: str | None = None
    # The rank died before the attempt's first training step.
    at_start: bool = False

    def texts(self) -> list[str]:
        """The lines a pattern is matched against: message, stderr tail, kernel lines."""
        lines = [self.message] if self.message else []
        lines += [line for line in self.stderr_tail.splitlines() if line.strip()]
        return lines + [line for line in (self.oom_kill, self.xid) if line]


@dataclass(frozen=True)
class Rule:
    """One row of the table: what it matches, the class it gives, and what that does.

    A rule matches when every condition it sets holds (an empty one is not
    set): the exit code, the signal, the exception type (the type's name,
    without module), the errno, a regular expression found in any line of
    the evidence (:meth:`Evidence.texts`), the kernel's OOM or Xid line being
    there, and ``at_start``: only before the attempt's first step.
    ``budget``: for ``retry``, how many relaunches the class may take in the
    job's life (0: none).
    """

    name: str
    failure_class: FailureClass
    action: Action
    budget: int = 0
    confidence: float = 0.9
    exit_codes: frozenset[int] = frozenset()
    signals: frozenset[int] = frozenset()
    exceptions: frozenset[str] = frozenset()
    errnos: frozenset[int] = frozenset()
    pattern: re.Pattern[str] | None = None
    oom_kill: bool = False
    xid: bool = False
    at_start: bool = False
    operator: bool = field(default=False, compare=False)

    def sets_a_condition(self) -> bool:
        """A rule that sets no condition would match every failure."""
        return bool(
            self.exit_codes or self.signals or self.exceptions or self.errnos
            or self.pattern is not None or self.oom_kill or self.xid
        )  # fmt: skip

    def match(self, evidence: Evidence) -> str | None:
        """The evidence line that matched (the reason the rule holds), or None."""
        if self.at_start and not evidence.at_start:
            return None
        quoted = []
        if self.exit_codes:
            if evidence.exit_code not in self.exit_codes:
                return None
            quoted.append(f"exit status {evidence.exit_code}")
        if self.signals:
            if evidence.signal not in self.signals:
                return None
            quoted.append(f"signal {evidence.signal}")
        if self.exceptions:
            if evidence.raised not in self.exceptions:
                return None
            quoted.append(_exception_line(evidence))
        if self.errnos:
            if evidence.errno not in self.errnos:
                return None
            quoted.append(_exception_line(evidence))
        if self.oom_kill:
            if not evidence.oom_kill:
                return None
            quoted.append(evidence.oom_kill)
        if self.xid:
            if not evidence.xid:
                return None
            quoted.append(evidence.xid)
        if self.pattern is not None:
            found = next((line for line in evidence.texts() if self.pattern.search(line)), None)
            if found is None:
                return None
            quoted.append(found.strip())
        # The most telling line: a quoted text over a bare status.
        best = max(quoted, key=lambda line: (not line.startswith(("exit status", "signal")),
                                             len(line)))  # fmt: skip
        return best[:QUOTE_CHARS]


@dataclass(frozen=True)
class Classified:
    """A failure's class, the rule that said so (None: no rule), and the line it matched."""

    failure_class: FailureClass
    action: Action
    rule: str | None = None
    evidence: str = ""
    budget: int = 0
    confidence: float = 0.0
    operator: bool = False

    def words(self) -> str:
        """``oom (rule kernel-oom-kill): "Killed process 689 (python3) ..."``."""
        if self.rule is None:
            return self.failure_class.value
        quote = f': "{self.evidence}"' if self.evidence else ""
        return f"{self.failure_class.value} (rule {self.rule}){quote}"


UNKNOWN = Classified(FailureClass.UNKNOWN, Action.DEFAULT)


def _exception_line(evidence: Evidence) -> str:
    if evidence.raised and evidence.message:
        return f"{evidence.raised}: {evidence.message}"
    return evidence.raised or evidence.message or f"errno {evidence.errno}"


def classify(evidence: Evidence, rules: tuple[Rule, ...]) -> Classified:
    """The first rule of ``rules`` that matches ``evidence``, as a :class:`Classified`."""
    for rule in rules:
        line = rule.match(evidence)
        if line is not None:
            return Classified(
                rule.failure_class, rule.action, rule.name, line, rule.budget, rule.confidence,
                rule.operator,
            )  # fmt: skip
    return UNKNOWN


def _words(*alternatives: str) -> re.Pattern[str]:
    return re.compile("|".join(alternatives))


# Python's exceptions that say the script itself is wrong when they end it before its
# first step: a retry runs the same code on the same arguments and fails the same way.
START_EXCEPTIONS = frozenset({
    "ModuleNotFoundError", "ImportError", "SyntaxError", "IndentationError", "TabError",
    "NameError", "AttributeError", "AssertionError", "FileNotFoundError", "KeyError",
    "TypeError", "UnboundLocalError", "NotImplementedError",
})  # fmt: skip

DEFAULT_RULES: tuple[Rule, ...] = (
    # The kernel's own word comes first: it is nobody's guess.
    Rule("kernel-oom-kill", FailureClass.OOM, Action.RETRY, budget=1, confidence=0.95,
         oom_kill=True),
    Rule("gpu-xid", FailureClass.HARDWARE, Action.BLAME_NODE, confidence=0.9, xid=True),
    Rule("gpu-ecc", FailureClass.HARDWARE, Action.BLAME_NODE, confidence=0.9,
         pattern=_words(r"uncorrectable ECC error", r"ECC error encountered",
                        r"GPU has fallen off the bus")),
    Rule("cuda-out-of-memory", FailureClass.OOM, Action.RETRY, budget=1,
         exceptions=frozenset({"OutOfMemoryError"})),
    Rule("cuda-out-of-memory-text", FailureClass.OOM, Action.RETRY, budget=1,
         pattern=_words(r"CUDA out of memory", r"CUDA error: out of memory",
                        r"HIP out of memory")),
    Rule("python-memory-error", FailureClass.OOM, Action.RETRY, budget=1,
         exceptions=frozenset({"MemoryError"})),
    Rule("disk-full", FailureClass.STORAGE, Action.WAIT_STORAGE,
         errnos=frozenset({errnos.ENOSPC, errnos.EDQUOT})),
    Rule("disk-full-text", FailureClass.STORAGE, Action.WAIT_STORAGE,
         pattern=_words(r"No space left on device", r"Disk quota exceeded")),
    # torch.save on a full disk names no errno: its zip writer only finds fewer bytes
    # written than it expected (torch 2.x). The storage look then decides whether the
    # root is full: one that takes a checkpoint ends the wait at the first look.
    Rule("torch-save-write-failed", FailureClass.STORAGE, Action.WAIT_STORAGE,
         confidence=0.6,
         pattern=_words(r"inline_container\.cc:\d+\] \. unexpected pos \d+ vs \d+",
                        r"PytorchStreamWriter failed writing file")),
    Rule("storage-io", FailureClass.STORAGE, Action.WAIT_STORAGE,
         errnos=frozenset({errnos.EIO, errnos.ESTALE, errnos.EROFS})),
    Rule("storage-io-text", FailureClass.STORAGE, Action.WAIT_STORAGE,
         pattern=_words(r"Stale file handle", r"\[Errno 5\] Input/output error",
                        r"Read-only file system")),
    Rule("script-error-at-start", FailureClass.USER_ERROR, Action.STOP, confidence=0.95,
         exceptions=START_EXCEPTIONS, at_start=True),
    # argparse's error: usage on one line, "prog: error: ..." on the last, status 2.
    Rule("bad-arguments", FailureClass.USER_ERROR, Action.STOP, confidence=0.95,
         exit_codes=frozenset({2}), pattern=re.compile(r"^\S+: error: "), at_start=True),
    Rule("collective-network", FailureClass.NETWORK, Action.DEFAULT, confidence=0.5,
         pattern=_words(r"Connection closed by peer", r"Connection reset by peer",
                        r"NCCL error", r"ncclRemoteError", r"ncclSystemError",
                        r"Watchdog caught collective operation timeout",
                        r"DistNetworkError", r"Gloo connectFullMesh failed",
                        r"Timed out waiting \d+ms for recv operation")),
)  # fmt: skip
