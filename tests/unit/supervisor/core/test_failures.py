"""A failed rank's class decides the recovery (supervisor.core.failures), on the core's world.

Each test feeds real-looking ``rank_exited`` evidence through ``decide`` and
checks what the recovery does: a script error before the first step on every
node stops the job; an OOM kill retries within its budget and blames no node;
a hardware rule blames the node; everything else is decided as before, with
the class named.
"""

from __future__ import annotations

import re
import signal
from dataclasses import replace

from supervisor.core.failure_rules import DEFAULT_RULES, Action, FailureClass, Rule
from supervisor.core.intents import (
    Alert,
    DrainNode,
    RelaunchStep,
    Severity,
    StopJob,
    ValidateCheckpoints,
)
from supervisor.core.model import Cause, JobState, record_from_json, record_to_json
from supervisor.core.observations import (
    CheckpointValidated,
    RankExited,
    StorageUnavailable,
    Tick,
)
from supervisor.core.policy import decide
from tests.unit.policy_world import CLUSTER, NODES, NOW, POLICY, kinds, running

OOM_LINE = "Memory cgroup out of memory: Killed process 689 (python3) total-vm:82356kB"


def _exit(node: str, **evidence: object) -> RankExited:
    return RankExited(node, f"42/{node}/abcdef01/{len(evidence)}", NOW - 1,
                      global_rank=int(node[-1]) - 1, step=150, **evidence)  # type: ignore[arg-type]  # fmt: skip


def _import_error(node: str) -> RankExited:
    return _exit(node, exit_code=1, raised="ModuleNotFoundError",
                 message="No module named 'tansformers'")  # fmt: skip


def _decide_all(record, events, rules=DEFAULT_RULES, policy=POLICY):  # type: ignore[no-untyped-def]
    decisions = []
    for event in events:
        decided = decide(record, event, NOW, policy, CLUSTER, rules)
        decisions.append(decided)
        record = decided.record
    return decisions


def test_an_import_error_on_every_node_before_the_first_step_stops_the_job_at_once() -> None:
    starting = running(state=JobState.STARTING)
    window = replace(POLICY, exit_evidence_window_s=30.0)
    *_, last = _decide_all(starting, [_import_error(node) for node in NODES], policy=window)
    assert last.record.state is JobState.RECOVERING  # all four collected, window open
    closed = decide(last.record, Tick(), NOW + 31, window, CLUSTER)
    assert closed.record.state is JobState.FAILED and closed.cause is Cause.USER_ERROR
    assert kinds(closed) == [StopJob] and not any(isinstance(i, DrainNode) for i in closed.intents)
    assert "ModuleNotFoundError: No module named 'tansformers'\"" in closed.explanation
    assert (
        "on every node" in closed.explanation
        and "(rule script-error-at-start)" in closed.explanation
    )
    assert closed.record.failures == (("user_error", 1),)


def test_the_same_error_on_one_node_only_is_that_nodes_and_decided_as_before() -> None:
    starting = running(state=JobState.STARTING)
    (decided,) = _decide_all(starting, [_import_error("node3")])
    assert decided.record.state is JobState.RECOVERING
    assert decided.cause is Cause.USER_EXCEPTION  # retried once, as any exception
    assert decided.record.failures == (("user_error", 1),)


def test_after_training_began_an_import_error_is_no_script_error() -> None:
    (decided,) = _decide_all(running(), [_import_error(node) for node in ("node1",)])
    assert decided.cause is Cause.USER_EXCEPTION
    assert decided.record.failures == (("unknown", 1),)


def test_an_oom_kill_retries_without_blame_then_stops_with_the_kernels_words() -> None:
    killed = _exit("node2", signal=signal.SIGKILL, oom_kill=OOM_LINE)
    (first,) = _decide_all(running(), [killed])
    assert first.cause is Cause.OOM and first.record.state is JobState.RECOVERING
    assert not any(isinstance(i, DrainNode) for i in first.intents)
    assert "retry 1 of 1, no node blamed" in first.explanation
    again = replace(first.record, state=JobState.RUNNING, recovery=None)
    (second,) = _decide_all(again, [replace(killed, event_id="42/node2/abcdef01/9")])
    assert second.record.state is JobState.FAILED and second.cause is Cause.OOM
    assert OOM_LINE in second.explanation and "2 such failures" in second.explanation
    # Without the kernel's word the same SIGKILL blames the node, as before.
    (plain,) = _decide_all(running(), [_exit("node2", signal=signal.SIGKILL)])
    assert plain.cause is Cause.RANK_SIGNAL and DrainNode in kinds(plain)


