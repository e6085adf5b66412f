"""The unit tests mirror the package tree: the tests of ``supervisor/core/`` are in
``tests/unit/supervisor/core/``, those of the project as a whole in ``tests/unit/project/``.

A test module at the top of ``tests/unit/``, or in a folder that names no
package, is a test nobody finds by following the code.
"""

from __future__ import annotations

from pathlib import Path

from tests.paths import REPO, TESTS

UNIT = TESTS / "unit"


def misplaced(unit: Path, repo: Path) -> list[str]:
    """Test modules under ``unit`` whose folder is neither ``project`` nor a package of ``repo``."""
    found = []
    for path in sorted(unit.rglob("test_*.py")):
        folder = path.parent.relative_to(unit)
        if folder.parts[:1] == ("project",):
            continue
        if not folder.parts or not (repo / folder / "__init__.py").is_file():
            found.append(str(path.relative_to(unit)))
    return found


def test_every_unit_test_sits_in_the_folder_of_a_package() -> None:
    assert misplaced(UNIT, REPO) == []


def test_the_check_finds_a_test_at_the_top_or_under_no_package(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "supervisor" / "core").mkdir(parents=True)
    (repo / "supervisor" / "core" / "__init__.py").write_text("")
    unit = repo / "tests" / "unit"
    for name in ("test_top.py", "supervisor/core/test_ok.py", "supervisor/nowhere/test_lost.py",
                 "project/test_docs.py"):  # fmt: skip
        (unit / name).parent.mkdir(parents=True, exist_ok=True)
        (unit / name).write_text("")
    assert misplaced(unit, repo) == ["supervisor/nowhere/test_lost.py", "test_top.py"]
