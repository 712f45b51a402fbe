"""Exercises: a learner rewrites the code that carries a phase's lesson; the phase's tests judge it.

The code is marked, not copied. One comment line directly above a function (above its decorators)
names the exercise, `# exercise 3.1: the KV cache append`. A function copied forward into later
phases carries its marker in every copy, so copied files stay byte-identical; only the phase named
by the marker blanks it. `EXERCISES` below holds the words around each marker (the hint, the tests
that check it), never code: the workspace is derived from the phase every time it is made.

    .venv/bin/python -m tests.exercises list [PHASE]       the exercises, their hints and tests
    .venv/bin/python -m tests.exercises new PHASE NAME     workspace/NAME/<phase package>/, blank
    .venv/bin/python -m tests.exercises check [ID ...]     each exercise is judged fairly

In a workspace each marked function of that phase keeps its signature and docstring, and its body
becomes `raise NotImplementedError(<task, hint, test command>)`. One workspace holds any number of
phases side by side (`new 3 me`, then `new 7 me`). `pytest tests/phaseN --impl NAME`
(tests/conftest.py) then imports the workspace's copy of phase N in place of the phase's own: a
directory holding only that package goes first on `sys.path`, so every test file and fixture runs
unchanged on the learner's code, while the oracles (earlier phases, torch, transformers,
`tokenizers`) stay the real ones, even where the workspace holds an earlier phase too.

`check` proves three things for every exercise, so that its tests judge it and nothing else: with
only it blank they fail (the marked code is really tested); with the phase's code pasted back (a
workspace with nothing blank, under --impl) they pass; and with every other exercise of its phase
blank they still pass (they do not depend on another exercise, except the ones it declares in
`needs`, which the hint then names). It runs pytest in-process, once per distinct workspace, so
torch is imported once; tests/test_exercises.py runs it in a subprocess.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import re
import shlex
import shutil
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKSPACE_DIR = ROOT / "workspace"  # git-ignored
MARKER = re.compile(r"^[ \t]*# exercise (?P<id>\d+\.\d+): (?P<title>.+?)[ \t]*$")
MESSAGE_WIDTH = 76  # characters per string literal in the generated `raise`
PYTHON = ".venv/bin/python"  # what .ci/setup makes; every printed command works without activation
PHASE_DIRECTORY = re.compile(r"(?:^|/)tests/phase(?P<phase>\d+)(?:/|::|$)")
IMPORT_ROOTS = ".impl"  # workspace/NAME/.impl/<package>/<package> -> ../../<package>


@dataclass(frozen=True)
class Exercise:
    hint: str
    tests: tuple[str, ...]  # pytest node ids from the repository root; each must fail when blank
    # Exercises of the same phase whose code these tests also run: write those first. Every other
    # exercise of the phase may be blank while these tests pass (`check` proves it).
    needs: tuple[str, ...] = ()


EXERCISES: dict[str, Exercise] = {
    "0.1": Exercise(
        "Start from one id per byte, then repeatedly merge the adjacent pair of lowest merge rank "
        "(self._merges: pair -> (rank, merged id)) until no pair can merge. _merge_pair helps.",
        (
            "tests/phase0/test_tokenizer.py::test_qwen3_known_ids",
            "tests/phase0/test_tokenizer.py::test_qwen3_matches_hf",
        ),
    ),
    "0.2": Exercise(
        "Count adjacent pairs over all words (weighted by word frequency); repeatedly merge the "
        "most frequent pair (ties: smaller ids first), update the counts of the words it touched.",
        (
            "tests/phase0/test_tokenizer.py::test_train_first_merge_is_most_frequent_pair",
            "tests/phase0/test_tokenizer.py::test_train_tie_break_is_deterministic",
        ),
    ),
    "0.3": Exercise(
        "Rotate each (x_i, x_{i+d/2}) pair by the angle of its position: look up cos and sin at "
        "`positions`, compute in float32, return in x's dtype.",
        (
            "tests/phase0/test_model.py::test_rope_scores_depend_only_on_relative_position",
            "tests/phase0/test_model.py::test_rope_matches_transformers_rotary_embedding",
        ),
    ),
    "0.4": Exercise(
        "Repeat each KV head for its group of query heads, scale q @ k^T by 1/sqrt(D), hide the "
        "future with -inf, softmax in float32, multiply by v.",
        ("tests/phase0/test_model.py::test_causal_attention_matches_sdpa",),
    ),
    "1.1": Exercise(
        "Validate the arguments, then loop: run the model over all ids so far, yield the argmax "
        "of the last position, stop after EOS, append the token and go again.",
        (
            "tests/phase1/test_generate.py::test_iter_tokens_streams_the_argmax_and_stops_after_eos",
            "tests/phase1/test_generate.py::test_iter_tokens_checks_its_arguments",
        ),
    ),
    "1.2": Exercise(
        "Collect the stream that iter_tokens yields into a list.",
        ("tests/phase1/test_generate.py::test_each_token_is_the_argmax_of_the_full_sequence",),
        needs=("1.1",),
    ),
    "2.1": Exercise(
        "Sort the probabilities in descending order; a token is dropped when the mass of the "
        "strictly more likely tokens already reaches p. Scatter the mask back to vocab order.",
        (
            "tests/phase2/test_sampling.py::test_top_p_mask",
            "tests/phase2/test_sampling.py::test_filters_compose_in_order",
        ),
    ),
    "2.2": Exercise(
        "Greedy params take the argmax; otherwise softmax the filtered logits and draw one token "
        "with torch.multinomial and this request's own generator.",
        (
            "tests/phase2/test_sampling.py::test_sampled_distribution",
            "tests/phase2/test_sampling.py::test_seed_makes_requests_reproducible",
            "tests/phase2/test_sampling.py::test_greedy_is_argmax",
        ),
    ),
    "3.1": Exercise(
        "Write k_new and v_new into slots [length, length + T) of this layer (ValueError if they "
        "do not fit in max_len) and return every key and value stored so far, new ones included.",
        (
            "tests/phase3/test_kvcache.py::test_cache_update_returns_everything_stored_so_far",
            "tests/phase3/test_kvcache.py::test_cache_overflow_raises",
        ),
    ),
    "3.2": Exercise(
        "Query i sits at position S - T + i. Hide keys after it, and padding keys, except that a "
        "padding query still sees itself (an all -inf row would softmax to NaN).",
        (
            "tests/phase3/test_kvcache.py::test_padding_query_sees_only_itself",
            "tests/phase3/test_kvcache.py::test_a_query_after_the_cache_sees_every_earlier_real_key",
        ),
    ),
    "4.1": Exercise(
        "The tokens the sequence still lacks (num_tokens - num_computed_tokens): with chunked "
        "prefill as many as the budget allows, without it all of them or none.",
        ("tests/phase4/test_scheduler.py::test_num_new_tokens_spends_the_budget",),
    ),
    "4.2": Exercise(
        "Running sequences first, in admission order, each within the budget. When one's next "
        "tokens do not fit in memory, preempt the newest running sequence (LIFO) until they do; "
        "if it was the sequence itself, stop. Return the budget left.",
        (
            "tests/phase4/test_scheduler.py::test_preemption_frees_an_older_sequences_room_newest_first",
            "tests/phase4/test_scheduler.py::test_continuous_batching_admits_as_soon_as_one_finishes",
        ),
        needs=("4.1",),
    ),
    "5.1": Exercise(
        "Record the slots used, then grow the block table until it holds num_computed_tokens + "
        "num_new tokens, taking the least recently freed block and evicting its cached hash.",
        (
            "tests/phase5/test_block_manager.py::"
            "test_append_slots_takes_the_least_recently_freed_block_and_forgets_its_hash",
        ),
    ),
    "5.2": Exercise(
        "Walk the prompt's full blocks (never the one holding the last token), chaining each "
        "block's hash to its parent's; stop at the first miss, or at a hit whose parent or "
        "tokens differ (a collision).",
        (
            "tests/phase5/test_block_manager.py::test_prompt_one_token_longer_than_a_block_matches_that_block",
            "tests/phase5/test_block_manager.py::test_hash_collision_never_reuses_another_prefix",
            "tests/phase5/test_block_manager.py::test_lru_evicts_the_least_recently_freed_cached_block_first",
        ),
        needs=("5.1", "5.3"),  # a cache needs blocks, and its tests write through the slots
    ),
    "5.3": Exercise(
        "Position p lives in the table's block p // block_size, at offset p % block_size.",
        ("tests/phase5/test_block_manager.py::test_slot_walks_the_block_table",),
    ),
    "6.1": Exercise(
        "Check every key and shape first (_check_keys), then copy each checkpoint tensor into the "
        "parameter of the same name, reading each key from the file _check_keys assigned it.",
        (
            "tests/phase6/test_model.py::test_logits_match_transformers",
            "tests/phase6/test_loader.py::test_missing_key",
        ),
    ),
    "6.2": Exercise(
        "Decode the window from prefix_offset twice, without and with the new ids; emit the "
        "difference unless it is empty or ends in U+FFFD, then move both offsets forward.",
        (
            "tests/phase6/test_tokenizer.py::test_incremental_detokenizer_deltas_add_up",
            "tests/phase6/test_tokenizer.py::test_incremental_detokenizer_holds_back_a_split_character",
        ),
    ),
    "7.1": Exercise(
        "Scale the tile's row max into log2 units (max(qk) * qk_scale) and take the new running "
        "max m_ij = max(m_i, that); p = exp2(qk * qk_scale - m_ij); alpha = exp2(m_i - m_ij) "
        "rescales what was summed under the old max: return p, alpha, l_i * alpha + the row "
        "sums of p, and m_ij.",
        ("tests/phase7/test_kernels.py::test_flash_prefill_uneven_tiles",),
    ),
    "7.2": Exercise(
        "Load each split's log-sum-exp (log2 units) and partial output; weight each split by "
        "exp2(lse - max lse) and store the weighted average of the partial outputs in out. "
        "A padded row (seq_len 0) has only empty splits (lse -inf): its output is 0, not NaN.",
        (
            "tests/phase7/test_kernels.py::test_paged_decode_split_k_matches_reference",
            "tests/phase7/test_kernels.py::test_paged_decode_padded_row_reads_nothing",
        ),
        needs=("7.1",),  # both attention kernels run the online-softmax tile loop
    ),
    "8.1": Exercise(
        "For each stop string, try its proper prefixes from the longest one the text could end "
        "with (len(stop) - 1 characters, at most len(text)) down: the first that the text ends "
        "with is that stop string's held-back tail; return the longest over all stop strings.",
        (
            "tests/phase8/test_streaming.py::test_deltas_never_show_what_a_stop_string_removes",
            "tests/phase8/test_streaming.py::test_held_back_length_is_the_longest_tail_a_stop_string_starts_with",
            "tests/phase8/test_streaming.py::test_a_stop_string_split_over_steps_is_never_shown",
        ),
    ),
    "8.2": Exercise(
        "Count each row's output tokens into an (R, V) tensor with index_put_; a token seen in "
        "the prompt or the output gets its logit divided by r if positive, multiplied by r if "
        "not; subtract f x count and p x (count > 0). Work on a float32 copy, never in place.",
        (
            "tests/phase8/test_sampling.py::test_penalties_match_the_reference_formula",
            "tests/phase8/test_sampling.py::test_no_penalty_changes_nothing",
            "tests/phase8/test_sampling.py::test_penalties_leave_the_callers_logits_raw",
        ),
    ),
    "8.3": Exercise(
        "Detokenize the new ids (all but the last when the core says 'stop': a stop token has "
        "no text; flush the detokenizer when the request ended otherwise), add it to the "
        "unsent text, search the stop strings in it (matches ending in what is new), once it has "
        "more than min_tokens tokens, and cut before a match (after it with include_stop_str; "
        "it then ends 'stop', the match its stop_reason, as a stop token in stop_token_ids is "
        "its own); while it runs, hold back the longest tail that starts a stop string (the new "
        "unsent text; held_back_length, exercise 8.1); return the rest as an OutputDelta with "
        "the ids, the logprobs, the finish and stop reasons.",
        (
            "tests/phase8/test_output_processor.py::test_text_equals_the_offline_engine",
            "tests/phase8/test_output_processor.py::test_streamed_text_is_never_taken_back",
            "tests/phase8/test_output_processor.py::test_a_stop_token_has_no_text",
            "tests/phase8/test_output_processor.py::test_a_stop_string_counts_only_after_min_tokens",
            "tests/phase8/test_output_processor.py::"
            "test_stop_reason_names_the_stop_and_a_kept_stop_string_stays",
        ),
        needs=("8.1",),  # the hold-back is held_back_length's
    ),
    "8.4": Exercise(
        "Extend each beam by each of its candidates (tokens + [token], cum_logprob + logprob, "
        "the logprob appended); one that ends in an EOS token (unless ignore_eos) is complete: "
        "finish 'stop', into completed; keep the beam_width best others by score, best first, "
        "as the beams; count the step.",
        (
            "tests/phase8/test_beam_search.py::test_the_search_finds_what_greedy_misses",
            "tests/phase8/test_beam_search.py::"
            "test_eos_sets_a_beam_aside_and_the_length_penalty_weighs_lengths",
        ),
    ),
}


@dataclass(frozen=True)
class Marker:
    exercise_id: str
    title: str
    path: Path
    function: str  # qualified: Class.method
    body_start: int  # first line (1-based) the blank replaces
    body_end: int  # last line it replaces
    indent: str  # the body's indentation


def phase_packages() -> dict[int, Path]:
    """Phase number -> its package directory, for every phase in the repository."""
    found = [p for p in ROOT.glob("phase[0-9]_*") if (p / "__init__.py").is_file()]
    return {int(p.name[len("phase")]): p for p in sorted(found)}


def phase_package(phase: int) -> Path:
    packages = phase_packages()
    if phase not in packages:
        raise ValueError(f"no phase {phase}: the phases are {min(packages)} to {max(packages)}")
    return packages[phase]


def phase_of(exercise_id: str) -> int:
    return int(exercise_id.split(".")[0])


def functions(source: str) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """Qualified name (`Class.method`) -> node, for module-level functions and class methods."""
    found = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                found[prefix + child.name] = child
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")

    walk(ast.parse(source), "")
    return found


def first_line(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Where the function's text starts: its first decorator, or the `def`."""
    return min([node.lineno] + [d.lineno for d in node.decorator_list])


