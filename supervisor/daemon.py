"""``resurgo-supervisor``: the head-node daemon."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    """Return the daemon's argument parser."""
    return argparse.ArgumentParser(
        prog="resurgo-supervisor",
        description=(
            "Head-node daemon: watches every job's ranks through the node agents, "
            "decides recoveries and carries them out through Slurm."
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``; the daemon loop itself arrives with the supervisor issue."""
    build_parser().parse_args(argv)
    print("resurgo-supervisor: the daemon is not implemented yet; see README.md", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
