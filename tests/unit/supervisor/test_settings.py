"""Layered settings: TOML < environment < flags, types converted, mistakes named."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.node.config import load_config as load_agent_config
from agent.wire.errors import ConfigError
from supervisor.config import load_config
from supervisor.core.intents import ValidationLevel


def test_supervisor_settings_come_from_toml_then_environment_then_flags(tmp_path: Path) -> None:
    config_file = tmp_path / "supervisor.toml"
    config_file.write_text(
        'state_dir = "/srv/resurgo"\nlisten_port = 9000\npoll_s = 5\n'
        '[policy]\nmax_drain_share_per_hour = 0.25\nvalidation_level = "quick"\n'
        "straggler_drain = true\n"
    )
    environ = {"RESURGO_SUPERVISOR_LISTEN_PORT": "9100", "RESURGO_POLICY_BACKOFF_BASE_S": "3"}
    config, policy = load_config(
        ["--config", str(config_file), "--poll-s", "1.5", "--policy-drain-confidence", "0.7"],
        environ,
    )
    assert config.state_dir == "/srv/resurgo"
    assert config.listen_port == 9100  # environment over TOML
    assert config.poll_s == 1.5  # flag over TOML
    assert config.store_path == Path("/srv/resurgo/resurgo.db")
    assert policy.max_drain_share_per_hour == 0.25
    assert policy.validation_level is ValidationLevel.QUICK
    assert policy.straggler_drain is True
    assert policy.backoff_base_s == 3.0
    assert policy.drain_confidence == 0.7


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        ([], {"RESURGO_SUPERVISOR_POLL_S": "soon"}, "poll_s must be a float"),
        ([], {"RESURGO_SUPERVISOR_POLL_S": "0"}, "poll_s must be > 0"),
        (["--policy-validation-level", "deep"], {}, "invalid choice"),
        ([], {"RESURGO_POLICY_VALIDATION_LEVEL": "deep"}, "one of 'quick', 'full', 'load'"),
        ([], {"RESURGO_POLICY_STRAGGLER_DRAIN": "perhaps"}, "must be a bool"),
        ([], {"RESURGO_POLICY_MAX_DRAIN_SHARE_PER_HOUR": "2"}, "a share, at most 1"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(
    argv: list[str], environ: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises((ConfigError, SystemExit)) as raised:
        load_config(argv, environ)
    text = str(raised.value) + capsys.readouterr().err
    assert message in text


def test_an_unknown_toml_key_names_the_key_and_the_file(tmp_path: Path) -> None:
    config_file = tmp_path / "supervisor.toml"
    config_file.write_text("[policy]\nmax_drains = 3\n")
    with pytest.raises(ConfigError, match=r"unknown policy setting 'max_drains' in \[policy\]"):
        load_config(["--config", str(config_file)], {})
    config_file.write_text("this is not toml = = \n")
    with pytest.raises(ConfigError, match="cannot read supervisor config"):
        load_config(["--config", str(config_file)], {})


def test_agent_settings_take_slurm_environment_under_explicit_ones() -> None:
    config, command = load_agent_config(
        ["--hang-k", "3", "--attempt", "2", "--", "torchrun", "train.py"],
        {
            "SLURM_JOB_ID": "77",
            "SLURM_NODEID": "1",
            "SLURM_STEP_NUM_NODES": "3",
            "RESURGO_AGENT_NNODES": "2",
        },
    )
    assert (config.job_id, config.node_rank, config.nnodes) == ("77", 1, 2)
    assert (config.hang_k, config.attempt) == (3.0, 2)
    assert command == ["torchrun", "train.py"]
    with pytest.raises(ConfigError, match="agent setting hang_k must be a float"):
        load_agent_config(["--job-id", "1", "--hang-k", "x"], {})


def test_an_agent_given_the_node_order_takes_its_place_in_it_as_its_node_rank() -> None:
    slurm = {"SLURM_JOB_ID": "77", "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "3",
             "SLURMD_NODENAME": "node1"}  # fmt: skip
    order = ["--node-order", "node3,node2,node1"]
    config, _ = load_agent_config(order, slurm)
    assert (config.node_rank, config.node_order) == (2, "node3,node2,node1")
    # An order that does not name this node among the step's: torchrun ranks the nodes.
    for wrong in ("node3,node2", "node3,node2,node4", "node1,node2,node1"):
        config, _ = load_agent_config(["--node-order", wrong], slurm)
        assert (config.node_rank, config.node_order) == (0, ""), wrong
    assert load_agent_config([], slurm)[0].node_order == ""


def test_the_agent_reads_the_samples_to_skip_from_its_flag_and_refuses_a_malformed_one() -> None:
    config, _ = load_agent_config(["--job-id", "1", "--skip-samples", "0:64,128:192"], {})
    assert config.skip_ranges() == ((0, 64), (128, 192))
    assert load_agent_config(["--job-id", "1"], {})[0].skip_ranges() == ()
    with pytest.raises(ConfigError, match=r"agent setting skip_samples.*START:END"):
        load_agent_config(["--job-id", "1", "--skip-samples", "64:0"], {})
