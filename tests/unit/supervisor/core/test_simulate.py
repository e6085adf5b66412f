"""The goodput simulator against published figures, Daly's formula, and its own invariants.

The published figures (seeds, Llama 3 report, OPT-175B logbook): Llama 3 saw
419 unexpected interruptions in 54 days on 16,384 GPUs, checkpointed every 20
to 30 minutes (what Young's formula gives for a 2-minute save and a 3-hour
MTBF) and kept goodput above 90% thanks to async saves; a 90 s stall every
30 minutes costs 5% by itself; OPT-175B restarted about 105 times in two
months on 992 GPUs, every 12 to 13 hours.
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.checkpoint.interval import daly_interval_s, recommended_interval_s, young_interval_s
from supervisor.cli.main import main
from supervisor.core import simulate as sim
from supervisor.core.goodput import Badput
from supervisor.core.model import Cause
from supervisor.core.save_schedule import Saves
from supervisor.core.simulate import IntervalPolicy, Params, llama3, opt175b, simulate
from tests.paths import REPO

MINUTE = 60.0
# Llama 3's MTBF as the seeds put it: 54 days / 419 interruptions, about 3 hours.
LLAMA3_MTBF_S = 54 * 86400 / 419
TWO_MINUTES = 120.0


def interruptions(outcome: sim.Outcome) -> int:
    return sum(outcome.interruptions.values())


def fixed(params: Params, interval_s: float) -> Params:
    return replace(params, interval_policy=IntervalPolicy.FIXED, interval_s=interval_s)


# --- Llama 3 -----------------------------------------------------------------


def test_llama3_two_minute_save_lands_in_the_seeds_20_to_30_minute_interval() -> None:
    params = replace(llama3(), save_stall_s=TWO_MINUTES, write_s=0.0)
    outcome = simulate(params, seed=0)
    assert params.job_mtbf_s() == pytest.approx(LLAMA3_MTBF_S)
    assert outcome.mean_interval_s == pytest.approx(daly_interval_s(TWO_MINUTES, LLAMA3_MTBF_S))
    assert 20 * MINUTE <= outcome.mean_interval_s <= 30 * MINUTE


def test_llama3_interruptions_match_the_report_within_poisson_noise() -> None:
    counts = [interruptions(simulate(llama3(), seed)) for seed in range(3)]
    # 419 expected: +-3 standard deviations (sqrt(419) ~ 20.5).
    assert all(419 - 62 <= count <= 419 + 62 for count in counts), counts
    gpu = sum(simulate(llama3(), seed).interruptions[Cause.RANK_SIGNAL] for seed in range(3))
    assert gpu / sum(counts) == pytest.approx(0.587, abs=0.04)


def test_llama3_goodput_is_over_90_percent_with_async_saves_only() -> None:
    # Llama 3's interval (Daly's for its 2-minute save) with the same save done
    # asynchronously (a 5 s stall, the 2 minutes in the background) and synchronously.
    interval = daly_interval_s(TWO_MINUTES, LLAMA3_MTBF_S)
    run_async = simulate(fixed(llama3(), interval), seed=0)
    run_sync = simulate(fixed(replace(llama3(), save_stall_s=TWO_MINUTES, write_s=0.0), interval))
    assert 0.90 < run_async.goodput < 0.95
    assert 0.80 < run_sync.goodput < 0.90
    # The supervisor's own policy on the same faults does better than Llama 3's interval.
    assert simulate(llama3(), seed=0).goodput > run_async.goodput + 0.02


def test_ninety_second_stall_every_thirty_minutes_costs_five_percent() -> None:
    # The seeds' arithmetic, without faults: 90 s of every 30 min + 90 s.
    params = fixed(replace(llama3(), save_stall_s=90.0, write_s=0.0, gpu_mtbf_h=1e12), 1800.0)
    outcome = simulate(params)
    share = outcome.accounting.badput_s[Badput.CHECKPOINT_STALL] / outcome.accounting.wall_s
    assert share == pytest.approx(90 / 1890, abs=1e-3)
    assert interruptions(outcome) == 0
    assert outcome.goodput == pytest.approx(1 - share)


# --- Daly by brute force -------------------------------------------------------


def brute_force_optimum_s(save_s: float, mtbf_h: float) -> float:
    """The best fixed interval for a synchronous save, from a sweep around Young's."""
    gpus = 1024
    failures = 2000
    params = Params(
        gpus=gpus,
        gpu_mtbf_h=mtbf_h * gpus,
        days=failures * mtbf_h / 24,
        save_stall_s=save_s,
        write_s=0.0,
        spare_nodes=10**6,
        repair_s=3600.0,
    )
    young = young_interval_s(save_s, mtbf_h * 3600)
    points = sim.sweep(params, np.geomspace(young / 2, young * 2, 13).tolist(), [0])
    return sim.best_interval_s(points)


