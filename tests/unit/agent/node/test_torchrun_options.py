"""torchrun's parser rebuilt from its description parses as torch's own does, and a launch
that finds the description imports no torch."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from agent.node import torchrun_options
from agent.node.launch import Allocation, fit_torchrun
from agent.wire.errors import ConfigError
from tests.paths import REPO

ALLOC = Allocation("7", "node1", 3, 0, "10.0.0.1", 29400)

COMMANDS = [
    ["train.py"],
    ["--nproc-per-node=4", "train.py", "--lr", "0.1"],
    ["--nproc_per_node", "2", "--nnodes", "1:4", "train.py"],
    ["--nproc", "8", "train.py"],  # an abbreviation, as argparse allows
    ["--standalone", "--nproc-per-node=gpu", "-m", "pkg.train", "--epochs", "3"],
    ["--no-python", "bash", "-c", "echo hi"],
    ["--rdzv-backend=c10d", "--rdzv-endpoint", "host:29500", "--max-restarts=3", "t.py"],
    ["--master-addr", "h", "--master-port", "1234", "--node-rank=2", "t.py"],
    ["--duplicate-stdout-filters", "a,,b,c", "--monitor-interval", "0.5", "t.py"],
    ["--start-method", "fork", "--log-dir", "/tmp/l", "-r", "3", "-t", "3", "t.py"],
    ["--numa-binding", "node", "--shutdown-timeout", "5", "--virtual-local-rank", "t.py"],
    ["--run-path", "t.py", "--", "--flag"],
    ["t.py", "--nproc-per-node=9"],  # the script's own argument, not torchrun's
]
BAD = [
    [],
    ["--start-method", "threads", "t.py"],
    ["--max-restarts", "many", "t.py"],
    ["--numa-binding", "rack", "t.py"],
]
PET = [{}, {"PET_NPROC_PER_NODE": "3", "PET_STANDALONE": "1", "PET_MAX_RESTARTS": "2"}]


def described() -> dict[str, object]:
    return torchrun_options.describe(get_args_parser(), {})


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> object:
    try:
        return vars(parser.parse_args(argv))
    except SystemExit as error:
        return ("exit", error.code)


@pytest.mark.parametrize("environ", PET, ids=["no PET", "PET set"])
def test_the_rebuilt_parser_parses_every_command_as_torchs_does(
    environ: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    description = json.loads(json.dumps(described()))  # through JSON, as stored
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    theirs, ours = get_args_parser(), torchrun_options.rebuild(description)
    for argv in COMMANDS + BAD:
        assert parse(ours, argv) == parse(theirs, argv), argv
    for argv in COMMANDS:
        command = ["torchrun", *argv]
        assert fit(command, ours) == fit(command, theirs), argv
    capsys.readouterr()


def fit(command: list[str], parser: argparse.ArgumentParser) -> object:
    try:
        return fit_torchrun(command, ALLOC, "py", parser)
    except ConfigError as error:
        return ("refused", str(error))


def test_a_pet_variable_set_while_describing_is_not_taken_for_the_default() -> None:
    with pytest.raises(torchrun_options.Undescribable, match="PET_NPROC_PER_NODE"):
        torchrun_options.describe(get_args_parser(), {"PET_NPROC_PER_NODE": "5"})


def test_an_unknown_action_or_type_is_not_described() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", action="count")
    with pytest.raises(torchrun_options.Undescribable, match="_CountAction"):
        torchrun_options.describe(parser, {})
    parser = argparse.ArgumentParser()
    parser.add_argument("--when", type=lambda text: text)
    with pytest.raises(torchrun_options.Undescribable, match="type"):
        torchrun_options.describe(parser, {})


def test_the_first_launch_describes_and_the_next_one_imports_no_torch(tmp_path: Path) -> None:
    probe = (
        "import sys; from pathlib import Path; "
        "from agent.node.torchrun_options import torchrun_parser; "
        "parser = torchrun_parser(Path(sys.argv[1])); "
        "args = parser.parse_args(['--nproc-per-node=2', 't.py']); "
        "print(args.nproc_per_node, 'torch' in sys.modules)"
    )

    def launch() -> str:
        done = subprocess.run(
            [sys.executable, "-c", probe, str(tmp_path)],
            cwd=REPO, capture_output=True, text=True, check=True,
        )  # fmt: skip
        return done.stdout.strip()

    assert launch() == "2 True"  # the first describes, with torch's parser
    (stored,) = tmp_path.glob("torchrun-options-*.json")
    assert launch() == "2 False"  # the next rebuilds it: no torch imported
    stored.write_text("{not json")
    assert launch() == "2 True"  # a damaged description: torch's parser, described again
    assert json.loads(stored.read_text())["format"] == torchrun_options.FORMAT
