"""Configuration, fuzzed: the daemons' settings, job specs and job secrets.

Each loader returns a well-typed value (every number finite, every count an
integer in range) or raises :class:`ConfigError` naming the problem; never
another exception, never a blocked read. The supervisor's settings and the
agent's come from TOML, the environment and flags; a job's ``spec.json`` and
``secret`` come from a directory its user controls and the supervisor reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import math
import os
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.node.config import AgentConfig
from agent.node.config import load_config as load_agent_config
from agent.wire.auth import SECRET_BYTES, load_secret, new_secret, write_secret
from agent.wire.errors import ConfigError
from agent.wire.settings import convert
from supervisor.config import SupervisorConfig, load_config
from supervisor.core.policy import Policy
from supervisor.jobs import JobSpec, read_spec

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

SCALARS = (
    st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats()
    | st.booleans()
    | st.text(max_size=12)
    | st.sampled_from(["1", "0.5", "inf", "nan", "-3", "yes", "quick", "full", "1e400", "9" * 5000])
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=6,
)


def toml_value(value: Any) -> str:
    """``value`` as a TOML literal (arrays and inline tables included)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return {"inf": "inf", "-inf": "-inf", "nan": "nan"}.get(repr(value), repr(value))
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_document(table: dict[str, Any], sections: dict[str, dict[str, Any]]) -> str:
    lines = [f"{json.dumps(key)} = {toml_value(value)}" for key, value in table.items()]
    for section, body in sections.items():
        lines.append(f"[{json.dumps(section)}]")
        lines += [f"{json.dumps(key)} = {toml_value(value)}" for key, value in body.items()]
    return "\n".join(lines) + "\n"


def field_names(cls: type) -> list[str]:
    return [field.name for field in dataclasses.fields(cls)]


def assert_well_typed(instance: Any) -> None:
    """Every field has the type of its default, and every float is finite."""
    for field in dataclasses.fields(instance):
        value, default = getattr(instance, field.name), field.default
        if isinstance(default, enum.Enum):
            assert isinstance(value, type(default))
        else:
            assert type(value) is type(default), (field.name, value)
        if isinstance(value, float):
            assert math.isfinite(value), (field.name, value)


@contextlib.contextmanager
def written(text: str | bytes) -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="config-"))
    path = directory / "settings.toml"
    try:
        if isinstance(text, str):
            path.write_text(text)
        else:
            path.write_bytes(text)
        yield path
    finally:
        path.unlink(missing_ok=True)
        directory.rmdir()


# -- one value --------------------------------------------------------------------------------


@FUZZ
@given(
    default=st.sampled_from([0.5, 3, "text", True, Policy().validation_level]),
    value=VALUES | st.datetimes(),
)
def test_a_setting_converts_to_its_type_or_raises_config_error_naming_it(
    default: Any, value: Any
) -> None:
    try:
        converted = convert("owner", "some_setting", default, value)
    except ConfigError as error:
        assert "owner setting some_setting" in str(error)
        assert len(str(error)) < 500
        return
    assert type(converted) is type(default)
    if isinstance(converted, float):
        assert math.isfinite(converted)
    if isinstance(converted, int) and isinstance(value, float):
        assert converted == value


@pytest.mark.parametrize(
    ("default", "value"),
    [
        (3, math.inf),  # int(inf) raises OverflowError
        (3, 1.5),  # a fraction silently truncated
        (0.5, math.nan),
        (0.5, "1e400"),
        (0.5, 1 << 2000),  # float() of an integer too large for a double
        ("dir", ["a", "b"]),  # a TOML array where a path belongs
        ("dir", {"a": 1}),
        (3, [1]),
    ],
)
def test_a_value_that_is_no_setting_is_refused_not_mangled(default: Any, value: Any) -> None:
    with pytest.raises(ConfigError, match="owner setting x must be"):
        convert("owner", "x", default, value)


# -- the supervisor's and the agent's settings ---------------------------------------------------


def settings_table(names: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.sampled_from(names) | st.text(max_size=8), VALUES, max_size=4)


