"""Every benchmark keeps benchmarks/README.md's promise: one command line, built on
`harness.benchmark_parser` (`--out DIR` defaulting to a scratch directory, `--quick`, `--threads`
where it means something), so that trying a script never overwrites a committed result; and
the harness they share holds workload W itself."""

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import harness

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(
    p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in ("__init__", "harness")
)
# Single-threaded by design (the tokenizer) or timed on a GPU: no --threads.
NO_THREADS = {
    "tokenizer_speed", "phase6_qwen3_gpu", "phase7_gemv", "phase7_kernels", "phase7_optim",
    "phase7_tp", "phase7_qwen3_5", "phase7_prefill", "phase8_serving", "phase7_kernel_sass",
    "phase7_gemv_engine",
}  # fmt: skip


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_takes_the_shared_options(script):
    module = importlib.import_module(f"benchmarks.{script}")
    parser = module.build_parser()
    defaults = parser.parse_args([])
    assert defaults.out == harness.SCRATCH_DIR and defaults.quick is False
    assert parser.parse_args(["--out", "d"]).out == Path("d")
    assert hasattr(defaults, "threads") == (script not in NO_THREADS)
    assert "--out DIR" in module.__doc__  # and the docstring agrees
    assert not re.search(r"--out (PATH|FILE|\S+\.json)", module.__doc__)


def test_out_is_a_directory_never_a_file(monkeypatch, capsys):
    parser = harness.benchmark_parser("a benchmark")
    monkeypatch.setattr("sys.argv", ["bench", "--out", "results/x.json"])
    with pytest.raises(SystemExit):
        harness.parse_args(parser)
    assert "--out takes a directory" in capsys.readouterr().err


def test_a_quick_ladder_never_overwrites_the_full_one(tmp_path, monkeypatch):
    from benchmarks import phase_ladder

    names = []
    monkeypatch.setattr(phase_ladder, "cpu_setup", lambda quick: None)
    monkeypatch.setattr(phase_ladder, "write_result", lambda name, result, out: out / name)
    monkeypatch.setattr(phase_ladder, "plot", lambda result, path: None)
    monkeypatch.setattr(phase_ladder, "run_ladder", lambda a, s, name: names.append(name) or {})
    for quick in ([], ["--quick"]):
        monkeypatch.setattr("sys.argv", ["phase_ladder", "--out", str(tmp_path), *quick])
        phase_ladder.main()
    assert names == ["phase_ladder_cpu", "phase_ladder_cpu_quick"]


def test_a_result_holding_an_engine_config_is_written(tmp_path):
    """benchmarks/phase6_qwen3.py records `dataclasses.asdict(llm.engine.config)`, whose
    preemption mode is an Enum: json alone raised on it, after a run of many minutes."""
    import dataclasses

    from benchmarks.harness import write_result
    from phase6_qwen3.config import EngineConfig

    config = dataclasses.asdict(EngineConfig())
    path = write_result("probe", {"engine_config": config, "model": tmp_path}, tmp_path)
    written = json.loads(path.read_text())
    assert written["engine_config"]["preemption_mode"] == config["preemption_mode"].value
    assert written["model"] == str(tmp_path)


def test_serving_benchmark_takes_data_parallel_sizes(capsys):
    from benchmarks import phase8_serving

    parser = phase8_serving.build_parser()
    assert parser.parse_args(["--data-parallel-only", "1,2"]).data_parallel_only == [1, 2]
    assert parser.parse_args([]).data_parallel_only is None
    for bad in ("0,2", "two", ""):
        with pytest.raises(SystemExit):
            parser.parse_args(["--data-parallel-only", bad])
        assert "sizes are integers >= 1" in capsys.readouterr().err


def test_the_harness_needs_no_phase_8_and_draws_the_same_w_as_mini_vllm_bench():
    """The benchmarks of phases 0-7 import the harness: it must not pull in phase 8 (a server's
    dependencies) for workload W, and its W must be the one `mini-vllm bench` draws."""
    code = "import sys, benchmarks.harness; sys.exit('phase8_serving' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
    from phase8_serving import bench

    ours = [(r.prompt_ids, r.max_tokens) for r in harness.workload_w()]
    assert ours == [(r.prompt_ids, r.max_tokens) for r in bench.workload_w()]
    assert sum(len(p) for p, _ in ours) == 142_827 and sum(m for _, m in ours) == 133_966
    assert harness.W_TEMPERATURE == bench.W_TEMPERATURE


def test_tp_single_stream_floor_reads_every_weight_but_the_embedding_table():
    """benchmarks/phase7_tp's byte floor of a decode step, against transformers' own parameter
    count of the same config (Qwen3-8B: untied, so the embedding gives one row, not its table)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from benchmarks import phase7_tp

    config = {k: v for k, v in phase7_tp.MODELS["qwen3-8b"].items() if k != "architectures"}
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config))
    embedding = model.model.embed_tokens.weight
    read = sum(p.numel() for p in model.parameters()) - embedding.numel() + embedding.shape[1]
    floor_bytes = phase7_tp.decode_bytes_per_rank(phase7_tp.MODELS["qwen3-8b"], 1, context=0)
    assert floor_bytes == pytest.approx(2 * read, rel=1e-4)  # bf16; q/k-norm gains left out
    kv_token = 2 * 36 * 8 * 128 * 2  # K and V, 36 layers, 8 KV heads of 128, bf16
    with_context = phase7_tp.decode_bytes_per_rank(phase7_tp.MODELS["qwen3-8b"], 1, context=640)
    assert with_context - floor_bytes == 640 * kv_token


def test_tp_early_loads_width_reaches_the_run_and_only_at_tp_1():
    """phase7_tp's --early-loads-max-width is an A/B knob of decode attention's early loads: it is
    set in the driver's process, so a run whose other ranks would not see it is refused."""
    from benchmarks import phase7_tp

    runs = phase7_tp.parse_runs(["qwen3-8b:1@64"], 256, False, False, 4096)
    assert [r.early_loads_max_width for r in runs] == [4096]
    assert phase7_tp.parse_runs(["qwen3-8b:1"], 256, False, False)[0].early_loads_max_width is None
    with pytest.raises(SystemExit, match="TP=1"):
        phase7_tp.parse_runs(["qwen3-8b:1,2"], 256, False, False, 4096)
