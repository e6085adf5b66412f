"""An idle hot spare's health check: the launch's health gate, on a node that runs nothing.

The in-job driver runs it with srun on the job's idle spares, beside the
training step, as often as the supervisor asks (its policy's
``spare_check_interval_s``)::

    python -m agent.node.sparecheck [resurgo-agent flags] -- COMMAND

Each node runs the gate of :func:`agent.node.health.run_gate` (the built-in
checks: the checkpoint root, the world's rendezvous address, the GPUs; and the
operator's command) and prints one line, :data:`MARK` then JSON: the node,
whether every check passed, and each check's line. It reports nothing itself:
the driver sends the failures to the supervisor, which releases a failing
spare before a fault would swap it in. It imports no torch and leaves no
process behind, so between checks a spare runs nothing at all. The swap's own
gate still runs before the spare's ranks start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agent.node.config import AgentConfig, load_config
from agent.node.health import GateReport, run_gate
from agent.node.healthchecks import GateInputs, gpus_needed
from agent.wire.errors import ResurgoError

MARK = "resurgo-spare-check "


@dataclass(frozen=True)
class SpareVerdict:
    """One spare's answer: every check's line, the failures last."""

    node: str
    healthy: bool
    lines: tuple[str, ...]

    def failures(self) -> str:
        """The failing checks' lines, joined: what the supervisor's decision quotes."""
        return "; ".join(line for line in self.lines if line.startswith("FAIL")) or "failed"


async def check(config: AgentConfig, environ: Mapping[str, str]) -> GateReport:
    """The gate, for a node that will run the world's ranks once it is swapped in: all
    the GPUs Slurm gave it must be there (how many ranks it will run is the world's)."""
    inputs = GateInputs(
        ckpt_root=config.ckpt_root,
        min_free_gb=config.health_min_free_gb,
        master_addr=config.master_addr,
        master_port=config.master_port,
        gpus_needed=gpus_needed(environ, None),
        timeout_s=config.health_builtin_timeout_s,
        path=environ.get("PATH"),
    )
    return await run_gate(inputs, config.health_check, config.health_check_timeout_s)


def verdict_line(node: str, report: GateReport) -> str:
    """The line a node prints: :data:`MARK` and the verdict as JSON."""
    document = {"node": node, "healthy": report.healthy, "lines": report.lines()}
    return MARK + json.dumps(document, separators=(",", ":"))


def parse_verdicts(output: str, asked: Sequence[str]) -> dict[str, SpareVerdict]:
    """The verdicts in srun's merged output, for the nodes ``asked`` about only; other
    lines (srun's own, a check's stray output) and malformed ones are skipped."""
    found: dict[str, SpareVerdict] = {}
    for line in output.splitlines():
        start = line.find(MARK)
        if start < 0:
            continue
        try:
            document = json.loads(line[start + len(MARK) :])
            node, healthy, lines = document["node"], document["healthy"], document["lines"]
        except (ValueError, KeyError, TypeError):
            continue
        if node not in asked or not isinstance(healthy, bool) or not isinstance(lines, list):
            continue
        found[node] = SpareVerdict(node, healthy, tuple(str(text) for text in lines))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run the gate once, print the verdict; 0 when it ran, 2 on bad flags."""
    logging.basicConfig(
        level=logging.WARNING, format="resurgo-spare-check %(asctime)s %(levelname)s %(message)s"
    )
    try:
        config, _ = load_config(list(sys.argv[1:] if argv is None else argv), os.environ)
    except ResurgoError as error:
        print(f"resurgo-spare-check: {error}", file=sys.stderr)
        return 2
    report = asyncio.run(check(config, os.environ))
    print(verdict_line(config.node, report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
