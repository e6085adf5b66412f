"""agent.launch: the user's command fitted to the current allocation, nothing else changed."""

from __future__ import annotations

import pytest
from torch.distributed.run import get_args_parser

from agent.errors import ConfigError
from agent.launch import Allocation, LaunchSettings, is_torchrun, plan_launch

ALLOC = Allocation(
    job_id="42", node="node2", nnodes=3, node_rank=1, master_addr="10.0.0.1",
    master_port=29811, restart_count=2, launch_nonce="a1",
)  # fmt: skip
SETTINGS = LaunchSettings(agent_socket="/run/a.sock", exit_dir="/run/exits", resume_from="/c/s-20")
PY = "/venv/bin/python"


def plan(command: list[str]):  # type: ignore[no-untyped-def]
    return plan_launch(command, ALLOC, SETTINGS, {"PATH": "/bin"}, PY, get_args_parser())


def test_torchrun_gets_the_current_node_count_and_a_fresh_rendezvous() -> None:
    result = plan(["torchrun", "--nproc-per-node=4", "--nnodes", "4", "train.py", "--lr", "3"])
    assert result.argv == (
        PY, "-m", "torch.distributed.run", "--nproc-per-node=4", "--nnodes=3",
        "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29811", "--rdzv-id=resurgo-42-2-a1",
        "--max-restarts=0", "--no-python", PY, "-m", "agent.rankexec", "train.py", "--lr", "3",
    )  # fmt: skip
    assert result.is_torchrun and result.local_ranks == 4


def test_user_rendezvous_and_restart_options_are_replaced_not_duplicated() -> None:
    result = plan([
        "/usr/bin/torchrun", "--standalone", "--max_restarts=3", "--rdzv-backend", "static",
        "--master-port", "1234", "--nproc_per_node", "2", "--log-dir", "/logs", "t.py",
    ])  # fmt: skip
    options = result.argv[3 : result.argv.index("--no-python")]
    assert "--standalone" not in options and "1234" not in options and "static" not in options
    assert options[:4] == ("--nproc_per_node", "2", "--log-dir", "/logs")
    assert options.count("--max-restarts=0") == 1


def test_script_arguments_that_look_like_torchrun_options_pass_through() -> None:
    result = plan(["torchrun", "--nproc-per-node=1", "train.py", "--nnodes", "9", "-m", "x"])
    assert result.argv[-5:] == ("train.py", "--nnodes", "9", "-m", "x")


def test_module_and_no_python_forms_reach_the_rank_shim() -> None:
    module = plan(
        ["python3", "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "pkg.train"]
    )
    assert module.argv[-3:] == ("agent.rankexec", "--module", "pkg.train")
    binary = plan(["torchrun", "--nproc-per-node=2", "--no-python", "./train.sh", "a"])
    assert binary.argv[-4:] == ("agent.rankexec", "--no-python", "./train.sh", "a")


def test_environment_tells_the_in_rank_library_where_things_are() -> None:
    env = plan(["torchrun", "--nproc-per-node=1", "t.py"]).env
    assert env["RESURGO_JOB_ID"] == "42"
    assert env["RESURGO_AGENT_SOCKET"] == "/run/a.sock"
    assert env["RESURGO_RESUME_FROM"] == "/c/s-20"
    assert env["RESURGO_RESTART_COUNT"] == "2"
    assert env["PATH"] == "/bin"
    assert "RESURGO_CKPT_ROOT" not in env


def test_any_other_command_runs_unchanged_as_one_rank() -> None:
    result = plan(["bash", "-c", "python train.py"])
    assert result.argv == ("bash", "-c", "python train.py")
    assert not result.is_torchrun and result.local_ranks == 1


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ([], "no command"),
        (["torchrun", "--nproc-per-node=gpu", "t.py"], "explicit number of ranks"),
        (["torchrun", "--nproc-per-node=2"], "do not parse"),
    ],
)
def test_bad_commands_say_what_to_do(command: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan(command)


def test_allocation_rejects_a_node_rank_outside_the_job() -> None:
    with pytest.raises(ConfigError, match="outside"):
        Allocation(job_id="1", node="n", nnodes=2, node_rank=2, master_addr="a", master_port=1)


def test_torchrun_is_recognised_in_both_spellings() -> None:
    assert is_torchrun(["torchrun", "x.py"])
    assert is_torchrun(["python3.11", "-m", "torch.distributed.run", "x.py"])
    assert not is_torchrun(["python", "x.py"])
