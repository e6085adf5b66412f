"""agent.node.launch: the user's command fitted to the current allocation, nothing else changed."""

from __future__ import annotations

from dataclasses import replace

import pytest
from torch.distributed.run import get_args_parser

from agent.node.launch import (
    ENV_ALLOCATION,
    Allocation,
    LaunchSettings,
    Shape,
    allocation_from_env,
    is_torchrun,
    launch_shape,
    plan_launch,
    refusal,
    slurm_task_env,
    torchrun_env,
    torchrun_shim,
)
from agent.wire.errors import ConfigError

ALLOC = Allocation(
    job_id="42", node="node2", nnodes=3, node_rank=1, master_addr="10.0.0.1",
    master_port=29811, restart_count=2, launch_nonce="a1",
)  # fmt: skip
SETTINGS = LaunchSettings(
    agent_socket="/run/a.sock", exit_dir="/run/exits", resume_from="/c/s-20",
    procs_per_node=2, shim_dir="/run/bin",
)  # fmt: skip
PY = "/venv/bin/python"
FITTED = (
    "--nnodes=3", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29811",
    "--rdzv-id=resurgo-42-2-a1", "--max-restarts=0", "--no-python", PY, "-m", "agent.node.rankexec",
)  # fmt: skip


def plan(command: list[str]):  # type: ignore[no-untyped-def]
    return plan_launch(command, ALLOC, SETTINGS, {"PATH": "/bin:/usr/bin"}, PY, get_args_parser())


