"""`resurgo submit`: option pass-through, what Resurgo reads from sbatch options, the script."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agent.wire.errors import ConfigError
from supervisor.cli.main import main
from supervisor.cli.submit import build_parser, spec_from
from supervisor.jobs import JobSpec, batch_script, sbatch_options
from supervisor.sbatch import directives_of, parse_request, procs_per_node, training_script
from tests.paths import TESTS

GOLDEN = TESTS / "fixtures" / "submit" / "batch.sh"


def spec(**changes: object) -> JobSpec:
    values: dict[str, object] = {
        "name": "llm",
        "nodes": 4,
        "command": ("torchrun", "--nproc-per-node=8", "train.py", "--note", 'it\'s a "test"'),
        "ckpt_root": "/ckpt/llm",
        "min_nodes": 2,
        "procs_per_node": 8,
        "supervisor_url": "http://head01:8740",
        "python": "/opt/resurgo/bin/python",
        "sbatch_options": ("--gres=gpu:8", "--comment", "two words"),
        "directives": ("--account=ml", "--time=2-00:00:00"),
    }
    values.update(changes)
    return JobSpec(**values)  # type: ignore[arg-type]


def test_the_rendered_batch_script_matches_the_golden_file() -> None:
    rendered = batch_script(spec(), "/shared/resurgo/jobs")
    assert rendered == GOLDEN.read_text(), f"rendered script changed:\n{rendered}"


@pytest.mark.parametrize(
    ("options", "nodes", "minimum"),
    [
        (["-N", "4"], 4, None),
        (["-N4"], 4, None),
        (["--nodes=4"], 4, None),
        (["--nodes", "4"], 4, None),
        (["--nodes=2-4"], 4, 2),
        (["-J", "x", "--time", "10"], 1, None),  # sbatch's default: one node
    ],
)
def test_the_node_count_is_read_from_every_form_sbatch_accepts(
    options: list[str], nodes: int, minimum: int | None
) -> None:
    request = parse_request(options)
    assert (request.nodes, request.min_nodes) == (nodes, minimum)


def test_options_pass_through_verbatim_with_resurgos_additions_after_them() -> None:
    user = ["--comment", "a b 'c'", "--gres=gpu:8", "--dependency=afterok:41", "-N", "4"]
    argv = sbatch_options(spec(sbatch_options=tuple(user), directives=()))
    assert argv[: len(user)] == user
    assert argv[len(user) :] == [
        "--job-name=llm",
        "--requeue",
        "--open-mode=append",
        "--ntasks-per-node=1",
        "--signal=B:USR1@180",
    ]


def test_the_users_own_name_tasks_and_signal_are_kept() -> None:
    user = ("-J", "mine", "--ntasks-per-node=8", "--signal=B:USR1@60", "--nodes=2",
            "--open-mode=truncate")  # fmt: skip
    argv = sbatch_options(spec(sbatch_options=user, directives=()))
    assert argv == [*user, "--requeue"]


def test_script_directives_are_read_and_command_line_options_win() -> None:
    text = (
        "#!/bin/bash\n#SBATCH -N 8\n#SBATCH --job-name='big run'  # a comment\n\n"
        "srun x\n#SBATCH -N 9\n"  # after the first command: not a directive, as for sbatch
    )
    directives = directives_of(text)
    assert directives == ("-N", "8", "--job-name=big run")
    assert parse_request([], directives).nodes == 8
    assert parse_request(["--nodes=4"], directives).nodes == 4
    assert parse_request([], directives).job_name == "big run"


@pytest.mark.parametrize("options", [["--array=0-3"], ["-a", "1,2"], ["--array", "5"]])
def test_job_arrays_are_refused_with_the_reason(options: list[str]) -> None:
    with pytest.raises(ConfigError, match="job arrays are not supported: every array task"):
        parse_request(options)


@pytest.mark.parametrize("value", ["four", "4-2", ""])
def test_a_node_count_that_is_not_one_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="--nodes"):
        parse_request([f"--nodes={value}"])


def test_torchruns_procs_per_node_and_the_script_are_found() -> None:
    command = ["torchrun", "--nnodes=4", "--nproc_per_node", "8", "train.py", "--lr", "3"]
    assert procs_per_node(command) == 8
    assert training_script(command) == "train.py"
    assert procs_per_node(["python", "x.py"]) is None


def test_dry_run_prints_the_script_and_the_sbatch_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    status = main(
        ["submit", "-N", "2", "--comment", "a b", "--ckpt-root", str(tmp_path / "ck"),
         "--state-dir", str(tmp_path / "state"), "--dry-run", "--",
         sys.executable, str(script)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0
    assert out.startswith("#!/bin/bash\n")
    assert "-m agent.driver" in out
    assert "# sbatch --parsable --hold -N 2 --comment 'a b' --job-name=train --requeue " in out
    assert "--open-mode=append" in out
    assert not (tmp_path / "state").exists()  # nothing submitted, nothing written


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--ckpt-root", "/c", "--", "torchrun", "nowhere.py"],
            "training script nowhere.py not found",
        ),
        (["--ckpt-root", "/c", "--array=1-2", "--", "true"], "job arrays are not supported"),
        (["--ckpt-root", "/c"], "no training command after --"),
        (["--", "true"], "where should checkpoints go?"),
        (
            ["--ckpt-root", "/c", "--script", "/no/such.sbatch", "--", "true"],
            "cannot read --script",
        ),
        (["--ckpt-root", "/c", "--no-requeue", "--", "true"], "drop --no-requeue"),
        (["--ckpt-root", "/c", "--signal=B:USR2@60", "--", "true"], "--signal=B:USR1@SECONDS"),
        (["--ckpt-root", "/c", "--signal=USR1@60", "--", "true"], "sent to the steps"),
        (["--ckpt-root", "/c", "-o", "/no/such/dir/%j.out", "--", "true"], "does not exist"),
        (["--ckpt-root", "/c", "--error=/no/such/e.txt", "--", "true"], "create it first"),
        (["--ckpt-root", "/c", "--", "mpirun", "-np", "8", "x"], "mpirun is an MPI launcher"),
        (["--ckpt-root", "/c", "--", "srun", "--cpu-bind=cores", "x"], "is not applied"),
    ],
)
def test_user_mistakes_get_one_line_saying_what_to_do(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RESURGO_CKPT_ROOT", raising=False)
    status = main(["submit", *argv])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert len(err.splitlines()) == 1 and message in err, err


def test_without_slurm_on_path_submit_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    status = main(["submit", "--ckpt-root", "/c", "--", "true"])
    assert status == 1
    assert "sbatch is not on PATH" in capsys.readouterr().err


def test_a_script_with_commands_is_refused_since_only_its_sbatch_lines_are_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --time=1:00:00\n\nsrun python train.py\n")
    status = main(["submit", "--ckpt-root", "/c", "--script", str(script), "--dry-run", "--",
                   "true"])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2 and "its commands would not run (first: 'srun python train.py')" in err
    script.write_text("#!/bin/bash\n#SBATCH --time=1:00:00\n# a comment\n")
    assert main(["submit", "--ckpt-root", "/c", "--script", str(script), "--dry-run", "--",
                 "true"]) == 0  # fmt: skip


def test_paths_are_checked_from_the_jobs_chdir_and_patterns_are_left_to_slurm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train.py").write_text("")
    (tmp_path / "run" / "logs").mkdir()
    ok = main(["submit", "--ckpt-root", "/c", f"--chdir={tmp_path / 'run'}", "-o",
               "logs/%j.out", "-e", "%x-%j/err", "--dry-run", "--", "torchrun",
               "train.py"])  # fmt: skip
    assert ok == 0, capsys.readouterr().err
    missing = main(["submit", "--ckpt-root", "/c", "-D", str(tmp_path), "--dry-run", "--",
                    "torchrun", "train.py"])  # fmt: skip
    assert missing == 2 and f"not found (from {tmp_path})" in capsys.readouterr().err


def test_an_srun_style_command_takes_its_ranks_per_node_from_srun_or_the_job() -> None:
    from supervisor.cli.submit import ranks_per_node

    request = parse_request(["-N", "2", "--ntasks-per-node=4"])
    assert ranks_per_node(["srun", "python", "t.py"], request) == 4
    assert ranks_per_node(["srun", "-n", "2", "python", "t.py"], request) == 1
    assert ranks_per_node(["python", "t.py"], parse_request(["-N", "2", "-n", "6"])) == 3
    assert ranks_per_node(["torchrun", "--nproc-per-node=8", "t.py"], request) == 8
    assert ranks_per_node(["bash", "run.sh"], request) == 1


def test_a_node_range_starts_the_job_on_its_maximum_and_shrinks_to_its_minimum() -> None:
    argv = sbatch_options(spec(sbatch_options=("-N", "2-4"), directives=(), nodes=4, min_nodes=2))
    assert argv[:2] == ["-N", "2-4"] and "--nodes=4" in argv[2:]
    ranged_script = sbatch_options(spec(sbatch_options=(), directives=("--nodes=2-4",), nodes=4))
    assert "--nodes=4" in ranged_script
    assert "--nodes=4" not in sbatch_options(spec(sbatch_options=("-N", "4"), directives=()))


def test_spares_are_allocated_besides_the_world_and_the_driver_knows_the_worlds_size() -> None:
    argv = sbatch_options(spec(sbatch_options=("-N", "4"), directives=(), spares=1))
    assert argv[:2] == ["-N", "4"] and "--nodes=5" in argv[2:]  # the last count wins
    script = batch_script(spec(spares=2), "/shared/resurgo/jobs")
    assert "--world-nodes 4" in script
    assert "--world-nodes" not in batch_script(spec(), "/shared/resurgo/jobs")
    assert JobSpec.from_json(spec(spares=2).to_json()).spares == 2
    with pytest.raises(ConfigError, match="--spares must be >= 0"):
        spec(spares=-1)


def test_submit_takes_spares_from_its_command_line(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    args, rest = build_parser().parse_known_args(
        ["--spares", "2", "--ckpt-root", "/ckpt", "-N", "4"]
    )
    made = spec_from(args, rest, ["torchrun", str(tmp_path / "train.py")])
    assert (made.nodes, made.spares) == (4, 2)
    assert "--nodes=6" in sbatch_options(made)