def test_an_operators_hardware_rule_blames_the_node_and_names_the_rule() -> None:
    rule = Rule("bad-hbm", FailureClass.HARDWARE, Action.BLAME_NODE, confidence=0.9,
                pattern=re.compile(r"HBM uncorrectable"), operator=True)  # fmt: skip
    tail = "step 80\nRuntimeError: HBM uncorrectable error on bank 3"
    failed = _exit("node3", exit_code=1, raised="RuntimeError", stderr_tail=tail)
    (decided,) = _decide_all(running(), [failed], rules=(rule, *DEFAULT_RULES))
    assert decided.cause is Cause.HARDWARE
    (drain,) = [i for i in decided.intents if isinstance(i, DrainNode)]
    assert drain.node == "node3" and "rule bad-hbm" in drain.reason
    # Without the rule it is the user's exception: no node blamed.
    (plain,) = _decide_all(running(), [failed])
    assert plain.cause is Cause.USER_EXCEPTION and DrainNode not in kinds(plain)


def test_peers_that_lose_a_rank_before_it_is_seen_dead_do_not_hide_its_hardware_rule() -> None:
    """Found live (tests/e2e/test_failure_classes.py): a rank printed the site's fault and
    exited 1; its peers raised on its closed connections while it shut down, before its
    exit, and the earliest raise was taken for the root cause."""
    rule = Rule("site-gpu-fault", FailureClass.HARDWARE, Action.BLAME_NODE,
                pattern=re.compile(r"SITE GPU FAULT"), operator=True)  # fmt: skip
    said = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    faulted = _exit("node3", exit_code=1, stderr_tail="SITE GPU FAULT on bank 3",
                    exit_time_s=NOW - 1.0)  # fmt: skip
    peers = [
        _exit(node, exit_code=1, raised="RuntimeError", message=said, raised_time_s=NOW - 2.3,
              exit_time_s=NOW - 0.5)
        for node in ("node1", "node2", "node4")
    ]  # fmt: skip
    window = replace(POLICY, exit_evidence_window_s=30.0)
    *_, last = _decide_all(running(), [*peers, faulted], rules=(rule, *DEFAULT_RULES),
                           policy=window)  # fmt: skip
    closed = decide(last.record, Tick(), NOW + 31, window, CLUSTER, (rule, *DEFAULT_RULES))
    assert closed.cause is Cause.HARDWARE, closed.explanation
    (drain,) = [i for i in closed.intents if isinstance(i, DrainNode)]
    assert drain.node == "node3" and "rule site-gpu-fault" in drain.reason
    assert closed.record.failures == (("hardware", 1),)


def test_a_network_error_keeps_todays_decision_and_says_its_class() -> None:
    said = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    gloo = _exit("node1", exit_code=1, raised="RuntimeError", message=said)
    (decided,) = _decide_all(running(), [gloo])
    assert decided.cause is Cause.USER_EXCEPTION
    assert "network (rule collective-network)" in decided.explanation
    assert decided.record.failures == (("network", 1),)


def test_a_record_with_classified_exits_reads_back_and_an_old_one_still_reads() -> None:
    window = replace(POLICY, exit_evidence_window_s=30.0)
    (open_,) = _decide_all(running(), [_exit("node2", signal=9, oom_kill=OOM_LINE)], policy=window)
    assert record_from_json(record_to_json(open_.record)) == open_.record
    assert open_.record.recovery is not None and open_.record.recovery.exits[0].failure == "oom"
    text = record_to_json(open_.record).replace('"failure": "oom", ', "")
    assert record_from_json(text).recovery.exits[0].failure is None  # type: ignore[union-attr]


