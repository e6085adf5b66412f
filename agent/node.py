"""``resurgo-agent``: the per-node agent started by the job's batch script."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    """Return the agent's argument parser."""
    return argparse.ArgumentParser(
        prog="resurgo-agent",
        description=(
            "Per-node agent: launches this node's share of the ranks, watches them, "
            "detects death and hangs, and reports to the supervisor."
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``; the agent loop itself arrives with the node-agent issue."""
    build_parser().parse_args(argv)
    print("resurgo-agent: the agent is not implemented yet; see README.md", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
