"""Automatic progress for scripts that import nothing: a real Python process started
with the bootstrap on its PYTHONPATH, as the node agent starts ranks, sends
its beats to a real Unix datagram socket read here."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.node.launch import BOOTSTRAP_DIR, with_bootstrap
from agent.wire.datagram import CheckpointNote, Phase, RankBeat, StepReport, parse_datagram

REPO = Path(__file__).resolve().parents[2]
FSDP2_PLAIN = REPO / "tests" / "workers" / "fsdp2_plain.py"

# Each line that sends is followed by a pause: the receiver's queue holds only
# 10 datagrams, and a loaded machine may not run the reading thread for a while.
PLAIN = """
import os
import time
import torch
pause = lambda: time.sleep(0.1)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
for _ in range(5):
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    other.step()  # a second optimizer's steps are not counted again
    pause()
torch.save({"model": model.state_dict(), "iter_num": 5}, "ckpt.pt.tmp")
os.replace("ckpt.pt.tmp", "ckpt.pt")  # the atomic-save pattern
pause()
model.eval()
model.train()
pause()
state = torch.load("ckpt.pt")
state["iter_num"] = 40
torch.save(state, "ckpt.pt")
pause()
torch.load("ckpt.pt")
optimizer.step()
"""


class Listener:
    """The agent's end: a datagram socket read on a thread while the rank runs
    (Linux queues only ``net.unix.max_dgram_qlen``, 10 by default, unread)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.1)
        self.received: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                self.received.append(self.sock.recv(65536))

    def messages(self) -> list[RankBeat | CheckpointNote | StepReport]:
        time.sleep(0.3)
        found = []
        for data in list(self.received):
            message = parse_datagram(data)
            assert isinstance(message, RankBeat | CheckpointNote | StepReport), message
            found.append(message)
        return found

    def beats(self) -> list[RankBeat]:
        """Every beat, a step report as the beat it stands for."""
        return [
            m.as_beat() if isinstance(m, StepReport) else m
            for m in self.messages()
            if isinstance(m, RankBeat | StepReport)
        ]

    def reports(self) -> list[StepReport]:
        return [m for m in self.messages() if isinstance(m, StepReport)]

    def notes(self) -> list[CheckpointNote]:
        return [m for m in self.messages() if isinstance(m, CheckpointNote)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Listener]:
    listener = Listener(str(tmp_path / "agent.sock"))
    try:
        yield listener
    finally:
        listener.close()


