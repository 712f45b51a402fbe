"""Structural rules that keep the staging honest.

A learner reads the phases in order and runs `git diff --no-index phaseN phaseN+1` to see one
lesson. So each phase README declares, in its `## What to diff` section, the files its lesson
changes, adds or deletes, as a numbered list in reading order whose items open with the file name
(relative to the phase directory) in backticks; a deleted file says "(deleted)":

    1. `block_manager.py` — the paged allocator replaces the contiguous one ...
    2. `kv_cache.py` — ...
    3. `generate.py` (deleted) — ...

Every file the list does not name must be byte-identical to the previous phase's copy.
"""

import ast
import re
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


# Phases whose diffs are checked, in reading order; a new phase joins by being appended here.
DIFFED_PHASES = (
    "phase0_basics",
    "phase1_naive",
    "phase2_sampling",
    "phase3_kvcache",
    "phase4_scheduler",
    "phase5_paged",
    "phase6_qwen3",
    "phase7_optim",
    "phase8_serving",
)
NOT_PART_OF_THE_DIFF = {"README.md"}  # each README tells its own lesson
WHAT_TO_DIFF_ITEM = re.compile(r"^\d+\.\s+`([^`]+)`(.*)$")


def phase_files(phase: str) -> dict[str, bytes]:
    root = ROOT / phase
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file()
        and "__pycache__" not in path.parts
        and path.name not in NOT_PART_OF_THE_DIFF
    }


def declared_diff(phase: str) -> tuple[list[str], set[str]]:
    """The README's `## What to diff` list: (files in reading order, the ones marked deleted)."""
    section, inside = [], False
    for line in (ROOT / phase / "README.md").read_text().splitlines():
        if line.startswith("## "):
            inside = line.strip() == "## What to diff"
        elif inside:
            section.append(line)
    assert section, f"{phase}/README.md has no '## What to diff' section"
    files, deleted = [], set()
    for line in section:
        item = WHAT_TO_DIFF_ITEM.match(line)
        if item:
            files.append(item.group(1))
            if "(deleted)" in item.group(2):
                deleted.add(item.group(1))
    return files, deleted


def actual_diff(before: str, after: str) -> tuple[set[str], set[str]]:
    """(files added or changed, files deleted) from phase `before` to phase `after`."""
    old, new = phase_files(before), phase_files(after)
    changed = {name for name, data in new.items() if old.get(name) != data}
    return changed, set(old) - set(new)


def test_diffed_phases_are_the_phases_in_order():
    assert list(DIFFED_PHASES) == PHASES[: len(DIFFED_PHASES)]


@pytest.mark.parametrize("before, after", list(zip(DIFFED_PHASES, DIFFED_PHASES[1:], strict=False)))
def test_a_phase_changes_only_the_files_its_readme_declares(before, after):
    files, deleted = declared_diff(after)
    assert len(files) == len(set(files)), f"{after}/README.md lists a file twice"
    changed, gone = actual_diff(before, after)
    declared_changed = set(files) - deleted
    undeclared = sorted(changed - declared_changed)
    assert not undeclared, (
        f"{before} -> {after} changes {undeclared}, which {after}/README.md's 'What to diff' "
        "list does not name: name them there, or make them byte-identical to the previous phase's"
    )
    unchanged = sorted(declared_changed - changed)
    assert not unchanged, f"{after}/README.md lists {unchanged}, identical to {before}'s"
    assert gone == deleted, f"{before} -> {after} deletes {sorted(gone)}; README says {deleted}"


def test_the_diff_rule_catches_an_undeclared_change(tmp_path, monkeypatch):
    """The check above is not vacuous: a copied file that drifts, undeclared, is caught."""
    for phase in ("phase_a", "phase_b"):
        (tmp_path / phase).mkdir()
        (tmp_path / phase / "same.py").write_text("x = 1\n")
        (tmp_path / phase / "lesson.py").write_text(f"lesson = {phase!r}\n")
    (tmp_path / "phase_a" / "gone.py").write_text("old = 1\n")
    readme = "## What to diff\n\n1. `lesson.py` — the lesson.\n2. `gone.py` (deleted) — replaced.\n"
    (tmp_path / "phase_b" / "README.md").write_text(readme)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    test_a_phase_changes_only_the_files_its_readme_declares("phase_a", "phase_b")
    (tmp_path / "phase_b" / "same.py").write_text("x = 2  # drift\n")
    with pytest.raises(AssertionError, match="same.py"):
        test_a_phase_changes_only_the_files_its_readme_declares("phase_a", "phase_b")