def test_brute_force_optimum_agrees_with_daly_over_a_grid_of_save_cost_and_mtbf() -> None:
    errors = {}
    for save_s in (30.0, 120.0, 600.0):
        for mtbf_h in (1.0, 3.0, 12.0):
            daly = daly_interval_s(save_s, mtbf_h * 3600)
            errors[save_s, mtbf_h] = brute_force_optimum_s(save_s, mtbf_h) / daly - 1
    assert max(abs(e) for e in errors.values()) < 0.05, errors
    # Where a save costs a sixth of the MTBF, Young's first-order answer is 22%
    # off Daly's; the simulation sides with Daly.
    young = young_interval_s(600.0, 3600.0) / daly_interval_s(600.0, 3600.0) - 1
    assert young > 0.2
    assert abs(errors[600.0, 1.0]) < young / 4


# --- Sensitivity: outputs that are not inputs --------------------------------


def mean_goodput(params: Params, seeds: range = range(4)) -> float:
    return sum(simulate(params, seed).goodput for seed in seeds) / len(seeds)


def test_goodput_falls_as_the_mtbf_falls_and_the_interval_follows_it() -> None:
    # The same seeds at each MTBF: the goodput curve is the MTBF's doing, not the dice's.
    mtbfs = [LLAMA3_MTBF_S * 16_384 / 3600 * factor for factor in (0.25, 0.5, 1.0, 2.0, 4.0)]
    outcomes = [[simulate(replace(llama3(), gpu_mtbf_h=m), seed) for seed in range(4)]
                for m in mtbfs]  # fmt: skip
    goodputs = [sum(o.goodput for o in runs) / len(runs) for runs in outcomes]
    assert goodputs == sorted(goodputs) and len(set(goodputs)) == len(goodputs), goodputs
    # The supervisor's (Daly) interval grows as the square root of the MTBF, so
    # quadrupling the MTBF about doubles the interval the job actually used.
    intervals = [sum(o.mean_interval_s for o in runs) / len(runs) for runs in outcomes]
    assert intervals == sorted(intervals), intervals
    assert intervals[4] / intervals[2] == pytest.approx(2.0, rel=0.15)
    assert intervals[2] / intervals[0] == pytest.approx(2.0, rel=0.15)


def test_goodput_falls_as_the_save_stall_grows() -> None:
    stalls = [5.0, 30.0, 120.0, 600.0]
    goodputs = [mean_goodput(replace(llama3(), save_stall_s=stall)) for stall in stalls]
    assert goodputs == sorted(goodputs, reverse=True), goodputs
    assert len(set(goodputs)) == len(goodputs), goodputs


def test_without_faults_goodput_is_the_closed_form_share_of_stalls() -> None:
    # No fault in the run: every interval pays one stall and nothing else.
    for stall, interval in ((5.0, 600.0), (60.0, 1800.0), (300.0, 7200.0)):
        params = fixed(replace(llama3(), save_stall_s=stall, write_s=0.0, gpu_mtbf_h=1e12),
                       interval)  # fmt: skip
        outcome = simulate(params)
        assert interruptions(outcome) == 0
        assert outcome.goodput == pytest.approx(interval / (interval + stall), abs=2e-4)