def find_markers(path: Path) -> list[Marker]:
    """The marked functions of one file; a marker not directly above a function is an error."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    by_line = {first_line(node): (name, node) for name, node in functions(source).items()}
    markers = []
    for number, line in enumerate(lines, start=1):
        match = MARKER.match(line)
        if match is None:
            continue
        if number + 1 not in by_line:
            raise ValueError(f"{path}:{number}: exercise marker is not directly above a def")
        name, node = by_line[number + 1]
        body = lines[node.body[-1].lineno - 1]
        indent = body[: len(body) - len(body.lstrip())]
        start = _body_start(node, lines)
        markers.append(
            Marker(match["id"], match["title"], path, name, start, node.end_lineno, indent)
        )
    return markers


def _body_start(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> int:
    """The line after the docstring, or, without one, after the signature (comments included)."""
    first = node.body[0]
    is_docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    if is_docstring and isinstance(first.value.value, str):
        return first.end_lineno + 1
    start = first.lineno
    while start - 1 > node.lineno and lines[start - 2].strip().startswith("#"):
        start -= 1  # a comment leading the body belongs to the body
    return start


def phase_markers(phase: int) -> list[Marker]:
    """The markers of `phase`'s own exercises in its package, in file and line order."""
    markers = []
    for path in sorted(phase_package(phase).rglob("*.py")):
        markers += [m for m in find_markers(path) if phase_of(m.exercise_id) == phase]
    return markers


