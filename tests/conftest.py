"""Test-session set-up shared by every phase's suite.

Triton kernels run on CPU tensors under the interpreter, and the interpreter must be switched on
before any `@triton.jit` function is defined, so this happens here, first. GPU-only tests carry
`@pytest.mark.gpu` and are skipped where no CUDA device exists.

Tests marked `@pytest.mark.slow` (a real model on 30 float32 layers, processes spawned, long
interpreter sweeps) run in CI, where the environment sets `CI` (.ci/run's test command is the
README's), and wherever `--run-slow` or a `-m` expression naming `slow` asks; a learner's
`pytest tests/phase7` skips them, saying so, and stays quick.
"""

import os

# libgomp reads its wait policy once, when torch loads it, so this comes before `import torch`:
# threads that spin at every barrier lose most of their time when other work holds the cores
# (benchmarks/README.md, "Threads"). The phase 7 suite on the shared 2-core machine (load 4-7):
# 270 s with libgomp's default, 100 s with PASSIVE.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import exercises  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite runs in parallel (`pytest -n auto`, pytest-xdist: one worker per core, at most
# MAX_WORKERS): the workers share the cores, so each takes its share of them in threads.
# Measured on the 2-core machine (2026-12-07): 6 min 38 s in one process, 4 min 02 s in two.
MAX_WORKERS = 4
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads() // WORKERS)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    # Past a few workers the heavy tests' memory (a real model in float32 each) grows faster
    # than the suite shortens.
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


def runs_slow_tests(config) -> bool:
    in_ci = os.environ.get("CI", "").lower() not in ("", "0", "false")
    return in_ci or config.getoption("--run-slow") or "slow" in (config.option.markexpr or "")


def pytest_collection_modifyitems(config, items):
    skip_slow = pytest.mark.skip(reason="slow: runs in CI, or here with --run-slow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the H200)")
    for item in items:
        if "slow" in item.keywords and not runs_slow_tests(config):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


# --- --impl: run one phase's tests against a learner's workspace (see tests/exercises.py) ---

IMPL_KEY = pytest.StashKey[exercises.Workspace]()


def pytest_addoption(parser, pluginmanager):
    parser.addoption(
        "--run-slow", action="store_true", help="also run the tests marked slow (CI does)"
    )
    parser.addoption(
        "--impl",
        metavar="WORKSPACE",
        help="test workspace/WORKSPACE (from `python -m tests.exercises new`) instead of the phase",
    )
    # A phase's own conftest (tests/phase6/conftest.py) imports the package while it loads, before
    # pytest_configure; this file loads first, so the workspace goes on sys.path here.
    config = pluginmanager.get_plugin("pytestconfig")
    args = config.invocation_params.args
    name = parser.parse_known_args(args).impl
    if name:
        try:  # a workspace may hold several phases: the tests named pick one
            workspace = exercises.resolve_workspace(name, exercises.phases_named(args))
            exercises.activate_workspace(workspace)
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
        config.stash[IMPL_KEY] = workspace


def pytest_unconfigure(config):
    if IMPL_KEY in config.stash:
        exercises.deactivate_workspace(config.stash[IMPL_KEY])


def pytest_report_header(config):
    if IMPL_KEY in config.stash:
        workspace = config.stash[IMPL_KEY]
        return f"--impl: {workspace.package} from {workspace.directory}"
    return None


def pytest_ignore_collect(collection_path, config):
    if IMPL_KEY in config.stash and exercises.is_other_phase_test(
        collection_path, config.stash[IMPL_KEY]
    ):
        return True
    return None