# --- OPT-175B ------------------------------------------------------------------


def test_opt175b_logbook_restarts_every_12_to_13_hours_are_reproduced() -> None:
    outcome = simulate(opt175b(), seed=0)
    count = interruptions(outcome)
    assert 80 <= count <= 130  # the logbook: 105-plus over two months
    assert 11.0 <= outcome.accounting.wall_s / 3600 / count <= 16.0


def test_opt175b_scale_needs_its_own_failure_rate_not_llama3s() -> None:
    # Llama 3's per-GPU rate on OPT-175B's 992 GPUs gives about 28 in two
    # months: the logbook's count is not a matter of scale alone.
    count = interruptions(simulate(replace(opt175b(), gpu_mtbf_h=llama3().gpu_mtbf_h), seed=0))
    assert count < 60


# --- policies and recovery paths -----------------------------------------------


def test_each_interval_policy_uses_the_interval_code() -> None:
    mtbf = llama3().job_mtbf_s()
    young = simulate(replace(llama3(), interval_policy=IntervalPolicy.YOUNG, days=5))
    daly = simulate(replace(llama3(), days=5))
    assert young.mean_interval_s == pytest.approx(young_interval_s(5.0, mtbf))
    assert daly.mean_interval_s == pytest.approx(recommended_interval_s(5.0, 120.0, mtbf))
    # A write longer than Daly's interval raises the recommended one above it.
    slow = simulate(replace(llama3(), write_s=600.0, days=5))
    assert slow.mean_interval_s == pytest.approx(1.1 * 600.0)


def test_adaptive_policy_converges_from_a_bad_start_like_the_daemon() -> None:
    start = 4 * 3600.0
    adaptive = simulate(
        replace(llama3(), interval_policy=IntervalPolicy.ADAPTIVE, interval_s=start)
    )
    daly = simulate(llama3())
    assert adaptive.final_interval_s < start / 10
    # The daemon counts node faults only (not user exceptions): it lands a
    # little above the interval for the true MTBF.
    assert 0.95 < adaptive.final_interval_s / daly.mean_interval_s < 1.25
    assert adaptive.goodput > daly.goodput - 0.01
    stuck = simulate(fixed(llama3(), start))
    assert adaptive.goodput > stuck.goodput + 0.1


def small_job(**changes: object) -> Params:
    """8 nodes failing about every 6 hours, nodes repaired in 2 days."""
    base = Params(gpus=64, days=200, gpu_mtbf_h=64 * 6, spare_nodes=0, repair_s=2 * 86400)
    return replace(base, **changes)  # type: ignore[arg-type]


def test_without_spares_or_room_to_shrink_every_node_fault_waits_in_the_queue() -> None:
    gpu_faults_only = (replace(sim.LLAMA3_MIX[0], share=1.0),)
    outcome = simulate(small_job(mix=gpu_faults_only))
    assert interruptions(outcome) > 100
    assert outcome.queued == interruptions(outcome)
    queue_wait = outcome.accounting.badput_s[Badput.QUEUE_WAIT]
    # Log-normal waits of median 10 min, shape 1: a mean of 10 min * e^0.5.
    assert queue_wait / outcome.queued == pytest.approx(600 * math.exp(0.5), rel=0.2)
    assert outcome.grows == 0


def test_spare_nodes_replace_failed_ones_without_queueing() -> None:
    outcome = simulate(small_job(spare_nodes=50))
    assert outcome.queued == 0
    assert outcome.accounting.badput_s[Badput.QUEUE_WAIT] == 0
    assert outcome.useful_work_share == pytest.approx(outcome.goodput)


def test_a_job_that_may_shrink_runs_smaller_and_grows_back_after_repairs() -> None:
    grows = simulate(small_job(min_nodes=4, repair_s=12 * 3600))
    stays_small = simulate(small_job(min_nodes=4, repair_s=12 * 3600, grow_back=False))
    # Shrinking is the rule, the queue the exception (more than 4 nodes out at once).
    assert grows.queued < interruptions(grows) / 50
    assert grows.grows > interruptions(grows) / 2
    assert Cause.GROW.value in grows.accounting.by_fault_cause_s
    assert grows.useful_work_share < grows.goodput
    # Without growing back, the job only regains size when a fault relaunches it.
    assert stays_small.grows == 0
    assert stays_small.useful_work_share < grows.useful_work_share - 0.05