def all_markers() -> dict[str, Marker]:
    """Exercise id -> its marker; each phase's exercises appear once in that phase's package."""
    found: dict[str, Marker] = {}
    for package in sorted(ROOT.glob("phase[0-9]_*")):
        if not (package / "__init__.py").is_file():
            continue
        for marker in phase_markers(int(package.name[len("phase")])):
            if marker.exercise_id in found:
                raise ValueError(f"exercise {marker.exercise_id} is marked twice in {package}")
            found[marker.exercise_id] = marker
    return found


def pytest_command(targets: Iterable[str], workspace_name: str) -> str:
    """A command to paste into any shell (zsh expands an unquoted `test[param]`)."""
    return f"{PYTHON} -m pytest {' '.join(map(shlex.quote, targets))} --impl {workspace_name}"


def blank_message(marker: Marker, exercise: Exercise, workspace_name: str) -> list[str]:
    """The `raise NotImplementedError(...)` lines that replace the marked body."""
    phase = phase_of(marker.exercise_id)
    needs = f" Write {' and '.join(exercise.needs)} first." if exercise.needs else ""
    text = (
        f"exercise {marker.exercise_id}, {marker.title}: {exercise.hint}{needs} "
        f"Checked by: {pytest_command(exercise.tests, workspace_name)} "
        f"(all of phase {phase}: {pytest_command([f'tests/phase{phase}'], workspace_name)})"
    )
    chunks = textwrap.wrap(text, MESSAGE_WIDTH, break_long_words=False, break_on_hyphens=False)
    chunks = [chunk + " " for chunk in chunks[:-1]] + chunks[-1:]
    inner = marker.indent + " " * 4
    return [
        f"{marker.indent}raise NotImplementedError(",
        *(inner + json.dumps(chunk, ensure_ascii=False) for chunk in chunks),
        f"{marker.indent})",
    ]


