"""The exercises (tests/exercises.py): marked in the code, blanked in workspaces, really tested."""

import ast
import os
import re
import subprocess
import sys

import pytest

from tests import exercises

LESSON_PHASES = range(9)  # every phase teaches at least two exercises
MIN_EXERCISES_PER_PHASE = 2
# `check` runs two halves side by side, one per core. Measured alone (2026-12-06): phases 0-4
# took 29 s and 5-8 50 s (phase 0 18 s, 5 6 s, 6 11 s, 7 18 s, 8 13 s), so 5, 7 and 8 go together.
SECOND_HALF_PHASES = {5, 7, 8}


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
    with pytest.raises(ValueError, match="no exercise 3.1 in phase 5"):
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


def test_a_workspace_holds_several_phases_and_bad_arguments_are_one_line(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(exercises, "WORKSPACE_DIR", tmp_path)
    assert exercises.main(["new", "3", "me"]) == 0
    assert exercises.main(["new", "7", "me"]) == 0  # beside phase 3, not refused
    assert {p.name for p in (tmp_path / "me").glob("phase*")} == {"phase3_kvcache", "phase7_optim"}
    out = capsys.readouterr().out
    assert ".venv/bin/python -m pytest tests/phase7 --impl me" in out  # the whole phase
    fast = "-m pytest tests/phase7/test_kernels.py::test_flash_prefill_uneven_tiles"
    assert f".venv/bin/python {fast}" in out  # and one exercise's tests alone
    for argv, error in [
        (["new", "3", "me"], "phase3_kvcache exists"),
        (["new", "3", "other", "--only", "7.1"], "no exercise 7.1 in phase 3"),
        (["new", "9", "other"], "no phase 9"),
        (["list", "9"], "no phase 9"),
        (["check", "9.9"], "no exercise 9.9"),
        (["new", "3", "a b"], "workspace name"),
    ]:
        assert exercises.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert error in err and err.count("\n") == 1, err
    assert not (tmp_path / "other").exists()  # nothing made by a refused command


def test_each_phase_readme_lists_its_exercises_as_the_tool_does():
    """A README's exercise table is a copy of EXERCISES for reading: the same hint, the same
    tests, and the exercises to write first."""
    for i in exercises.all_markers():
        exercise = exercises.EXERCISES[i]
        readme = exercises.phase_package(exercises.phase_of(i)) / "README.md"
        rows = [line for line in readme.read_text().splitlines() if line.startswith(f"| {i} |")]
        assert len(rows) == 1, f"{readme}: one table row for exercise {i}"
        assert exercise.hint in rows[0], f"{readme}: exercise {i}'s hint"
        named = set(re.findall(r"`(test_\w+)`", rows[0].rsplit("|", 2)[-2]))
        assert named == {t.split("::")[1].split("[")[0] for t in exercise.tests}, i
        first = re.search(r"Write ([\d. and]+) first", rows[0])
        assert set(re.findall(r"\d\.\d", first[1]) if first else []) == set(exercise.needs), i


def test_list_never_prints_nothing():
    for phase in exercises.phase_packages():
        listing = exercises.list_exercises(phase)
        assert f"\n{phase}." in "\n" + listing, phase  # its own exercises, each described
        assert ".venv/bin/python -m pytest tests/phase" in listing


def test_the_blank_names_the_fast_command_and_the_whole_phase(tmp_path):
    copy = exercises.create_workspace(7, tmp_path, only={"7.2"}, name="me")
    text = "".join(re.findall(r'"(.*)"', (copy / "kernels" / "paged_decode.py").read_text()))
    assert ".venv/bin/python -m pytest tests/phase7/test_kernels.py::" in text
    assert "(all of phase 7: .venv/bin/python -m pytest tests/phase7 --impl me)" in text


def test_check_runs_each_exercise_alone_blank_and_with_the_others_blank():
    """The third workspace is what makes the listing fair: an exercise's tests pass while every
    other exercise of its phase is blank (3.1's old test ran 3.2's mask and failed there)."""
    plan = exercises.check_plan(["3.1", "3.2"])
    assert plan == {
        frozenset(): [("3.1", "passed"), ("3.2", "passed")],
        frozenset({"3.1"}): [("3.1", "failed"), ("3.2", "passed")],
        frozenset({"3.2"}): [("3.1", "passed"), ("3.2", "failed")],
    }


def run_pytest(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    return subprocess.run(command, cwd=exercises.ROOT, env=env, capture_output=True, text=True)


def test_impl_takes_the_phase_of_the_tests_named_and_leaves_the_oracle_alone(tmp_path):
    """A workspace with phase 3 (blank) and phase 4 (whole): phase 4's tests run on the
    workspace's phase 4 against the real phase 3, phase 3's on the blank copy."""
    exercises.create_workspace(3, tmp_path)
    exercises.create_workspace(4, tmp_path, only=set())
    phase4 = run_pytest("tests/phase4/test_engine.py::test_finish_reasons", f"--impl={tmp_path}")
    assert phase4.returncode == 0 and "phase4_scheduler from" in phase4.stdout, phase4.stdout
    test = "tests/phase3/test_kvcache.py::test_padding_query_sees_only_itself"
    phase3 = run_pytest(test, f"--impl={tmp_path}")
    assert phase3.returncode == 1 and "NotImplementedError" in phase3.stdout, phase3.stdout
    neither = run_pytest("tests/phase5/test_engine.py", f"--impl={tmp_path}")
    assert neither.returncode != 0 and "holds phase3_kvcache, phase4_scheduler" in neither.stderr


def test_impl_of_a_missing_workspace_is_a_one_line_error():
    done = run_pytest("tests/phase3", "--impl", "no-such-workspace")
    assert done.returncode != 0 and "Traceback" not in done.stderr + done.stdout
    assert "--impl no-such-workspace: no workspace there" in done.stderr


@pytest.mark.slow
def test_each_exercise_fails_blank_and_passes_with_the_phase_code():
    """`python -m tests.exercises check` in two fresh interpreters, one per CPU core: each makes
    its workspaces once, imports torch once and runs only the tests its exercises name."""
    ids = sorted(exercises.EXERCISES)
    halves = [[i for i in ids if exercises.phase_of(i) not in SECOND_HALF_PHASES]]
    halves.append([i for i in ids if exercises.phase_of(i) in SECOND_HALF_PHASES])
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