def test_a_full_disk_blames_nobody_and_the_relaunch_waits_for_the_storage() -> None:
    policy = replace(POLICY, storage_wait_s=100.0)
    full = _exit("node2", exit_code=1, raised="OSError", errno=28,
                 message="[Errno 28] No space left on device: '/ckpt/step-30/shard-1'")  # fmt: skip
    first = decide(running(), full, NOW, policy, CLUSTER)
    assert first.cause is Cause.STORAGE and DrainNode not in kinds(first)
    (look,) = [i for i in first.intents if isinstance(i, ValidateCheckpoints)]
    assert look.storage_probe == 1 and "(rule disk-full)" in first.explanation
    # Still full: the next look waits 5 s, then 10 s, ...
    still = decide(first.record, StorageUnavailable(first.record.attempt, "0 B free"), NOW + 1,
                   policy, CLUSTER)  # fmt: skip
    assert kinds(still) == [Alert] and "looking again in 5 s" in still.explanation
    assert decide(still.record, Tick(), NOW + 3, policy, CLUSTER).intents == ()
    again = decide(still.record, Tick(), NOW + 6, policy, CLUSTER)
    (second,) = again.intents
    assert isinstance(second, ValidateCheckpoints) and second.storage_probe == 2
    assert second.action_id != look.action_id  # each look is carried out once
    later = decide(again.record, StorageUnavailable(again.record.attempt, "0 B free"), NOW + 7,
                   policy, CLUSTER)  # fmt: skip
    assert "looking again in 10 s" in later.explanation
    # The wait runs out: FAILED with what was last seen.
    ended = decide(later.record, StorageUnavailable(later.record.attempt, "0 B free"), NOW + 101,
                   policy, CLUSTER)  # fmt: skip
    assert ended.record.state is JobState.FAILED and ended.cause is Cause.STORAGE
    assert "within 100 s: 0 B free" in ended.explanation
    assert ended.record.failures == (("storage", 1),)


def test_jobs_failing_on_one_full_file_system_are_one_incident_with_one_alert() -> None:
    full = _exit("node2", exit_code=1, stderr_tail="OSError: [Errno 28] No space left on device")
    first = decide(running(), full, NOW, POLICY, CLUSTER)
    job = first.record.attempt
    seen = StorageUnavailable(job, "/lustre/ckpt has 0 B free", "/lustre")
    # The first job on /lustre opens the incident: one critical alert.
    opened = decide(first.record, seen, NOW + 1, POLICY, CLUSTER)
    (alert,) = opened.intents
    assert isinstance(alert, Alert) and alert.severity is Severity.CRITICAL
    assert alert.message.startswith("storage incident on /lustre: /lustre/ckpt has 0 B free")
    assert opened.record.recovery is not None and opened.record.recovery.storage_fs == "/lustre"
    assert record_from_json(record_to_json(opened.record)) == opened.record
    # Its next look raises nothing more.
    again = decide(opened.record, Tick(), NOW + 7, POLICY, CLUSTER)
    still = decide(again.record, replace(seen, attempt=again.record.attempt), NOW + 8, POLICY,
                   CLUSTER)  # fmt: skip
    assert still.intents == () and "incident" not in still.explanation
    # Another job whose root is on /lustre joins it: no alert of its own.
    other = replace(first.record, job_id="43")
    waits = replace(CLUSTER, storage_waits=(("/lustre", "42"), ("/scratch", "44")))
    joined = decide(other, seen, NOW + 2, POLICY, waits)
    assert joined.intents == ()
    assert "joins the storage incident on /lustre: 1 other job wait on it (42)" in (
        joined.explanation
    )
    # A job on another file system opens an incident of its own.
    elsewhere = decide(other, replace(seen, filesystem="/home"), NOW + 2, POLICY, waits)
    assert [type(i) for i in elsewhere.intents] == [Alert]


def test_once_the_storage_takes_writes_the_recovery_goes_on_as_ever() -> None:
    full = _exit("node2", exit_code=1, stderr_tail="OSError: [Errno 28] No space left on device")
    first = decide(running(), full, NOW, POLICY, CLUSTER)
    valid = decide(first.record, CheckpointValidated(100, "/ckpt/step-100", True), NOW + 1,
                   POLICY, CLUSTER)  # fmt: skip
    assert RelaunchStep in kinds(valid)