def create_workspace(
    phase: int, directory: Path, only: set[str] | None = None, name: str | None = None
) -> Path:
    """Copies phase `phase`'s package into `directory` (beside any other phase already there)
    and blanks its exercises (or `only` these). Returns the package's copy. `name` is what
    --impl is given in the messages. Nothing is written when an argument is wrong."""
    package = phase_package(phase)
    markers = [m for m in phase_markers(phase) if only is None or m.exercise_id in only]
    if only and {m.exercise_id for m in markers} != only:
        unknown = ", ".join(sorted(only - {m.exercise_id for m in markers}))
        own = ", ".join(sorted(m.exercise_id for m in phase_markers(phase))) or "none"
        raise ValueError(f"no exercise {unknown} in phase {phase} (its exercises: {own})")
    target = directory / package.name
    if target.exists():
        raise ValueError(f"{target} exists; delete it to start phase {phase} again")
    shutil.copytree(package, target, ignore=shutil.ignore_patterns("__pycache__"))
    by_file: dict[Path, list[Marker]] = {}
    for marker in markers:
        by_file.setdefault(marker.path, []).append(marker)
    for path, file_markers in by_file.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        for marker in sorted(file_markers, key=lambda m: m.body_start, reverse=True):
            message = blank_message(marker, EXERCISES[marker.exercise_id], name or str(directory))
            lines[marker.body_start - 1 : marker.body_end] = message
        copy = target / path.relative_to(package)
        copy.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return target