@FUZZ
@given(
    table=settings_table(field_names(SupervisorConfig)),
    policy=settings_table(field_names(Policy)) | VALUES.map(lambda value: {"_": value}),
    environ=st.dictionaries(
        st.sampled_from(
            [f"RESURGO_SUPERVISOR_{name.upper()}" for name in field_names(SupervisorConfig)]
            + [f"RESURGO_POLICY_{name.upper()}" for name in field_names(Policy)]
            + ["RESURGO_STATE_DIR", "RESURGO_JOBS_DIR"]
        ),
        st.text(max_size=12).filter(lambda text: "\x00" not in text),
        max_size=3,
    ),
)
def test_supervisor_settings_load_well_typed_or_raise_config_error(
    table: dict[str, Any], policy: dict[str, Any], environ: dict[str, str]
) -> None:
    with written(toml_document(table, {"policy": policy})) as path:
        try:
            config, loaded_policy = load_config(["--config", str(path)], environ)
        except ConfigError as error:
            assert str(error)
            return
    assert_well_typed(config)
    assert_well_typed(loaded_policy)


@FUZZ
@given(
    table=settings_table(field_names(AgentConfig)),
    environ=st.dictionaries(
        st.sampled_from(
            [f"RESURGO_AGENT_{name.upper()}" for name in field_names(AgentConfig)]
            + ["SLURM_JOB_ID", "SLURM_NODEID", "SLURM_STEP_NUM_NODES", "SLURM_RESTART_COUNT"]
        ),
        st.text(max_size=12).filter(lambda text: "\x00" not in text),
        max_size=4,
    ),
)
def test_agent_settings_load_well_typed_or_raise_config_error(
    table: dict[str, Any], environ: dict[str, str]
) -> None:
    with written(toml_document(table, {})) as path:
        try:
            config, _ = load_agent_config(
                ["--config", str(path), "--job-id", "4711", "--", "true"], environ
            )
        except ConfigError as error:
            assert str(error)
            return
    assert_well_typed(config)
    assert config.nnodes >= 1 and 0 <= config.node_rank < config.nnodes
    assert all(
        getattr(config, name) > 0
        for name in ("heartbeat_report_s", "watch_interval_s", "hang_check_s", "stack_sample_s")
    )


@FUZZ
@given(
    text=st.text(max_size=200)
    | st.binary(max_size=100)
    | st.sampled_from(
        [
            "poll_s = " + "[" * 5000 + "]" * 5000,  # deeper than the TOML parser's stack
            "a = {" * 3000,
            "[policy]\n[policy]\n",
            "policy = 3\n",
            "[policy.nested]\nx = 1\n",
        ]
    )
)
def test_any_config_file_loads_or_raises_config_error(text: str | bytes) -> None:
    with written(text) as path:
        for load in (
            lambda: load_config(["--config", str(path)], {}),
            lambda: load_agent_config(["--config", str(path), "--job-id", "1"], {}),
        ):
            with contextlib.suppress(ConfigError):
                load()


# -- job specs (the user's spec.json, read by the supervisor) ------------------------------------

VALID_SPEC = JobSpec(
    name="llm",
    nodes=4,
    command=("torchrun", "train.py"),
    ckpt_root="/ckpt/llm",
    min_nodes=2,
    supervisor_url="http://head:8740",
    user="alice",
    submitted_s=1_760_000_000.0,
)
SPEC_KEYS = [*field_names(JobSpec), "version"]


def assert_spec_well_typed(spec: JobSpec) -> None:
    assert isinstance(spec.name, str) and isinstance(spec.ckpt_root, str)
    for count in (spec.nodes, spec.unit, spec.procs_per_node, spec.floor):
        assert type(count) is int and 1 <= count <= 1 << 24
    assert all(type(part) is str for part in (*spec.command, *spec.sbatch_options))
    assert all(type(part) is str for part in spec.directives)
    assert type(spec.submitted_s) is float and math.isfinite(spec.submitted_s)


