"""The /metrics exposition from a real store: names, values, and `promtool check metrics`."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from supervisor.core.goodput import Fact, FactKind
from supervisor.looplag import LoopLag
from supervisor.metrics import StoreCollector, build_registry, exposition, recovery_durations
from supervisor.store import Store
from tests.unit.cli_world import JOB


def scrape(state: Path) -> tuple[bytes, dict[str, list[tuple[dict[str, str], float]]]]:
    with Store.open(state / "resurgo.db") as store:
        collector = StoreCollector(
            store,
            cluster_nodes=lambda: 4,
            connected_agents=lambda: 2,
            drains_allowed_per_hour=lambda: 1,
            drain_storm=lambda: True,
        )
        text = exposition(build_registry(collector))
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return text, samples


def value(samples: dict, metric: str, **labels: str) -> float:  # type: ignore[type-arg]
    matching = [
        v for found, v in samples[metric] if all(found.get(k) == x for k, x in labels.items())
    ]
    assert len(matching) == 1, (metric, labels, samples.get(metric))
    return float(matching[0])


def test_every_job_and_cluster_metric_is_exported_from_the_store(state_dir: Path) -> None:
    _, samples = scrape(state_dir)
    assert value(samples, "resurgo_job_info", job_id=JOB, name="llm") == 1
    assert value(samples, "resurgo_job_state", job_id=JOB, state="running") == 1
    assert value(samples, "resurgo_job_state", job_id=JOB, state="failed") == 0
    assert 0 < value(samples, "resurgo_job_goodput_ratio", job_id=JOB) < 1
    assert value(samples, "resurgo_job_restarts_total", job_id=JOB, cause="hang") == 1
    assert value(samples, "resurgo_job_world_size_nodes", job_id=JOB) == 2
    assert value(samples, "resurgo_job_straggler_reports_total", job_id=JOB, node="node2") == 3
    assert value(samples, "resurgo_job_straggler_reports_total", job_id=JOB, node="node1") == 0
    assert value(samples, "resurgo_job_original_world_size_nodes", job_id=JOB) == 3
    assert value(samples, "resurgo_job_last_committed_step", job_id=JOB) == 10
    assert value(samples, "resurgo_job_step", job_id=JOB) == 12
    assert value(samples, "resurgo_job_checkpoint_age_seconds", job_id=JOB) > 0
    assert value(samples, "resurgo_job_badput_seconds", job_id=JOB, cause="lost_work") > 0
    assert value(samples, "resurgo_job_time_to_detect_seconds_count", job_id=JOB) == 1
    assert value(samples, "resurgo_job_time_to_recover_seconds_count", job_id=JOB) == 1
    assert value(samples, "resurgo_drains_total", cause="hang") == 1
    assert value(samples, "resurgo_drained_nodes") == 1
    assert value(samples, "resurgo_drains_allowed_per_hour") == 1
    assert value(samples, "resurgo_blames_total", outcome="drained") == 1
    assert value(samples, "resurgo_drain_storm") == 1
    assert value(samples, "resurgo_node_mtbf_seconds") > 0
    assert value(samples, "resurgo_connected_agents") == 2
    assert value(samples, "resurgo_up") == 1


def test_failures_are_counted_by_class_each_class_from_zero_for_every_job(
    state_dir: Path,
) -> None:
    with Store.open(state_dir / "resurgo.db") as store:
        record = {"attempt": 3, "nodes": ["node5"], "restarts": [["oom", 1], ["rank_signal", 1]],
                  "final_reason": "", "failures": [["oom", 1], ["unknown", 1]]}  # fmt: skip
        store.upsert_job("4712", state="running", record=record, now_s=time.time() - 60,
                         name="big", original_nodes=1, min_nodes=1)  # fmt: skip
    _, samples = scrape(state_dir)
    assert value(samples, "resurgo_failures_total", job_id="4712", **{"class": "oom"}) == 1
    assert value(samples, "resurgo_failures_total", job_id="4712", **{"class": "unknown"}) == 1
    classes = ("user_error", "oom", "storage", "network", "hardware", "unknown")
    # A job with no failure yet still has every class, at 0: increase() sees the first one.
    assert [value(samples, "resurgo_failures_total", job_id=JOB, **{"class": name})
            for name in classes] == [0] * len(classes)  # fmt: skip
    assert value(samples, "resurgo_failures_total", job_id="4712", **{"class": "hardware"}) == 0


def test_a_job_waiting_for_its_storage_is_labelled_with_the_file_system_of_the_incident(
    state_dir: Path,
) -> None:
    with Store.open(state_dir / "resurgo.db") as store:
        for job_id, state in (("4713", "recovering"), ("4714", "running")):
            record = {"attempt": 2, "nodes": ["node5"], "restarts": [["storage", 1]],
                      "final_reason": "", "failures": [["storage", 1]],
                      "recovery": {"cause": "storage", "storage_fs": "/lustre"}}  # fmt: skip
            store.upsert_job(job_id, state=state, record=record, now_s=time.time() - 60,
                             name="big", original_nodes=1, min_nodes=1)  # fmt: skip
    _, samples = scrape(state_dir)
    assert value(samples, "resurgo_job_storage_wait", job_id="4713", filesystem="/lustre") == 1
    assert [found["job_id"] for found, _ in samples["resurgo_job_storage_wait"]] == ["4713"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool comes with deploy/setup")
def test_the_exposition_passes_promtool_check_metrics(state_dir: Path) -> None:
    text, _ = scrape(state_dir)
    done = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 0, (done.stdout + done.stderr).decode()


def test_detection_and_recovery_durations_come_from_the_timeline() -> None:
    facts = [
        Fact(10, FactKind.STEP, 5),
        Fact(12, FactKind.FAULT, cause="hang"),
        Fact(40, FactKind.DETECTED, cause="hang"),
        Fact(60, FactKind.RESUMED, 4),
        Fact(95, FactKind.STEP, 5),
        Fact(100, FactKind.STEP, 6),
    ]
    assert recovery_durations(facts) == ([28.0], [55.0])


def test_the_loop_lag_histogram_records_how_long_the_loop_was_held() -> None:
    registry = CollectorRegistry(auto_describe=False)
    lag = LoopLag(registry, period_s=0.01)

    async def scenario() -> None:
        task = asyncio.create_task(lag.run())
        await asyncio.sleep(0.1)
        time.sleep(0.3)  # the loop held, as by a long parse
        await asyncio.sleep(0.1)
        task.cancel()

    asyncio.run(scenario())
    value = registry.get_sample_value
    count = value("resurgo_supervisor_loop_lag_seconds_count")
    assert count is not None and count >= 10
    held = count - (value("resurgo_supervisor_loop_lag_seconds_bucket", {"le": "0.25"}) or 0)
    # The held loop made a timer late by 0.3 s (a loaded machine may add others).
    assert held >= 1
    assert (value("resurgo_supervisor_loop_lag_seconds_sum") or 0) >= 0.25