# --- --impl: the workspace's package in place of the phase's own (used by tests/conftest.py) ---


@dataclass(frozen=True)
class Workspace:
    directory: Path  # workspace/NAME, resolved
    package: str  # e.g. phase3_kvcache
    phase: int

    @property
    def import_root(self) -> Path:
        """What goes first on sys.path: a directory holding only this phase's package (a link
        to the workspace's copy), so that another phase in the same workspace (an oracle of this
        one's tests, say phase 3 for phase 4) is never imported from it. A directory on sys.path
        also reaches spawned processes (phase 7's tensor-parallel workers)."""
        return self.directory / IMPORT_ROOTS / self.package


def phases_named(args: Iterable[str]) -> set[int]:
    """The phases whose tests a pytest command line names (`tests/phase3`, node ids)."""
    return {int(m["phase"]) for a in args if (m := PHASE_DIRECTORY.search(a.replace("\\", "/")))}


def resolve_workspace(name_or_path: str, phases: set[int] | None = None) -> Workspace:
    """`--impl` takes a workspace name (workspace/<name>) or a path to a workspace directory;
    `phases`, the phases whose tests run, picks the package when the workspace holds several."""
    directory = Path(name_or_path)
    if not directory.is_dir():
        directory = WORKSPACE_DIR / name_or_path
    if not directory.is_dir():
        raise ValueError(
            f"--impl {name_or_path}: no workspace there; make one with "
            f"`{PYTHON} -m tests.exercises new PHASE {name_or_path}`"
        )
    held = {int(p.name[len("phase")]): p.name for p in directory.glob("phase[0-9]_*")}
    candidates = sorted(set(held) & phases) if phases else sorted(held)
    if len(candidates) != 1:
        listed = ", ".join(held[p] for p in sorted(held)) or "no phase package"
        asked = f" (these tests: phase {', '.join(map(str, sorted(phases)))})" if phases else ""
        raise ValueError(
            f"--impl {name_or_path}: {directory} holds {listed}{asked}; run the tests of one "
            f"phase it holds: {pytest_command(['tests/phaseN'], name_or_path)}"
        )
    phase = candidates[0]
    return Workspace(directory.resolve(), held[phase], phase)