def test_torchrun_gets_the_current_node_count_and_a_fresh_rendezvous() -> None:
    result = plan(["torchrun", "--nproc-per-node=4", "--nnodes", "4", "train.py", "--lr", "3"])
    assert result.argv == (
        PY, "-m", "torch.distributed.run", "--nproc-per-node=4", "--nnodes=3",
        "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29811", "--rdzv-id=resurgo-42-2-a1",
        "--max-restarts=0", "--no-python", PY, "-m", "agent.node.rankexec", "train.py", "--lr", "3",
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


@pytest.mark.parametrize(("node", "is_host"), [("node1", "true"), ("node2", "false")])
def test_the_named_first_node_alone_hosts_the_rendezvous_store(node: str, is_host: str) -> None:
    """Told nothing, every torchrun whose host matches the endpoint (any of them, for a
    loopback address) tries to host the store; the agent names the one that does, and a
    user's own ``is_host`` gives way while the rest of their settings stay."""
    allocation = replace(ALLOC, node=node, rdzv_host=node == "node1")
    command = ["torchrun", "--nproc-per-node=2", "--rdzv-conf", "join_timeout=90,is_host=1", "t.py"]
    result = plan_launch(command, allocation, SETTINGS, {}, PY, get_args_parser())
    confs = [token for token in result.argv if token.startswith("--rdzv-conf")]
    assert confs == [f"--rdzv-conf=join_timeout=90,is_host={is_host}"]
    assert "join_timeout=90,is_host=1" not in result.argv
    assert torchrun_env(allocation)["PET_RDZV_CONF"] == f"is_host={is_host}"
    wrapper_env = torchrun_env(allocation, "join_timeout=90,is_host=1")
    assert wrapper_env["PET_RDZV_CONF"] == f"join_timeout=90,is_host={is_host}"


def test_a_static_rendezvous_gives_torchrun_its_node_rank_and_polls_no_store() -> None:
    """Where the driver knows the node order, each node's rank is its place in it (the
    store's host 0): torchrun's static backend, with no ``is_host`` and the user's
    ``join_timeout`` as its wait for the nodes."""
    static = replace(ALLOC, rdzv_host=False, static=True)
    command = ["torchrun", "--nproc-per-node=2", "--rdzv-conf", "join_timeout=90,is_host=1", "t.py"]
    result = plan_launch(command, static, SETTINGS, {}, PY, get_args_parser())
    options = result.argv[3 : result.argv.index("--no-python")]
    assert options == (
        "--nproc-per-node=2", "--nnodes=3", "--rdzv-backend=static",
        "--rdzv-endpoint=10.0.0.1:29811", "--rdzv-id=resurgo-42-2-a1", "--node-rank=1",
        "--rdzv-conf=join_timeout=90,timeout=90", "--max-restarts=0",
    )  # fmt: skip
    # torchrun itself reads them so: node rank 1 of a static world at the endpoint.
    args = get_args_parser().parse_args([*options, "t.py"])
    assert (args.rdzv_backend, args.node_rank, args.nnodes) == ("static", 1, "3")
    env = torchrun_env(static, "timeout=30,is_host=0")
    assert env["PET_RDZV_BACKEND"] == "static" and env["PET_NODE_RANK"] == "1"
    assert env["PET_RDZV_CONF"] == "timeout=30"
    assert allocation_from_env(plan(["bash", "run.sh"]).env) == ALLOC
    assert "PET_NODE_RANK" not in torchrun_env(ALLOC)  # c10d ranks the nodes itself


def test_without_a_named_host_torchrun_keeps_its_own_guess_and_the_users_settings() -> None:
    result = plan(["torchrun", "--nproc-per-node=2", "--rdzv_conf=join_timeout=90", "t.py"])
    assert [t for t in result.argv if "rdzv-conf" in t or "rdzv_conf" in t] == [
        "--rdzv-conf=join_timeout=90"
    ]
    assert not any(
        "rdzv" in t and "conf" in t for t in plan(["torchrun", "--nproc-per-node=2", "t.py"]).argv
    )
    assert "PET_RDZV_CONF" not in torchrun_env(ALLOC)


def test_script_arguments_that_look_like_torchrun_options_pass_through() -> None:
    result = plan(["torchrun", "--nproc-per-node=1", "train.py", "--nnodes", "9", "-m", "x"])
    assert result.argv[-5:] == ("train.py", "--nnodes", "9", "-m", "x")


def test_module_and_no_python_forms_reach_the_rank_shim() -> None:
    module = plan(
        ["python3", "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "pkg.train"]
    )
    assert module.argv[-3:] == ("agent.node.rankexec", "--module", "pkg.train")
    binary = plan(["torchrun", "--nproc-per-node=2", "--no-python", "./train.sh", "a"])
    assert binary.argv[-4:] == ("agent.node.rankexec", "--no-python", "./train.sh", "a")


def test_environment_tells_the_in_rank_library_where_things_are() -> None:
    env = plan(["torchrun", "--nproc-per-node=1", "t.py"]).env
    assert env["RESURGO_JOB_ID"] == "42"
    assert env["RESURGO_AGENT_SOCKET"] == "/run/a.sock"
    assert env["RESURGO_RESUME_FROM"] == "/c/s-20"
    assert env["RESURGO_RESTART_COUNT"] == "2"
    assert env["PATH"] == "/bin:/usr/bin"
    assert "RESURGO_CKPT_ROOT" not in env


@pytest.mark.parametrize("command", [["torchrun", "--nproc-per-node=1", "t.py"], ["bash", "r.sh"]])
def test_the_ranks_skip_this_launchs_windows_and_never_a_stale_value(command: list[str]) -> None:
    stale = {"PATH": "/bin", "RESURGO_SKIP_SAMPLES": "0:8"}
    skipping = replace(SETTINGS, skip_samples=((64, 128), (512, 520)))
    env = plan_launch(command, ALLOC, skipping, stale, PY, get_args_parser()).env
    assert env["RESURGO_SKIP_SAMPLES"] == "64:128,512:520"
    assert (
        "RESURGO_SKIP_SAMPLES"
        not in plan_launch(command, ALLOC, SETTINGS, stale, PY, get_args_parser()).env
    )


def test_a_wrapper_runs_unchanged_and_any_torchrun_below_it_gets_the_jobs_world() -> None:
    result = plan(["bash", "run.sh", "--fast"])
    assert result.argv == ("bash", "run.sh", "--fast")
    assert result.shape is Shape.WRAPPER and not result.is_torchrun
    assert result.local_ranks is None  # learnt from the ranks' LOCAL_WORLD_SIZE
    # `torchrun` on its PATH is Resurgo's; python -m torch.distributed.run reads PET_*.
    assert result.env["PATH"] == "/run/bin:/bin:/usr/bin"
    assert {key: value for key, value in result.env.items() if key.startswith("PET_")} == {
        "PET_NNODES": "3",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": "10.0.0.1:29811",
        "PET_RDZV_ID": "resurgo-42-2-a1",
        "PET_MAX_RESTARTS": "0",
    }
    assert allocation_from_env(result.env) == ALLOC
    assert "RESURGO_SLURM_TASKS" not in result.env


def test_resurgos_torchrun_runs_the_shim_module_with_the_agents_python() -> None:
    assert torchrun_shim("/opt/my venv/bin/python") == (
        "#!/bin/sh\nexec '/opt/my venv/bin/python' -m agent.node.torchrunshim \"$@\"\n"
    )


def test_an_allocation_missing_from_the_environment_says_where_resurgos_torchrun_runs() -> None:
    with pytest.raises(ConfigError, match="only below a node agent"):
        allocation_from_env({})
    with pytest.raises(ConfigError, match="unreadable"):
        allocation_from_env({ENV_ALLOCATION: '{"job_id": 1}'})


def test_srun_style_starts_one_process_per_rank_through_the_fitted_torchrun() -> None:
    result = plan(["srun", "-u", "--ntasks-per-node", "4", "--mpi=none", "python", "-u", "t.py"])
    assert result.shape is Shape.PER_RANK and result.is_torchrun and result.local_ranks == 4
    assert result.argv == (
        PY, "-m", "torch.distributed.run", "--nproc-per-node=4", *FITTED,
        "--no-python", "python", "-u", "t.py",
    )  # fmt: skip
    assert result.env["RESURGO_SLURM_TASKS"] == "1"


def test_srun_ntasks_is_split_over_the_nodes_and_the_jobs_count_is_the_default() -> None:
    assert plan(["srun", "-n6", "python", "t.py"]).local_ranks == 2  # 6 over 3 nodes
    assert plan(["srun", "python", "t.py"]).local_ranks == 2  # SETTINGS.procs_per_node
    with pytest.raises(ConfigError, match="does not split evenly"):
        plan(["srun", "--ntasks=4", "python", "t.py"])


def test_a_plain_python_script_runs_its_ranks_per_node_like_srun_would() -> None:
    result = plan(["python3", "train.py", "--lr", "3"])
    assert result.shape is Shape.PER_RANK and result.local_ranks == 2
    assert result.argv[-6:] == (
        "agent.node.rankexec",
        "--no-python",
        "python3",
        "train.py",
        "--lr",
        "3",
    )
    assert launch_shape(["./train.py"]) is Shape.PER_RANK
    assert launch_shape(["python", "-c", "import x"]) is Shape.WRAPPER
    assert launch_shape(["make", "train"]) is Shape.WRAPPER


def test_each_rank_of_a_per_rank_launch_gets_the_slurm_task_variables_of_its_rank() -> None:
    torchrun_env = {"RANK": "5", "LOCAL_RANK": "1", "GROUP_RANK": "2", "WORLD_SIZE": "6",
                    "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "3"}  # fmt: skip
    assert slurm_task_env(torchrun_env) == {
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_NTASKS": "6",
        "SLURM_NPROCS": "6",
        "SLURM_STEP_NUM_TASKS": "6",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_TASKS_PER_NODE": "2(x3)",
    }


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["mpirun", "-np", "8", "python", "t.py"], "mpirun is an MPI launcher"),
        (["/usr/bin/deepspeed", "t.py"], "DeepSpeed's launcher"),
        (["srun", "--cpu-bind=cores", "python", "t.py"], "srun option '--cpu-bind=cores'"),
        (["srun", "-w", "node1", "python", "t.py"], "srun option '-w'"),
        (["srun", "-u"], "srun with no command"),
        (["srun", "-n", "5", "python", "t.py"], "does not split evenly over 2 nodes"),
        ([], "no command"),
    ],
)
def test_commands_resurgo_cannot_supervise_are_refused_with_what_to_do(
    command: list[str], message: str
) -> None:
    found = refusal(command, nnodes=2)
    assert found is not None and message in found


