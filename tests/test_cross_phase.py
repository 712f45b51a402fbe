"""The same weights and prompts give identical greedy token ids in every phase.

Each phase is an optimization of the one before; none may change what the model says. Phase 1 is
the oracle. A runner per phase loads phase 1's weights (state-dict keys never change) and decodes
greedily; later phases add their runner here.

Greedy argmax can legitimately flip between two implementations when the top two logits nearly
tie (float32 sums in a different order differ by ~1e-6). The oracle therefore also checks that
every step of its path has a top-1/top-2 margin far above that noise, so a mismatch here is a bug,
not rounding.

Phases 6-8 run real checkpoints (a tiny random Qwen3 built by transformers in the session, and the
embedded SmolLM2); their oracle is Hugging Face transformers' greedy `generate` in float32, with
the same margin check against the larger drift of two independent implementations.
"""

import importlib

import pytest
import torch

from tests.tolerances import HF_MIN_MARGIN, TINY_MIN_MARGIN, assert_no_near_tie

CONFIG_KWARGS = {"max_position_embeddings": 256}
PROMPTS = [[1, 2, 3, 4, 5], [100, 7], [42] * 17, list(range(200, 231))]
MAX_NEW = 24


def build(phase: str, state: dict):
    mod = importlib.import_module(phase)
    model = mod.TinyTransformer(mod.ModelConfig(**CONFIG_KWARGS)).eval()
    model.load_state_dict(state)
    return mod, model


def run_phase1(state):
    mod, model = build("phase1_naive", state)
    return [mod.generate(model, p, max_new_tokens=MAX_NEW) for p in PROMPTS]


def run_phase2(state):
    mod, model = build("phase2_sampling", state)
    params = mod.SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    return [mod.generate(model, p, params) for p in PROMPTS]


def run_phase3(state):
    mod, model = build("phase3_kvcache", state)
    params = mod.SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    return [mod.generate(model, p, params) for p in PROMPTS]


def run_phase3_static_batch(state):
    mod, model = build("phase3_kvcache", state)
    params = mod.SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    return mod.generate_batch(model, PROMPTS, params).token_ids


LONGEST = max(len(p) for p in PROMPTS) + MAX_NEW


def preemptions(trace) -> int:
    return sum(len(step.preempted) for step in trace.steps)


def run_phase4(state, min_preemptions: int = 0, **engine_kwargs):
    mod, model = build("phase4_scheduler", state)
    params = mod.SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    trace = mod.StepTrace()
    # The prompts twice: more requests at once, and each copy must match the other.
    llm = mod.LLM(model, trace=trace, **engine_kwargs)
    token_ids = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, params, use_tqdm=False)]
    assert token_ids[: len(PROMPTS)] == token_ids[len(PROMPTS) :]
    assert preemptions(trace) >= min_preemptions, "the run was meant to preempt"
    return token_ids[: len(PROMPTS)]


def run_phase4_tiny_chunks(state):
    return run_phase4(state, max_num_batched_tokens=3)  # every prompt is prefilled in chunks


def run_phase4_heavy_preemption(state):
    # A KV cache a little larger than the longest request: several are admitted, then the newest
    # are preempted and recomputed (with room for the longest alone, admission's watermark runs
    # them one at a time).
    return run_phase4(state, min_preemptions=2, num_kv_slots=LONGEST + 20)


def run_phase5(state, min_preemptions: int = 0, **engine_kwargs):
    mod, model = build("phase5_paged", state)
    params = mod.SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    trace = mod.StepTrace()
    # The prompts twice: the second copies hit the prefix cache filled by the first ones.
    llm = mod.LLM(model, trace=trace, **engine_kwargs)
    token_ids = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, params, use_tqdm=False)]
    assert token_ids[: len(PROMPTS)] == token_ids[len(PROMPTS) :]
    assert preemptions(trace) >= min_preemptions, "the run was meant to preempt"
    return token_ids[: len(PROMPTS)]


def run_phase5_block_size_1(state):
    return run_phase5(state, block_size=1)


def run_phase5_block_size_7_tiny_chunks(state):
    return run_phase5(state, block_size=7, max_num_batched_tokens=3)  # 7 divides no prompt length


def run_phase5_no_prefix_caching(state):
    return run_phase5(state, enable_prefix_caching=False)


def run_phase5_heavy_preemption(state, **engine_kwargs):
    # Blocks for the longest request alone: the others are preempted, shared blocks included.
    num_kv_blocks = -(-LONGEST // 4)
    return run_phase5(state, 2, block_size=4, num_kv_blocks=num_kv_blocks, **engine_kwargs)


def run_phase5_heavy_preemption_swap(state):
    return run_phase5_heavy_preemption(state, preemption_mode="swap", num_cpu_kv_blocks=64)


RUNNERS = {
    "phase2_sampling": run_phase2,
    "phase3_kvcache": run_phase3,
    "phase3_kvcache/static_batch": run_phase3_static_batch,
    "phase4_scheduler": run_phase4,
    "phase4_scheduler/tiny_chunks": run_phase4_tiny_chunks,
    "phase4_scheduler/heavy_preemption": run_phase4_heavy_preemption,
    "phase5_paged": run_phase5,
    "phase5_paged/block_size_1": run_phase5_block_size_1,
    "phase5_paged/block_size_7_tiny_chunks": run_phase5_block_size_7_tiny_chunks,
    "phase5_paged/no_prefix_caching": run_phase5_no_prefix_caching,
    "phase5_paged/heavy_preemption": run_phase5_heavy_preemption,
    "phase5_paged/heavy_preemption_swap": run_phase5_heavy_preemption_swap,
}


@pytest.fixture(scope="module")
def state():
    import phase1_naive

    torch.manual_seed(0)
    return phase1_naive.TinyTransformer(phase1_naive.ModelConfig(**CONFIG_KWARGS)).state_dict()


@pytest.fixture(scope="module")
def oracle(state):
    outputs = run_phase1(state)
    _, model = build("phase1_naive", state)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out[:-1]]))[0, len(prompt) - 1 :]
        assert_no_near_tie(logits, TINY_MIN_MARGIN)
    return outputs