def activate_workspace(workspace: Workspace) -> None:
    """Put the workspace's package first on sys.path and check that it is the one imported."""
    if workspace.package in sys.modules:
        raise ValueError(f"--impl: {workspace.package} was imported before the workspace could be")
    link = workspace.import_root / workspace.package
    if not link.is_symlink():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("..", "..", workspace.package), target_is_directory=True)
    sys.path.insert(0, str(workspace.import_root))
    module = __import__(workspace.package)
    origin = Path(module.__file__).resolve()
    if workspace.directory not in origin.parents:
        raise ValueError(f"--impl: {workspace.package} resolved to {origin}, not the workspace")


def deactivate_workspace(workspace: Workspace) -> None:
    if str(workspace.import_root) in sys.path:
        sys.path.remove(str(workspace.import_root))


def is_other_phase_test(path: Path, workspace: Workspace) -> bool:
    """With --impl only that phase's tests run: the others would use the learner's package as
    an oracle (phase 4's tests compare against phase 3) or test a package it does not replace."""
    tests_dir, own = ROOT / "tests", ROOT / "tests" / f"phase{workspace.phase}"
    path = path.resolve()
    if path == tests_dir or tests_dir not in path.parents or path.name == "conftest.py":
        return False
    return path != own and own not in path.parents


# --- check: every exercise's tests judge it and nothing else ---


class _Outcomes:
    """A pytest plugin recording each test's outcome (a failure in setup counts as a failure)."""

    def __init__(self):
        self.by_nodeid: dict[str, str] = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.by_nodeid.setdefault(report.nodeid, report.outcome)


