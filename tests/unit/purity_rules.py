"""What a pure module may not import (STYLE.md §2), and how its imports are read.

Shared by ``test_purity.py`` (the pure modules) and ``test_protocol.py`` (the
wire protocol, pure by the same rule).
"""

from __future__ import annotations

import ast

FORBIDDEN = {
    "subprocess", "socket", "sqlite3", "psutil", "time", "os", "shutil", "aiohttp",
    "datetime", "random", "threading", "asyncio",
}  # fmt: skip


def imported_roots(source: str) -> set[str]:
    """The top-level packages ``source`` imports (absolute imports only)."""
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots
