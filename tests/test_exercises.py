"""The exercises (tests/exercises.py): marked in the code, blanked in workspaces, really tested."""

import ast
import os
import subprocess
import sys

import pytest

from tests import exercises

LESSON_PHASES = range(7)  # phases 0-6 teach at least two exercises each
MIN_EXERCISES_PER_PHASE = 2
SPLIT_PHASE = 5  # check runs phases 0-4 and 5-7 side by side: about the same time each


def marker_above(path, node) -> str:
    return path.read_text().splitlines()[exercises.first_line(node) - 2].strip()


def source_of(path, node) -> str:
    """The function's text from its first decorator on (any marker above it excluded)."""
    lines = path.read_text().splitlines()
    return "\n".join(lines[exercises.first_line(node) - 1 : node.end_lineno])


def test_every_marker_has_words_and_every_phase_has_exercises():
    markers = exercises.all_markers()
    assert set(markers) == set(exercises.EXERCISES)
    for phase in LESSON_PHASES:
        assert sum(exercises.phase_of(i) == phase for i in markers) >= MIN_EXERCISES_PER_PHASE
    assert any(exercises.phase_of(i) == 7 for i in markers), "the online softmax kernel"
    for exercise in exercises.EXERCISES.values():
        assert exercise.tests and all(t.startswith("tests/phase") for t in exercise.tests)


def test_every_copy_of_a_marked_function_carries_its_marker():
    """A copied function keeps the marker (copied files stay byte-identical); a rewritten one
    drops it, since it is no longer that exercise."""
    for marker in exercises.all_markers().values():
        home = exercises.phase_package(exercises.phase_of(marker.exercise_id))
        name = marker.function
        reference = source_of(marker.path, exercises.functions(marker.path.read_text())[name])
        relative = marker.path.relative_to(home)
        for package in sorted(exercises.ROOT.glob("phase[0-9]_*")):
            path = package / relative
            node = exercises.functions(path.read_text()).get(name) if path.is_file() else None
            if node is None:
                continue
            has_marker = marker_above(path, node).startswith(f"# exercise {marker.exercise_id}:")
            assert has_marker == (source_of(path, node) == reference), f"{path}: {name}"


def test_workspace_blanks_only_its_own_phase(tmp_path):
    package = exercises.phase_package(3)
    copy = exercises.create_workspace(3, tmp_path, name="me")
    blanked = {m.path.relative_to(package) for m in exercises.phase_markers(3)}
    for path in package.rglob("*.py"):
        relative = path.relative_to(package)
        same = (copy / relative).read_text() == path.read_text()
        assert same != (relative in blanked), relative  # rope.py keeps exercise 0.3 intact
    source = (copy / "kv_cache.py").read_text()
    assert "raise NotImplementedError(" in source and "--impl me" in source
    assert "self.k[layer][:, self.length : end] = k_new" not in source
    assert '"""Stores (B, T, H_kv, D) new keys/values' in source  # the docstring stays


def test_workspace_of_one_exercise(tmp_path):
    copy = exercises.create_workspace(5, tmp_path, only={"5.3"})
    functions_blank = [
        n
        for n in ast.walk(ast.parse((copy / "block_manager.py").read_text()))
        if isinstance(n, ast.Raise) and "NotImplementedError" in ast.unparse(n)
    ]
    assert len(functions_blank) == 1
    with pytest.raises(ValueError, match="no such exercise"):
        exercises.create_workspace(5, tmp_path / "other", only={"3.1"})


def test_impl_runs_only_its_phase_tests(tmp_path):
    exercises.create_workspace(3, tmp_path)
    workspace = exercises.resolve_workspace(str(tmp_path))
    assert (workspace.package, workspace.phase) == ("phase3_kvcache", 3)
    tests = exercises.ROOT / "tests"
    assert not exercises.is_other_phase_test(tests, workspace)
    assert not exercises.is_other_phase_test(tests / "phase3" / "test_kvcache.py", workspace)
    assert exercises.is_other_phase_test(tests / "phase4", workspace)  # phase 3 is its oracle
    assert exercises.is_other_phase_test(tests / "test_structure.py", workspace)
    with pytest.raises(ValueError, match="no workspace"):
        exercises.resolve_workspace(str(tmp_path / "missing"))


@pytest.mark.slow
def test_each_exercise_fails_blank_and_passes_with_the_phase_code():
    """`python -m tests.exercises check` in two fresh interpreters, one per CPU core: each makes
    its workspaces once, imports torch once and runs only the tests its exercises name."""
    ids = sorted(exercises.EXERCISES)
    halves = [[i for i in ids if exercises.phase_of(i) < SPLIT_PHASE]]
    halves.append([i for i in ids if exercises.phase_of(i) >= SPLIT_PHASE])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.exercises", "check", *half],
            cwd=exercises.ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for half in halves
    ]
    for run in runs:
        output, _ = run.communicate()
        assert run.returncode == 0, output[-8000:]