def run_tests(node_ids: list[str], impl: Path | None) -> tuple[dict[str, str], str]:
    """Runs the tests in this process; returns (nodeid -> outcome, pytest's output)."""
    import pytest

    for name in [n for n in sys.modules if n.startswith(("phase", "tests.phase"))]:
        del sys.modules[name]  # the next run imports the phases (and their test modules) afresh
    args = [*node_ids, "-p", "no:cacheprovider", "-q", "--tb=line", "--run-slow"]
    args += [f"--impl={impl}"] if impl else []  # one token: pytest never takes it for a test path
    outcomes, output = _Outcomes(), io.StringIO()
    with contextlib.redirect_stdout(output):
        pytest.main(args, plugins=[outcomes])
    return outcomes.by_nodeid, output.getvalue()


def _items_of(test: str, outcomes: dict[str, str]) -> list[str]:
    """The outcomes of a named test, one per parametrization."""
    return [o for nodeid, o in outcomes.items() if nodeid == test or nodeid.startswith(test + "[")]


# What each exercise's tests must do in a workspace, keyed by the exercises blank in it.
Plan = dict[frozenset[str], list[tuple[str, str]]]  # blank ids -> [(exercise id, outcome)]


def check_plan(ids: list[str]) -> Plan:
    """Three workspaces per exercise: nothing blank (its tests pass), only it blank (they
    fail), and every other exercise of its phase blank but those it needs (they pass).
    Workspaces with the same blanks are one run."""
    plan: Plan = {}
    for i in ids:
        phase_ids = {m.exercise_id for m in phase_markers(phase_of(i))}
        alone = frozenset(phase_ids - {i} - set(EXERCISES[i].needs))
        for blank, outcome in ((frozenset(), "passed"), (frozenset({i}), "failed")):
            plan.setdefault(blank, []).append((i, outcome))
        plan.setdefault(alone, []).append((i, "passed"))
    return {blank: sorted(set(expected)) for blank, expected in plan.items()}


def check(ids: list[str], seconds: dict[int, float] | None = None) -> list[str]:
    """Problems found; empty when every exercise in `ids` is judged fairly (`check_plan`). The
    workspace with nothing blank has the phase's code pasted back, so the --impl path itself is
    proven too. `seconds` collects each phase's wall time."""
    markers = all_markers()
    problems = [f"exercise {i}: in EXERCISES, marked nowhere" for i in set(ids) - set(markers)]
    problems += [f"exercise {i}: marked, not in EXERCISES" for i in set(markers) - set(EXERCISES)]
    ids = [i for i in ids if i in markers and i in EXERCISES]
    problems += [
        f"exercise {i}: needs {n}, not an exercise of its phase"
        for i in ids
        for n in EXERCISES[i].needs
        if n not in markers or phase_of(n) != phase_of(i) or n == i
    ]
    with tempfile.TemporaryDirectory(prefix="exercises-") as tmp:
        for phase in sorted({phase_of(i) for i in ids}):
            started = time.perf_counter()
            plan = check_plan([i for i in ids if phase_of(i) == phase])
            for n, (blank, expected) in enumerate(sorted(plan.items(), key=lambda kv: len(kv[0]))):
                workspace = Path(tmp) / f"phase{phase}-{n}"
                create_workspace(phase, workspace, only=set(blank))
                tests = sorted({t for i, _ in expected for t in EXERCISES[i].tests})
                problems += _expect(expected, run_tests(tests, workspace), blank)
            if seconds is not None:
                seconds[phase] = time.perf_counter() - started
    return problems