@pytest.mark.parametrize("phase", sorted(RUNNERS))
def test_greedy_tokens_identical_to_phase1(phase, state, oracle):
    assert RUNNERS[phase](state) == oracle


# --- Seeded sampling: every phase's copy of the sampler draws the same tokens ----------------

SEEDED = dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.02, max_tokens=MAX_NEW)


def seeded_params(mod) -> list:
    return [mod.SamplingParams(seed=i, **SEEDED) for i in range(len(PROMPTS))]


def seeded_phase2(state):
    mod, model = build("phase2_sampling", state)
    return [mod.generate(model, p, sp) for p, sp in zip(PROMPTS, seeded_params(mod), strict=True)]


def seeded_phase3(state):
    mod, model = build("phase3_kvcache", state)
    return [mod.generate(model, p, sp) for p, sp in zip(PROMPTS, seeded_params(mod), strict=True)]


def seeded_engine(phase: str, **engine_kwargs):
    def run(state):
        mod, model = build(phase, state)
        outputs = mod.LLM(model, **engine_kwargs).generate(
            PROMPTS, seeded_params(mod), use_tqdm=False
        )
        return [out.outputs[0].token_ids for out in outputs]

    return run


SEEDED_RUNNERS = {
    "phase3_kvcache": seeded_phase3,
    "phase4_scheduler": seeded_engine("phase4_scheduler"),
    "phase5_paged": seeded_engine("phase5_paged"),
    "phase5_paged/heavy_preemption_swap": seeded_engine(
        "phase5_paged",
        block_size=4,
        num_kv_blocks=-(-LONGEST // 4),
        preemption_mode="swap",
        num_cpu_kv_blocks=64,
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def seeded_oracle(state):
    return seeded_phase2(state)


@pytest.mark.parametrize("phase", sorted(SEEDED_RUNNERS))
def test_seeded_tokens_identical_to_phase2(phase, state, seeded_oracle):
    """A seeded request draws from its own generator: same seed, same tokens, in every phase
    (float32 logits differ by ~1e-6 between phases, far below what moves a multinomial draw
    except by a vanishing chance)."""
    assert SEEDED_RUNNERS[phase](state) == seeded_oracle


# --- Phases 6-8: real checkpoints against Hugging Face transformers --------------------------

REAL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "你好世界", "Hello, world! " * 8]
REAL_MAX_NEW = 12


def run_phase6(model_dir, prompts, **engine_kwargs):
    import phase6_qwen3 as mod

    params = mod.SamplingParams(temperature=0.0, max_tokens=REAL_MAX_NEW)
    llm = mod.LLM(model_dir, dtype="float32", **engine_kwargs)
    # The prompts twice: the second copies hit the prefix cache filled by the first ones.
    outputs = llm.generate(prompts * 2, params, use_tqdm=False)
    token_ids = [out.outputs[0].token_ids for out in outputs]
    assert token_ids[: len(prompts)] == token_ids[len(prompts) :]
    return token_ids[: len(prompts)]


def run_phase6_block_size_7_tiny_chunks(model_dir, prompts):
    return run_phase6(model_dir, prompts, block_size=7, max_num_batched_tokens=5)


REAL_RUNNERS = {
    "phase6_qwen3": run_phase6,
    "phase6_qwen3/block_size_7_tiny_chunks": run_phase6_block_size_7_tiny_chunks,
}


@pytest.fixture(
    scope="module", params=["tiny_qwen3", pytest.param("smollm2", marks=pytest.mark.slow)]
)
def checkpoint(request, tmp_path_factory):
    """A local Hugging Face directory both transformers and the phases load."""
    if request.param == "smollm2":
        from phase6_qwen3.default_model import default_model_dir

        return default_model_dir()
    from tests import assets
    from tests.phase6.conftest import save_tiny_qwen3

    directory = tmp_path_factory.mktemp("tiny-qwen3")
    return save_tiny_qwen3(directory, assets.qwen3_tokenizer_dir(), tied=True)


@pytest.fixture(scope="module")
def real_prompts(checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return [tokenizer(p)["input_ids"] for p in REAL_PROMPTS]


@pytest.fixture(scope="module")
def real_oracle(checkpoint, real_prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    outputs = []
    for prompt in real_prompts:
        with torch.inference_mode():
            seq = model.generate(
                torch.tensor([prompt]), max_new_tokens=REAL_MAX_NEW, do_sample=False
            )
            logits = model(seq[:, :-1]).logits[0, len(prompt) - 1 :]
        assert_no_near_tie(logits, HF_MIN_MARGIN)
        outputs.append(seq[0, len(prompt) :].tolist())
    return outputs


@pytest.mark.parametrize("phase", sorted(REAL_RUNNERS))
def test_greedy_tokens_identical_to_transformers(phase, checkpoint, real_prompts, real_oracle):
    assert REAL_RUNNERS[phase](checkpoint, real_prompts) == real_oracle
