"""Where the repository and the test tree lie, for tests in any folder."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