SPECS = st.builds(
    lambda nodes, unit, command, name: dataclasses.replace(
        VALID_SPEC, nodes=nodes * unit, unit=unit, min_nodes=unit, command=command, name=name
    ),
    st.integers(1, 64),
    st.integers(1, 8),
    st.lists(st.text(max_size=10), min_size=1, max_size=4).map(tuple),
    st.text(max_size=20),
)


@FUZZ
@given(spec=SPECS)
def test_a_job_spec_round_trips_through_its_json(spec: JobSpec) -> None:
    assert JobSpec.from_json(spec.to_json()) == spec


@FUZZ
@given(data=st.data())
def test_a_spec_with_any_field_replaced_is_well_typed_or_config_error(data: st.DataObject) -> None:
    document = json.loads(VALID_SPEC.to_json())
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(SPEC_KEYS) | st.text(max_size=6))
        if data.draw(st.booleans()):
            document[key] = data.draw(VALUES)
        else:
            document.pop(key, None)
    try:
        spec = JobSpec.from_json(json.dumps(document))
    except ConfigError as error:
        assert str(error)  # a malformed field, or a spec that cannot run (JobSpec's checks)
        return
    assert_spec_well_typed(spec)


@pytest.mark.parametrize(
    "document",
    [
        {"name": {"a": 1}},  # SQLite cannot store it: the daemon's registration would fail
        {"nodes": 10**30},  # nor this
        {"nodes": 4.5},
        {"nodes": True},
        {"command": "torchrun train.py"},  # a string is not an argv
        {"submitted_s": "yesterday"},
        {"ckpt_root": 7},
        {"unknown": 1},
    ],
)
def test_a_spec_field_of_the_wrong_type_is_refused(document: dict[str, Any]) -> None:
    text = json.dumps({**json.loads(VALID_SPEC.to_json()), **document})
    with pytest.raises(ConfigError, match="job spec is malformed"):
        JobSpec.from_json(text)


def test_a_spec_nested_deeper_than_the_parser_is_refused() -> None:
    with pytest.raises(ConfigError, match="job spec is malformed"):
        JobSpec.from_json("[" * 100_000)


# -- files a user controls: never a blocked or unbounded read ------------------------------------


def returns_promptly(call: Callable[[], Any], path: Path) -> BaseException | None:
    """Run ``call`` in a thread; fail if it has not returned within 30 s (a blocked read)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as error:
            outcome.append(error)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(30)
    if worker.is_alive():
        with open(path, "wb"):  # unblock the reader so the thread can end
            pass
        pytest.fail(f"reading {path} blocked")
    return outcome[0]


@pytest.mark.parametrize("name", ["spec.json", "secret"])
def test_a_fifo_as_spec_or_secret_is_a_config_error_not_a_blocked_supervisor(
    tmp_path: Path, name: str
) -> None:
    os.mkfifo(tmp_path / name, 0o600)
    read = (
        (lambda: read_spec(tmp_path))
        if name == "spec.json"
        else lambda: load_secret(tmp_path / name)
    )
    error = returns_promptly(read, tmp_path / name)
    assert isinstance(error, ConfigError), error


def test_a_huge_sparse_spec_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    with open(tmp_path / "spec.json", "wb") as handle:
        handle.truncate(64 << 30)  # 64 GiB of holes: a read of it all would never fit
    with pytest.raises(ConfigError, match="too large"):
        read_spec(tmp_path)


@FUZZ
@given(content=st.binary(max_size=200) | st.sampled_from([b"\xff" * 64, b"0" * 10_000]))
def test_any_secret_file_gives_a_secret_or_config_error(content: bytes) -> None:
    with written(content) as path:
        path.chmod(0o600)
        try:
            secret = load_secret(path)
        except ConfigError as error:
            assert str(path) in str(error)
            return
    assert len(secret) == SECRET_BYTES


@FUZZ
@given(mode=st.integers(0o400, 0o777))
def test_a_secret_others_can_read_is_refused_and_a_private_one_round_trips(mode: int) -> None:
    secret = new_secret()
    with written(b"") as path:
        write_secret(path, secret)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        path.chmod(mode)
        if mode & 0o077:
            with pytest.raises(ConfigError, match="readable by group or others"):
                load_secret(path)
        else:
            assert load_secret(path) == secret