def run_rank(
    tmp_path: Path, source: str, socket_path: str, **extra: str
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    env = {
        **os.environ,
        "RESURGO_AGENT_SOCKET": socket_path,
        "RANK": "3",
        "LOCAL_RANK": "1",
        **extra,
    }
    env["PYTHONPATH"] = with_bootstrap(f"{extra.get('PYTHONPATH', '')}:{REPO}")
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_optimizer_steps_saves_loads_and_eval_become_automatic_beats(
    tmp_path: Path, agent: Listener
) -> None:
    run_rank(tmp_path, PLAIN, agent.path)
    got = agent.beats()
    assert all(b.automatic and b.rank == 3 and b.local_rank == 1 for b in got)
    assert [(b.step, b.phase) for b in got] == [
        *((step, Phase.TRAIN) for step in range(1, 6)),  # the first optimizer only
        (5, Phase.CHECKPOINT),  # torch.save
        (5, Phase.TRAIN),
        (5, Phase.EVAL),  # model.eval()
        (5, Phase.TRAIN),  # model.train()
        (5, Phase.TRAIN),  # torch.load: iter_num 5
        (5, Phase.CHECKPOINT),
        (5, Phase.TRAIN),
        (40, Phase.TRAIN),  # torch.load: the script resumes at iter_num 40
        (41, Phase.TRAIN),
    ]


def test_files_saved_under_the_checkpoint_root_are_noted_and_others_not(
    tmp_path: Path, agent: Listener
) -> None:
    source = PLAIN + "torch.save(state, '/tmp/elsewhere-%d.pt' % os.getpid())\n"
    run_rank(tmp_path, source, agent.path, RESURGO_CKPT_ROOT=str(tmp_path))
    notes = agent.notes()
    assert [(n.step, n.path, n.automatic) for n in notes] == [
        (5, str(tmp_path / "ckpt.pt"), True),
        (5, str(tmp_path / "ckpt.pt"), True),
    ]


def test_an_instrumented_script_gets_no_automatic_beats(tmp_path: Path, agent: Listener) -> None:
    source = "from agent.train.heartbeat import Heartbeat\nhb = Heartbeat.from_env()\n"
    run_rank(tmp_path, source + PLAIN + "hb.beat(99)\n", agent.path)
    assert [(b.step, b.automatic) for b in agent.beats()] == [(99, False)]


def test_opting_out_sends_nothing(tmp_path: Path, agent: Listener) -> None:
    run_rank(tmp_path, PLAIN, agent.path, RESURGO_AUTO_PROGRESS="0")
    assert agent.beats() == []


def test_the_users_own_sitecustomize_still_runs(tmp_path: Path, agent: Listener) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS'] = 'ran'\n")
    done = run_rank(
        tmp_path, "import os\nprint(os.environ.get('THEIRS'))\n" + PLAIN, agent.path,
        PYTHONPATH=str(theirs),
    )  # fmt: skip
    assert done.stdout.strip() == "ran"
    assert len(agent.beats()) == 14
    assert [r.step for r in agent.reports()] == [1, 2, 3, 4, 5]  # their losses


def test_a_dead_agent_costs_the_script_nothing(tmp_path: Path) -> None:
    done = run_rank(tmp_path, PLAIN + "print('trained')\n", str(tmp_path / "nobody.sock"))
    assert done.stdout.strip() == "trained" and done.stderr == ""


# The losses a script computes, printed; the bootstrap reads them off backward().
# Steps 1-2: one backward each; 3: two micro batches of half the loss (gradient
# accumulation, as the Trainer and Lightning scale them); 4: through a GradScaler;
# 5: a NaN; after a torch.load that names step 40, step 41's loss.
LOSSES = """
import time
import torch
pause = lambda: time.sleep(0.1)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
def loss_of(rows):
    return (model(rows) ** 2).mean()
for step in range(1, 6):
    optimizer.zero_grad()
    if step == 3:
        halves = [loss_of(x[:4]) / 2, loss_of(x[4:]) / 2]
        for half in halves:
            half.backward()
        print(step, float(sum(halves)))
    elif step == 4:
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        loss = loss_of(x)
        scaler.scale(loss).backward()
        print(step, float(loss))
    else:
        loss = loss_of(x) * (float("nan") if step == 5 else 1.0)
        loss.backward()
        print(step, float(loss))
    torch.autograd.grad(loss_of(x), list(model.parameters()))  # not a training step's
    model(x).sum(dim=1)  # not a scalar
    optimizer.step()
    pause()
    if step == 4:
        before_the_nan = {k: v.clone() for k, v in model.state_dict().items()}
model.load_state_dict(before_the_nan)
torch.save({"step": 40}, "ckpt.pt")
torch.load("ckpt.pt")
pause()
loss = loss_of(x)
loss.backward()
optimizer.step()
print(41, float(loss))
"""


def test_the_loss_each_step_starts_its_backward_from_is_reported_with_the_step(
    tmp_path: Path, agent: Listener
) -> None:
    done = run_rank(tmp_path, LOSSES, agent.path)
    printed = {int(step): float(loss) for step, loss in (line.split() for line in
                                                          done.stdout.splitlines())}  # fmt: skip
    reports = agent.reports()
    assert all(r.automatic and r.rank == 3 and r.cursor is None for r in reports)
    assert [r.step for r in reports] == [1, 2, 3, 4, 5, 41]
    for report in reports:
        expected = printed[report.step]
        if report.step == 5:
            assert report.loss is not None and report.loss != report.loss  # NaN, flagged
        else:
            assert report.loss == pytest.approx(expected, rel=1e-5), report


# A script's own DCP checkpoints, imported after torch as scripts do. ELSEWHERE is
# outside the checkpoint root. One process, no process group: DCP saves alone.
DCP_SAVES = """
import os
import tempfile
import time
import warnings
import torch
pause = lambda: time.sleep(0.1)
warnings.simplefilter("ignore")  # DCP's note that it saves without a process group
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    pause()
import sys
import agent
print(agent.__file__, "torch.distributed.checkpoint" in sys.modules)  # not imported early
import torch.distributed.checkpoint as dcp
dcp.save({"model": model.state_dict(), "step": 3}, checkpoint_id="out/step-3")
pause()
dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter("out/step-5"))
pause()
dcp.save({"model": model.state_dict()}, checkpoint_id="out/latest")
pause()
dcp.save({"model": model.state_dict(), "step": 3}, checkpoint_id=tempfile.mkdtemp())
pause()
dcp.async_save({"model": model.state_dict(), "step": 40}, checkpoint_id="out/step-40").result()
pause()
state = {"model": model.state_dict(), "step": 0}
dcp.load(state, checkpoint_id="out/step-40")
pause()
optimizer.step()
"""


def test_dcp_saves_are_phase_checkpoint_and_a_dcp_load_continues_the_count(
    tmp_path: Path, agent: Listener
) -> None:
    done = run_rank(tmp_path, DCP_SAVES, agent.path, RESURGO_CKPT_ROOT=str(tmp_path / "out"))
    assert done.stdout.split() == [str(REPO / "agent" / "__init__.py"), "False"]
    got = agent.beats()
    saved = [(3, Phase.CHECKPOINT), (3, Phase.TRAIN)]
    assert [(b.step, b.phase) for b in got] == [
        *((step, Phase.TRAIN) for step in range(1, 4)),
        *saved * 5,  # four saves, then async_save while its call blocks, once each
        (40, Phase.TRAIN),  # dcp.load filled in step 40
        (41, Phase.TRAIN),
    ]


def test_dcp_saves_under_the_checkpoint_root_are_noted_with_their_step_and_others_not(
    tmp_path: Path, agent: Listener
) -> None:
    out = tmp_path / "out"
    run_rank(tmp_path, DCP_SAVES, agent.path, RESURGO_CKPT_ROOT=str(out))
    assert [(n.step, n.path, n.automatic) for n in agent.notes()] == [
        (3, str(out / "step-3"), True),  # the state dict's step
        (5, str(out / "step-5"), True),  # a FileSystemWriter's path, its name's step
        (3, str(out / "latest"), True),  # neither: the step as counted
        (40, str(out / "step-40"), True),  # async_save, once its upload finished
    ]


def run_fsdp2(tmp_path: Path, socket_path: str, *args: str) -> subprocess.CompletedProcess[str]:
    """fsdp2_plain.py under torchrun, 2 local ranks on gloo, started as the agent starts
    ranks: the bootstrap first on PYTHONPATH, the agent's socket in the environment."""
    env = {
        **os.environ,
        "RESURGO_AGENT_SOCKET": socket_path,
        "RESURGO_CKPT_ROOT": str(tmp_path / "out"),
        "PYTHONPATH": with_bootstrap(str(REPO)),
    }
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(FSDP2_PLAIN), "--out-dir", str(tmp_path / "out"), "--steps", "20",
         "--save-every", "10", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_an_fsdp2_script_resumes_from_its_own_dcp_save_and_the_count_goes_on_from_it(
    tmp_path: Path, agent: Listener
) -> None:
    """Killed in step 15 after its step-10 save, the script loads step-10 itself (a
    step-20 save left without .metadata, as a crash leaves one, is passed over): rank
    0 notes each save, and the relaunch's beats go on from step 10."""
    out = tmp_path / "out"
    first = run_fsdp2(tmp_path, agent.path, "--kill-at", "15", "--fault-rank", "1")
    assert first.returncode != 0 and "rank 1 killing itself in step 15" in first.stdout
    assert [(n.rank, n.step, n.path) for n in agent.notes()] == [(0, 10, str(out / "step-10"))]
    (out / "step-20").mkdir()
    (out / "step-20" / "__0_0.distcp").write_bytes(b"cut short")
    agent.received.clear()
    second = run_fsdp2(tmp_path, agent.path, "--async-save")
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resuming from {out / 'step-10'} at step 10 " in second.stdout, second.stdout
    assert "done at step 20 with world 2" in second.stdout
    rank_0 = [b.step for b in agent.beats() if b.rank == 0 and b.phase is Phase.TRAIN]
    assert rank_0[:3] == [10, 11, 12], rank_0  # dcp.load's step 10, then on from it
    assert [(n.rank, n.step, n.path) for n in agent.notes()] == [(0, 20, str(out / "step-20"))]


def test_the_bootstrap_comes_first_once() -> None:
    assert with_bootstrap(None) == BOOTSTRAP_DIR
    assert with_bootstrap(f"/a:{BOOTSTRAP_DIR}::/b") == f"{BOOTSTRAP_DIR}:/a:/b"