@pytest.mark.parametrize(
    "command",
    [["torchrun", "t.py"], ["bash", "run.sh"], ["srun", "-n", "4", "python", "t.py"],
     ["python", "t.py"]],
)  # fmt: skip
def test_every_supported_shape_is_accepted(command: list[str]) -> None:
    assert refusal(command, nnodes=2) is None


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


def test_the_bootstrap_directory_put_first_on_the_ranks_path_holds_the_sitecustomize() -> None:
    # A wrong path arms nothing and raises nothing: ranks of unmodified scripts
    # would run without automatic progress, and their hangs go unseen.
    from pathlib import Path

    from agent.node.launch import BOOTSTRAP_DIR

    assert (Path(BOOTSTRAP_DIR) / "sitecustomize.py").is_file(), BOOTSTRAP_DIR


@pytest.mark.parametrize("command", [["torchrun", "--nproc-per-node=1", "t.py"], ["bash", "r.sh"]])
def test_torchrun_logs_in_the_run_directory_unless_the_user_said_where(command: list[str]) -> None:
    """Without a log directory torchrun makes a /tmp/torchelastic_* one at every start and
    leaves it; in the agent's run directory it goes with the launch."""
    settings = replace(SETTINGS, torchrun_log_dir="/run/torchrun")
    env = plan_launch(command, ALLOC, settings, {"PATH": "/bin"}, PY, get_args_parser()).env
    assert env["PET_LOG_DIR"] == "/run/torchrun"
    own = {"PATH": "/bin", "PET_LOG_DIR": "/var/log/elastic"}
    env = plan_launch(command, ALLOC, settings, own, PY, get_args_parser()).env
    assert env["PET_LOG_DIR"] == "/var/log/elastic"