def _expect(
    expected: list[tuple[str, str]], run: tuple[dict[str, str], str], blank: frozenset[str]
) -> list[str]:
    """Every named test of these exercises ran and ended as expected: "passed", every
    parametrization of it; "failed", at least one (the learner's run is red)."""
    outcomes, output = run
    where = f"with {', '.join(sorted(blank))} blank" if blank else "with nothing blank"
    problems = []
    for i, outcome in expected:
        for test in EXERCISES[i].tests:
            results = _items_of(test, outcomes)
            ok = "failed" in results if outcome == "failed" else set(results) == {"passed"}
            if not ok:
                problems.append(f"exercise {i}: {test} is not {outcome} {where}: {results}")
    return problems + [output] if problems else []


# --- the command line ---


def describe(exercise_id: str, marker: Marker, workspace_name: str = "NAME") -> str:
    exercise = EXERCISES[exercise_id]
    where = f"{marker.path.relative_to(ROOT)}: {marker.function}"
    hint = textwrap.wrap(exercise.hint, MESSAGE_WIDTH + 20, break_on_hyphens=False)
    lines = [f"{exercise_id}  {marker.title}  ({where})", *(f"    {h}" for h in hint)]
    if exercise.needs:
        lines.append(f"    Write {' and '.join(exercise.needs)} first: these tests run it too.")
    lines.append("    checked by:")
    lines += [f"      {t}" for t in exercise.tests]
    lines.append(f"    run them:  {pytest_command(exercise.tests, workspace_name)}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PYTHON} -m tests.exercises", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="show the exercises")
    listing.add_argument("phase", type=int, nargs="?")
    new = commands.add_parser("new", help="add one phase, exercises blank, to a workspace")
    new.add_argument("phase", type=int)
    new.add_argument("name", help="the workspace: workspace/NAME, then pytest --impl NAME")
    new.add_argument("--only", nargs="+", metavar="ID", help="blank only these exercises")
    checking = commands.add_parser("check", help="each exercise's tests judge it and no other")
    checking.add_argument("ids", nargs="*", metavar="ID", help="default: every exercise")
    return parser


def list_exercises(phase: int | None) -> str:
    markers = all_markers()
    if phase is not None:
        phase_package(phase)  # a phase that does not exist is an error, not an empty list
        markers = {i: m for i, m in markers.items() if phase_of(i) == phase}
        if not markers:
            return f"phase {phase} has no exercises yet"
    return "\n".join(describe(i, m) for i, m in sorted(markers.items()))


def new_workspace(phase: int, name: str, only: set[str] | None) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"workspace name {name!r}: use letters, digits, _ . -")
    directory = WORKSPACE_DIR / name
    target = create_workspace(phase, directory, only, name=name)
    package = phase_package(phase)
    chosen = [
        (i, m)
        for i, m in sorted(all_markers().items())
        if phase_of(i) == phase and (only is None or i in only)
    ]
    held = sorted(p.name for p in directory.glob("phase[0-9]_*"))
    shown = target.relative_to(ROOT) if target.is_relative_to(ROOT) else target
    return "\n".join(
        [
            f"made {shown} (workspace/{name} holds {', '.join(held)}); your exercises:\n",
            *(describe(i, m, name) for i, m in chosen),
            "",
            f"run all of phase {phase}'s tests on your code:",
            f"  {pytest_command([f'tests/phase{phase}'], name)}",
            f"compare with the phase:  git diff --no-index {package.name} {shown}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            print(list_exercises(args.phase))
        elif args.command == "new":
            print(new_workspace(args.phase, args.name, set(args.only) if args.only else None))
        else:
            seconds: dict[int, float] = {}
            ids = args.ids or sorted(EXERCISES)
            unknown = sorted(set(ids) - set(EXERCISES))
            if unknown:
                raise ValueError(f"no exercise {', '.join(unknown)} (see `list`)")
            problems = check(ids, seconds)
            times = ", ".join(f"phase {phase} {s:.1f} s" for phase, s in seconds.items())
            print("\n".join(problems) or f"ok: {len(ids)} exercises ({times})")
            return 1 if problems else 0
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