# --- invariants ----------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        llama3(),
        opt175b(),
        small_job(),
        small_job(min_nodes=4, unit_nodes=2),
        small_job(spare_nodes=1),
    ],
    ids=["llama3", "opt175b", "queue", "shrink", "one-spare"],
)
def test_productive_time_and_badput_add_up_to_the_wall_time(params: Params) -> None:
    accounting = simulate(params, seed=3).accounting
    assert accounting.wall_s == params.days * 86400
    total = accounting.productive_s + sum(accounting.badput_s.values())
    assert total == pytest.approx(accounting.wall_s, rel=1e-9)
    assert all(seconds >= 0 for seconds in accounting.badput_s.values())
    fault_badput = sum(
        accounting.badput_s[kind] for kind in (Badput.LOST_WORK, Badput.DETECTION, Badput.RECOVERY)
    )
    assert sum(accounting.by_fault_cause_s.values()) == pytest.approx(fault_badput, rel=1e-9)


def test_the_same_seed_gives_the_same_run_and_another_seed_another() -> None:
    assert simulate(llama3(), seed=7) == simulate(llama3(), seed=7)
    assert simulate(llama3(), seed=7) != simulate(llama3(), seed=8)


def stepped(t: float, interval: float, stall: float, write: float) -> tuple[float, float]:
    """Stall and lost work by ``t``, save by save (the closed form's reference)."""
    blocks: list[tuple[float, float]] = []  # (due, block end)
    commits: list[tuple[float, float]] = []  # (commit, due)
    now, last_commit = 0.0, -math.inf
    while now + interval < t:
        due = now + interval
        end = max(due, last_commit) + stall
        blocks.append((due, end))
        last_commit = end + write
        commits.append((last_commit, due))
        now = end

    def blocked(a: float, b: float) -> float:
        return sum(max(0.0, min(b, end) - max(a, due)) for due, end in blocks)

    done = [due for commit, due in commits if commit <= t]
    since = done[-1] if done else 0.0
    return blocked(0.0, t), (t - since) - blocked(since, t)


@pytest.mark.parametrize(
    ("t", "stalled", "lost"),
    [
        # Every 100 s of training, a 5 s stall, then a 50 s write: save 1 is
        # due at 100, blocks until 105 and commits at 155; save 2 is due at 205.
        (99.0, 0.0, 99.0),
        (103.0, 3.0, 100.0),  # stalled in save 1: nothing committed yet
        (130.0, 5.0, 125.0),  # save 1 still writing: its interval is lost too
        (160.0, 5.0, 55.0),  # save 1 committed: only what came after its step
        (208.0, 8.0, 100.0),  # stalled in save 2
    ],
)
def test_a_fault_before_the_background_write_ends_loses_that_save_too(
    t: float, stalled: float, lost: float
) -> None:
    saves = Saves.of(100.0, 5.0, 50.0)
    assert saves.stalled(t) == pytest.approx(stalled)
    assert saves.lost(t) == pytest.approx(lost)


def test_a_save_due_while_the_previous_write_runs_waits_for_it() -> None:
    # Every 60 s with a 100 s write: save 2 is due at 125, waits until 165
    # (save 1's commit), then stalls 5 s.
    saves = Saves.of(60.0, 5.0, 100.0)
    assert saves.block_end(2) == pytest.approx(170.0)
    assert saves.stalled(170.0) == pytest.approx(5.0 + 45.0)


