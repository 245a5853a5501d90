"""docs/ARCHITECTURE.md names every module of the package (one line each)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_has_a_line_in_architecture() -> None:
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    missing = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "fdx").rglob("*.py"))
        if p.name not in ("__init__.py", "__main__.py") and f"`{p.relative_to(ROOT)}`" not in doc
        and "_ops" not in p.relative_to(ROOT).parts  # the install-time build of the C++ ops (not source)
    ]
    assert not missing, f"modules missing from docs/ARCHITECTURE.md: {missing}"


def test_readme_names_the_two_commands_and_ci_runs_the_test_one() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make serve" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