def test_importing_a_phase_only_defines_things():
    """No output, no files written, no global RNG consumed: import has no side effects."""
    code = (
        "import torch, sys, importlib\n"
        "torch.manual_seed(0); before = torch.rand(1)\n"
        "torch.manual_seed(0)\n"
        f"for p in {PHASES!r}:\n"
        "    m = importlib.import_module(p)\n"
        "    [getattr(m, name) for name in m.__all__]  # phase 8 loads its names on first use\n"
        "assert torch.equal(torch.rand(1), before), 'import consumed the global RNG'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""


# Phases 7-8 are layered: a low-level module (the collectives, the layers, the kernels) never
# imports a high-level one (the processes, the runner, the engine), not even inside a function or
# for type checking. That is why tensor parallelism is two files: distributed.py (the collectives
# every layer calls) and worker.py (the processes that drive a model runner).
LAYERED_PHASES = ("phase7_optim", "phase8_serving")
LOW_LEVEL = ("distributed", "linear", "embedding", "attention", "attention_backend", "norm", "rope",
             "mlp", "decoder", "model", "kv_cache", "kernels")  # fmt: skip
IMPORTS = (ast.Import, ast.ImportFrom)
HIGH_LEVEL = ("worker", "model_runner", "engine", "scheduler", "async_engine", "api_server", "cli")


def phase_imports(path: Path, phase_dir: Path) -> set[str]:
    """The modules of its own phase that `path` imports anywhere in it, by their first name
    inside the phase (`from ..attention import X` in kernels/ -> "attention")."""
    package = path.relative_to(phase_dir).parent.parts  # () for a top-level module
    names = set()
    imports = (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, IMPORTS))
    for node in imports:
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = package[: len(package) - (node.level - 1)]
            parts = (*base, *(node.module.split(".") if node.module else ()))
            names.update([parts[0]] if parts else [a.name for a in node.names])
        else:  # absolute: `import phase7_optim.engine`, `from phase7_optim.engine import X`
            modules = [node.module] if isinstance(node, ast.ImportFrom) else []
            modules += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for parts in (m.split(".") for m in modules if m):
                if parts[0] == phase_dir.name and len(parts) > 1:
                    names.add(parts[1])
    return names


@pytest.mark.parametrize("phase", LAYERED_PHASES)
def test_low_level_modules_never_import_high_level_ones(phase):
    phase_dir = ROOT / phase
    for path in sorted(phase_dir.rglob("*.py")):
        if path.relative_to(phase_dir).with_suffix("").parts[0] not in LOW_LEVEL:
            continue
        high = sorted(phase_imports(path, phase_dir) & set(HIGH_LEVEL))
        assert not high, f"{path.relative_to(ROOT)} (low level) imports {high} (high level)"


def test_the_layering_rule_sees_lazy_and_type_checking_imports(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "k.py").write_text("def f():\n    from ..model_runner import R\n")
    (tmp_path / "linear.py").write_text("if TYPE_CHECKING:\n    from .worker import W\n")
    (tmp_path / "mlp.py").write_text(f"import {tmp_path.name}.engine\nfrom . import scheduler\n")
    assert phase_imports(tmp_path / "kernels" / "k.py", tmp_path) == {"model_runner"}
    assert phase_imports(tmp_path / "linear.py", tmp_path) == {"worker"}
    assert phase_imports(tmp_path / "mlp.py", tmp_path) == {"engine", "scheduler"}


# The kernels are a leaf: no module of kernels/ imports a module of its phase outside kernels/,
# not even inside a function, so the engine's imports of the kernels can never close a cycle (as
# kernels/kv_store.py's `from ..attention import PAD_SLOT_ID` once did). And the engine imports on
# a CPU-only install without Triton: outside kernels/, a module takes nothing but PAD_SLOT_ID from
# kernels/ at its top (the package defines it, and imports its kernels, Triton with them, only
# when one of their names is first used).
KERNELS_ALONE = """
import importlib, pkgutil, sys, types
for name in {phases!r}:
    phase = types.ModuleType(name)  # the package without its __init__, which imports the engine
    phase.__path__ = [name]
    sys.modules[name] = phase
    kernels = importlib.import_module(name + ".kernels")
    for info in pkgutil.iter_modules(kernels.__path__):
        importlib.import_module(kernels.__name__ + "." + info.name)
    engine = [m for m in sys.modules if m.startswith(name + ".") and m.split(".")[1] != "kernels"]
    assert not engine, f"importing {{name}}.kernels imports {{sorted(engine)}}"
"""
WITHOUT_TRITON = """
import importlib, pkgutil, sys
sys.modules["triton"] = None  # as on a CPU-only install: `import triton` raises ImportError
for name in {phases!r}:
    phase = importlib.import_module(name)
    for info in pkgutil.iter_modules(phase.__path__):
        importlib.import_module(name + "." + info.name)
    kernels = importlib.import_module(name + ".kernels")
    assert kernels.PAD_SLOT_ID == -1
    try:
        kernels.store_kvcache
    except ImportError:
        pass  # the block works: a kernel needs Triton
    else:
        raise AssertionError("Triton was not blocked")
"""


def run_python(code: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("phase", LAYERED_PHASES)
def test_the_kernels_import_nothing_of_the_engine(phase):
    phase_dir = ROOT / phase
    for path in sorted((phase_dir / "kernels").rglob("*.py")):
        engine = sorted(phase_imports(path, phase_dir) - {"kernels"})
        assert not engine, f"{path.relative_to(ROOT)} (kernels/, a leaf) imports {engine}"


def test_the_kernels_load_without_the_engine():
    pytest.importorskip("triton", reason="the kernels' modules need triton (pip install triton)")
    run_python(KERNELS_ALONE.format(phases=LAYERED_PHASES))


def test_the_engine_imports_without_triton():
    run_python(WITHOUT_TRITON.format(phases=LAYERED_PHASES))


def test_the_suite_takes_one_worker_per_core_up_to_four(monkeypatch):
    """`pytest -n auto` (the README's test command) asks tests/conftest.py how many workers."""
    from tests import conftest

    for cores, workers in [(None, 1), (1, 1), (2, 2), (16, conftest.MAX_WORKERS)]:
        monkeypatch.setattr(conftest.os, "cpu_count", lambda cores=cores: cores)
        assert conftest.pytest_xdist_auto_num_workers(None) == workers