@settings(max_examples=300, deadline=None)
@given(
    interval=st.floats(1, 100),
    stall=st.floats(0.1, 20),
    write=st.one_of(st.just(0.0), st.floats(0, 200)),
    t=st.floats(0, 2000),
)
def test_closed_form_saves_match_stepping_save_by_save(
    interval: float, stall: float, write: float, t: float
) -> None:
    saves = Saves.of(interval, stall, write)
    stalled, lost = stepped(t, interval, stall, write)
    assert saves.stalled(t) == pytest.approx(stalled, abs=1e-6)
    assert saves.lost(t) == pytest.approx(lost, abs=1e-6)
    save, commit = saves.first_commit_after(t)
    assert commit >= t - 1e-9
    assert saves.lost(commit, committed=save) == pytest.approx(
        commit - saves.due(save) - (saves.stalled(commit) - saves.stalled(saves.due(save)))
    )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"gpus": 0}, "gpus"),
        ({"gpus": 12}, "gpus"),
        ({"gpu_mtbf_h": -1.0}, "gpu_mtbf_h"),
        ({"save_stall_s": 0.0}, "save_stall_s"),
        ({"min_nodes": 5000}, "min_nodes"),
        ({"unit_nodes": 3}, "unit_nodes"),
        ({"mix": ()}, "mix"),
    ],
)
def test_bad_parameters_are_refused_naming_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(sim.BadParameter) as refused:
        replace(llama3(), **change)  # type: ignore[arg-type]
    assert refused.value.field == field


def test_the_simulator_sizes_relaunches_with_the_supervisors_own_rule() -> None:
    source = (REPO / "supervisor" / "core" / "simulate.py").read_text()
    modules = {
        node.module
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert "supervisor.core.recovery" in modules  # purity: tests/unit/project/test_purity.py


# --- CLI -----------------------------------------------------------------------


def test_cli_json_has_goodput_interval_interruptions_and_badput_by_cause(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["simulate", "--json", "--days", "10"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert 0 < document["goodput"] <= 1
    assert document["interval_s"] > 0
    assert isinstance(document["interruptions"], int)
    assert set(document["badput_s"]) == {kind.value for kind in Badput}
    assert sum(document["interruptions_by_cause"].values()) == document["interruptions"]
    assert set(document["badput_by_cause_s"]) <= {cause.value for cause in Cause}


def test_cli_flags_reach_the_simulation(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--json", "--preset", "opt175b", "--interval-policy", "fixed",
            "--interval-s", "900", "--mix", "software=1", "--seed", "2"]  # fmt: skip
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["gpus"] == 992
    assert document["interval_s"] == pytest.approx(900)
    assert set(document["interruptions_by_cause"]) == {"user_exception"}
    assert document["seed"] == 2


def test_cli_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "goodput.png"
    argv = ["simulate", "--plot", str(path), "--days", "20", "--sweep-points", "8",
            "--sweep-seeds", "1", "--json"]  # fmt: skip
    assert main(argv) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000
    document = json.loads(capsys.readouterr().out)
    assert len(document["sweep"]) == 8
    assert document["best_interval_s"] > 0


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--gpus", "0"], "--gpus"),
        (["--gpus", "12"], "--gpus"),
        (["--gpus", "many"], "--gpus"),
        (["--gpu-mtbf-h", "-5"], "--gpu-mtbf-h"),
        (["--days", "0"], "--days"),
        (["--save-stall-s", "nan"], "--save-stall-s"),
        (["--write-s", "-1"], "--write-s"),
        (["--idle-nodes", "-1"], "--idle-nodes"),
        # --spare-nodes: the old spelling of --idle-nodes, kept for scripts.
        (["--spare-nodes", "-1"], "--idle-nodes"),
        (["--mix", "gpu=-0.5"], "--mix"),
        (["--mix", "cosmic=1"], "--mix"),
        (["--min-nodes", "4096"], "--min-nodes"),
        (["--seed", "-1"], "--seed"),
        (["--spares", "-1"], "--spares"),
        (["--spares", "two"], "--spares"),
        (["--swap-s", "-1"], "--swap-s"),
        (["--swap-s", "inf"], "--swap-s"),
    ],
)
def test_cli_bad_input_names_the_flag_and_exits_two(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert flag in err
    assert "Traceback" not in err
    assert err.count("\n") == 1
