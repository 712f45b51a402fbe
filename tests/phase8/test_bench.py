"""`mini-vllm bench`: the serving client against the live test server, and the offline
throughput and latency benchmarks on the tiny checkpoint, each through the command line."""

import asyncio
import json

import httpx

from phase8_serving.bench import _one_request, offered_load, random_dataset, workload_w
from phase8_serving.cli import main

TOKEN_ID_LIMIT = "256"  # the tiny checkpoint's byte tokens (its vocabulary is 259)


def test_bench_serve_measures_every_request(live_server, tmp_path):
    out = tmp_path / "serve.json"
    main(["bench", "serve", "--base-url", live_server.base_url, "--model", "tiny",
          "--num-prompts", "8", "--random-input-len", "8", "--random-output-len", "4",
          "--random-token-id-limit", TOKEN_ID_LIMIT, "--ignore-eos",
          "--request-rate", "40", "inf", "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert [run["request_rate"] for run in result["runs"]] == [40.0, "inf"]
    for run in result["runs"]:
        assert (run["completed"], run["failed"]) == (8, 0), run["errors"]
        # token-id prompts and ignore_eos reached the engine: every request ran to max_tokens
        assert run["total_output_tokens"] == run["requested_output_tokens"]
        ttft, e2el = run["ttft_ms"], run["e2el_ms"]
        assert 0 < ttft["p50"] <= ttft["p99"] and ttft["mean"] <= e2el["mean"]
    assert out.with_suffix(".png").stat().st_size > 0  # latency against load, one point a rate
    live_server.wait_until_idle(timeout=5)


def sse(*chunks: dict) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def measure(body: str):
    async def main():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
        async with httpx.AsyncClient(transport=transport) as client:
            return await _one_request(client, "http://server/v1/completions", {}, {})

    return asyncio.run(main())


def test_bench_serve_counts_a_token_without_text_and_fails_an_error_chunk():
    """vLLM's rule: any chunk with a choice is a token, even with no text (a byte that completes
    no character, a special token), so a one-token reply like that is measured, not failed; an
    error chunk mid-stream is a failure that says why."""
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    silent = measure(sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}, usage))
    assert silent.ok and silent.ttft > 0 and silent.output_tokens == 1
    first = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
    failed = measure(sse(first, {"error": {"message": "the engine failed: boom"}}))
    assert not failed.ok and failed.error == "server error: the engine failed: boom"
    assert measure(sse(usage)).error == "no choice in the stream"


def test_bench_serve_counts_failures_instead_of_crashing(live_server, tmp_path):
    out = tmp_path / "serve.json"
    main(["bench", "serve", "--base-url", live_server.base_url, "--model", "no-such-model",
          "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2",
          "--random-token-id-limit", TOKEN_ID_LIMIT, "--out", str(out)])  # fmt: skip
    (run,) = json.loads(out.read_text())["runs"]
    assert (run["completed"], run["failed"]) == (0, 2)
    assert "HTTP 404" in run["errors"][0]


def test_bench_throughput_and_latency_run_the_engine(tiny_dir, tmp_path):
    engine = ["--model", str(tiny_dir), "--dtype", "float32", "--device", "cpu",
              "--random-token-id-limit", TOKEN_ID_LIMIT, "--max-num-seqs", "4"]  # fmt: skip
    main(["bench", "throughput", *engine, "--num-prompts", "4", "--input-len", "8",
          "--output-len", "4", "--out", str(tmp_path / "throughput.json")])  # fmt: skip
    throughput = json.loads((tmp_path / "throughput.json").read_text())
    assert throughput["num_prompts"] == 4 and throughput["output_tok_s"] > 0
    main(["bench", "latency", *engine, "--batch-size", "2", "--input-len", "8",
          "--output-len", "3", "--num-iters", "2", "--num-iters-warmup", "0",
          "--out", str(tmp_path / "latency.json")])  # fmt: skip
    latency = json.loads((tmp_path / "latency.json").read_text())
    assert len(latency["latencies_s"]) == 2 and latency["avg_latency_s"] > 0


def test_workload_w_is_nano_vllms():
    """The one definition of workload W (the repository's benchmarks import it from here)
    draws nano-vllm's published token counts."""
    w = workload_w()
    assert len(w) == 256
    assert sum(len(r.prompt_ids) for r in w) == 142_827
    assert sum(r.max_tokens for r in w) == 133_966


def test_random_dataset_lengths_span_the_range_ratio():
    requests = random_dataset(64, 100, 10, 0.5, seed=1, token_id_limit=7)
    assert {len(r.prompt_ids) for r in requests} <= set(range(50, 151))
    assert {r.max_tokens for r in requests} <= set(range(5, 16))
    assert max(t for r in requests for t in r.prompt_ids) < 7
    assert requests == random_dataset(64, 100, 10, 0.5, seed=1, token_id_limit=7)


def test_the_latency_plot_puts_the_offered_rate_on_its_x_axis():
    """A noisy run can achieve less at a higher offered rate; plotted against what it achieved,
    latency would seem to fall as load rises."""
    runs = [
        {"request_rate": 4.0, "request_throughput": 3.9},
        {"request_rate": 8.0, "request_throughput": 3.1},  # achieved less than at 4
        {"request_rate": "inf", "request_throughput": 3.5},
    ]
    x, labels = offered_load(runs)
    assert x == sorted(x) and x[:2] == [4.0, 8.0] and x[2] > 8.0
    assert labels == ["4", "8", "all at once"]
