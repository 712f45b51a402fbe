"""Structural rules that keep the staging honest (SPEC.md, rules of the layout)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PHASES = sorted(p.name for p in ROOT.glob("phase[0-9]_*") if (p / "__init__.py").exists())


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_phases_exist():
    assert PHASES[:3] == ["phase0_basics", "phase1_naive", "phase2_sampling"]


@pytest.mark.parametrize("phase", PHASES)
def test_no_phase_imports_another(phase):
    for path in (ROOT / phase).rglob("*.py"):
        for name in imported_modules(path):
            top = name.split(".")[0]
            assert not (top.startswith("phase") and top != phase), f"{path} imports {name}"


@pytest.mark.parametrize("phase", PHASES)
def test_every_file_opens_with_a_docstring(phase):
    for path in (ROOT / phase).rglob("*.py"):
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path} has no module docstring"


@pytest.mark.parametrize("phase", PHASES)
def test_every_phase_has_a_readme_with_the_lesson(phase):
    """Problem, solution, analogy, how to run, what to diff (SPEC.md, rules of the layout)."""
    readme = (ROOT / phase / "README.md").read_text().lower()
    for topic in ("problem", "analogy", "run", "diff"):
        assert topic in readme, f"{phase}/README.md never mentions the {topic}"


def test_importing_a_phase_only_defines_things():
    """No output, no files written, no global RNG consumed: import has no side effects."""
    code = (
        "import torch, sys, importlib\n"
        "torch.manual_seed(0); before = torch.rand(1)\n"
        "torch.manual_seed(0)\n"
        f"for p in {PHASES!r}: importlib.import_module(p)\n"
        "assert torch.equal(torch.rand(1), before), 'import consumed the global RNG'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
