"""Phase 7 kernels against their pure-torch references (reference.py), and the references
against torch's own SDPA.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py) on small shapes in
fp32/fp16: the interpreter gets bf16 tl.dot wrong, and it accepts tiles a GPU rejects, so the
`gpu` tests below (bf16/fp16, head_dim 64/128, GQA 1/2/8, block sizes 16/256, contexts to 32k)
are the ones that prove the kernels on hardware: `pytest -m gpu tests/phase7` on the H200.
"""

import os
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the phase 7 kernels need triton (pip install triton)")

from phase7_optim.kernels import (  # noqa: E402
    PAD_SLOT_ID,
    flash_attn_varlen_paged,
    gather_kv,
    paged_decode_attention,
    paged_decode_attention_ref,
    store_kvcache,
    store_kvcache_ref,
    varlen_paged_attention_ref,
)
from phase7_optim.kernels.flash_prefill import PrefillConfig
from phase7_optim.kernels.paged_decode import MAX_SPLITS, DecodeConfig, choose_num_splits

# Kernel vs fp32 reference. fp32: the interpreter's dot is exact fp32 (GPU fp32 would be tf32,
# and is not tested there); fp16/bf16: P is rounded to the input dtype before P @ V.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
# ‖out - ref‖ / ‖ref‖ over the whole output. Elementwise tolerances alone are blind to a kernel that
# ignores part of a long context: averaged over 32k random keys every output element is tiny, so
# dropping the last 4,768 keys moves each by less than atol (test_relative_error_sees_a_dropped_
# context_tail). The norm ratio compares the error with the signal instead.
REL_ERRORS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
CPU = torch.device("cpu")
# Triton runs CPU tensors only under its interpreter (what conftest.py turns on without CUDA)
interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests need TRITON_INTERPRET=1"
)
CUDA = torch.device("cuda")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return float((actual.double() - expected).norm() / expected.norm())


def assert_allclose(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.isfinite(actual).all(), "non-finite output (an unwritten or empty row?)"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[actual.dtype])
    error = relative_error(actual, expected)
    assert error < REL_ERRORS[actual.dtype], f"relative error {error:.2e}"


@dataclass
class PagedBatch:
    """A packed step: new queries after `context_lens` cached tokens, caches with random junk."""

    q: torch.Tensor  # (T, H, D)
    k_cache: torch.Tensor  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # int32 (num_seqs + 1,)
    seq_lens: torch.Tensor  # int32 (num_seqs,)
    block_tables: torch.Tensor  # int32 (num_seqs, max_blocks_per_seq)
    max_query_len: int
    scale: float


def make_paged_batch(
    q_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0
) -> PagedBatch:
    torch.manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, context_lens, strict=True)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 1  # one spare column: it must never be read
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks hold junk the kernels must not see
    perm = torch.randperm(num_blocks).int()
    # unused table entries point at real (junk) blocks, so a read past seq_len shows up
    block_tables = perm[torch.randint(0, num_blocks, (len(q_lens), max_blocks))]
    start = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[start : start + n]
        start += n
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return PagedBatch(
        q=torch.randn(sum(q_lens), num_heads, head_dim).to(device, dtype),
        k_cache=torch.randn(cache_shape).to(device, dtype),
        v_cache=torch.randn(cache_shape).to(device, dtype),
        query_start_loc=torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).int().to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(q_lens),
        scale=head_dim**-0.5,
    )


def check_prefill(batch: PagedBatch, config: PrefillConfig | None = None) -> None:
    b = batch
    args = (b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables)
    out = flash_attn_varlen_paged(*args, b.max_query_len, b.scale, config=config)
    assert_allclose(out, varlen_paged_attention_ref(*args, b.scale))


def check_decode(
    batch: PagedBatch, num_splits: int | None, config: DecodeConfig | None = None
) -> None:
    b = batch
    args = (b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables, b.scale)
    out = paged_decode_attention(*args, num_splits=num_splits, config=config)
    assert_allclose(out, paged_decode_attention_ref(*args))


# ---- the references are what they claim to be -------------------------------------------------


def test_reference_matches_sdpa_on_contiguous_prefill():
    b = make_paged_batch([5, 23, 11], [0, 0, 0], 4, 2, 16, 4, torch.float32, CPU)
    out = varlen_paged_attention_ref(
        b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables, b.scale
    )
    starts = b.query_start_loc.tolist()
    for i, seq_len in enumerate(b.seq_lens.tolist()):
        k = gather_kv(b.k_cache, b.block_tables[i], seq_len).repeat_interleave(2, dim=1)
        v = gather_kv(b.v_cache, b.block_tables[i], seq_len).repeat_interleave(2, dim=1)
        q = b.q[starts[i] : starts[i + 1]]
        expected = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        ).transpose(0, 1)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], expected, atol=1e-5, rtol=1e-5)


def test_relative_error_sees_a_dropped_context_tail():
    """The failure the norm ratio exists for: a decode over a 32k context that skips its last
    4,768 keys passes the elementwise bf16 tolerance, and fails the relative error."""
    b = make_paged_batch([1], [32767], 2, 1, 64, 256, torch.float32, CPU)
    args = (b.q, b.k_cache, b.v_cache)
    full = paged_decode_attention_ref(*args, b.seq_lens, b.block_tables, b.scale)
    short = paged_decode_attention_ref(*args, b.seq_lens - 4768, b.block_tables, b.scale)
    full, short = full.bfloat16(), short.bfloat16()
    torch.testing.assert_close(short.float(), full.float(), **TOLERANCES[torch.bfloat16])
    with pytest.raises(AssertionError, match="relative error"):
        assert_allclose(short, full)


# ---- CPU: Triton interpreter, small shapes ------------------------------------------------------


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kvcache_matches_reference_and_skips_padding(dtype):
    num_blocks, block_size, num_kv_heads, head_dim = 6, 4, 3, 16  # 3 KV heads: a masked lane
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    slot_mapping = torch.tensor([5, PAD_SLOT_ID, 0, 23, PAD_SLOT_ID, 9], dtype=torch.int64)
    k = torch.randn(len(slot_mapping), num_kv_heads, head_dim).to(dtype)
    v = torch.randn_like(k)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    store_kvcache_ref(k, v, k_ref, v_ref, slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # a copy is exact


PREFILL_CASES = {
    # name: (q_lens, context_lens); block size 16 divides none of the lengths
    "ragged": ([1, 19, 40], [0, 0, 0]),
    "chunked": ([16, 9, 30], [32, 45, 7]),  # earlier chunks / prefix-cache hits already cached
}


@interpreter
@pytest.mark.parametrize("case", PREFILL_CASES)
@pytest.mark.parametrize(
    "dtype, num_heads, num_kv_heads, head_dim",
    [
        pytest.param(torch.float32, 2, 2, 64, marks=pytest.mark.slow),  # MHA
        (torch.float32, 4, 2, 64),  # GQA 2
        (torch.float16, 4, 1, 32),  # GQA 4 (MQA)
        pytest.param(torch.float16, 2, 1, 128, marks=pytest.mark.slow),
    ],
)
def test_flash_prefill_matches_reference(case, dtype, num_heads, num_kv_heads, head_dim):
    q_lens, context_lens = PREFILL_CASES[case]
    batch = make_paged_batch(
        q_lens, context_lens, num_heads, num_kv_heads, head_dim, 16, dtype, CPU
    )
    check_prefill(batch)


@interpreter
@pytest.mark.parametrize("block_m, block_n", [(32, 16), (16, 32)])
def test_flash_prefill_uneven_tiles(block_m, block_n):
    """The causal band logic must hold when query and key tiles differ in size."""
    batch = make_paged_batch([37, 8], [21, 0], 2, 1, 32, 8, torch.float32, CPU)
    check_prefill(batch, PrefillConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=1))


@interpreter
def test_flash_prefill_starts_the_longest_query_tiles_first(monkeypatch):
    """The grid runs heads fastest and query tiles last to first (a causal prompt's last tiles
    cost the most): the launch is (heads, query tiles, sequences) and program 0 of axis 1 takes
    the last tile. Past `longest_first_max_context` tokens of context (read from the block
    table's width) the tiles go in launch order. Results cannot show an order, so this reads the
    launch and the kernel."""
    import inspect

    from phase7_optim.kernels import flash_prefill

    grids = []
    kernel = flash_prefill._flash_attn_varlen_paged_kernel
    launch = type(kernel).__getitem__
    monkeypatch.setattr(
        type(kernel), "__getitem__", lambda self, grid: grids.append(grid) or launch(self, grid)
    )
    batch = make_paged_batch([37, 8], [21, 0], 4, 2, 32, 8, torch.float32, CPU)
    config = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    assert config.longest_first  # the default
    check_prefill(batch, config)
    in_order = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1,
                             longest_first=False)  # fmt: skip
    check_prefill(batch, in_order)  # the ablation's order computes the same
    widest = batch.block_tables.shape[1] * 8  # the longest context the table can hold: 72
    for max_context in (widest, widest - 1):
        check_prefill(batch, replace(config, longest_first_max_context=max_context))
    # 4 heads, cdiv(37, 16) query tiles, 2 sequences
    assert grids == [(4, 3, 2), (3, 4, 2), (4, 3, 2), (3, 4, 2)]
    source = inspect.getsource(kernel.fn)
    ordered = source.partition("if LONGEST_FIRST:")[2].partition("else:")[0]
    assert "head = tl.program_id(0)" in ordered
    assert "start_m = tl.num_programs(1) - 1 - tl.program_id(1)" in ordered


@interpreter
def test_chunked_prefill_through_the_cache_equals_one_shot_prefill():
    """store_kvcache + flash prefill in two chunks gives the rows of a single whole prefill."""
    torch.manual_seed(0)
    seq_len, chunk, num_heads, num_kv_heads, head_dim, block_size = 45, 28, 4, 2, 32, 16
    q = torch.randn(seq_len, num_heads, head_dim)
    k = torch.randn(seq_len, num_kv_heads, head_dim)
    v = torch.randn(seq_len, num_kv_heads, head_dim)
    k_cache = torch.zeros(5, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    block_table = torch.tensor([[3, 0, 4]], dtype=torch.int32)
    positions = torch.arange(seq_len)
    slots = (block_table[0, positions // block_size] * block_size + positions % block_size).long()

    def prefill(lo, hi):  # one step: store positions lo..hi-1, attend with them as new tokens
        store_kvcache(k[lo:hi], v[lo:hi], k_cache, v_cache, slots[lo:hi])
        query_start_loc = torch.tensor([0, hi - lo], dtype=torch.int32)
        seq_lens = torch.tensor([hi], dtype=torch.int32)
        return flash_attn_varlen_paged(
            q[lo:hi], k_cache, v_cache, query_start_loc, seq_lens, block_table, hi - lo, 0.2
        )

    chunked = torch.cat([prefill(0, chunk), prefill(chunk, seq_len)])
    whole = prefill(0, seq_len)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


@interpreter
@pytest.mark.parametrize(
    "dtype, num_heads, num_kv_heads", [(torch.float32, 2, 2), (torch.float16, 8, 1)]
)
@pytest.mark.parametrize(  # 8: splits past short sequences' end
    "num_splits", [None, pytest.param(1, marks=pytest.mark.slow), 3, 8]
)
def test_paged_decode_split_k_matches_reference(dtype, num_heads, num_kv_heads, num_splits):
    context_lens = [0, 36, 99, 150, 63]  # seq_lens 1, 37, 100, 151, 64 (whole key tiles only)
    batch = make_paged_batch([1] * 5, context_lens, num_heads, num_kv_heads, 32, 16, dtype, CPU)
    check_decode(batch, num_splits)  # one split (None here, and 1) writes the output itself
    check_decode(batch, num_splits, MERGING)  # every split count through the merge kernel


MERGING = DecodeConfig(block_n=32, num_warps=4, num_stages=1, direct_single_split=False)


@interpreter
@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_decode_padded_row_reads_nothing(num_splits):
    """seq_len 0 (a CUDA graph's padding row, whose splits are all empty): output 0, never NaN,
    and the real rows as without it."""
    batch = make_paged_batch([1] * 3, [40, 0, 17], 4, 2, 32, 16, torch.float32, CPU)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, batch.scale)
    expected = paged_decode_attention(*args, num_splits=num_splits)
    batch.seq_lens[1] = 0
    out = paged_decode_attention(*args, num_splits=num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[[0, 2]], expected[[0, 2]])


@interpreter
def test_a_mixed_step_sends_its_leading_decodes_to_the_decode_kernel(monkeypatch):
    """Decodes first, then prompt chunks (one of them a single token): the decode kernel takes
    exactly the leading decodes, the prefill kernel the rest, and together they equal the
    reference, as with every sequence through the prefill kernel (num_decodes 0)."""
    from phase7_optim import kernels
    from phase7_optim.attention import ForwardBatch
    from phase7_optim.attention_backend import TritonAttention
    from phase7_optim.config import KernelConfig

    q_lens, contexts = [1, 1, 1, 7, 1, 12], [40, 0, 17, 20, 9, 0]
    b = make_paged_batch(q_lens, contexts, 4, 2, 32, 16, torch.float32, CPU)
    args = (b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables)
    expected = varlen_paged_attention_ref(*args, b.scale)
    decoded, decode = [], kernels.paged_decode_attention

    def spy(q, *args, **kwargs):
        decoded.append(q.shape[0])
        return decode(q, *args, **kwargs)

    monkeypatch.setattr(kernels, "paged_decode_attention", spy)
    for num_decodes in (3, 0):
        batch = ForwardBatch(
            b.query_start_loc, b.seq_lens, torch.zeros(0), b.block_tables,
            b.query_start_loc[1:] - 1, b.max_query_len, max(b.seq_lens.tolist()), 16,
            num_decodes=num_decodes,
        )  # fmt: skip
        out = TritonAttention().attend(b.q, b.k_cache, b.v_cache, batch, KernelConfig())
        assert_allclose(out, expected)
    assert decoded == [3]  # the first pass only, with its three decodes


@interpreter
def test_tuned_decode_attention_starts_the_longest_contexts_first(monkeypatch):
    """Tuned, TritonAttention hands the decode kernel the batch's decode_order, and the kernel's
    (split, head, rank) grid still gives every sequence its own output (the reference's);
    untuned, batch order."""
    from phase7_optim import kernels
    from phase7_optim.attention import ForwardBatch
    from phase7_optim.attention_backend import TritonAttention
    from phase7_optim.config import KernelConfig

    contexts = [40, 3, 17, 0, 29]
    b = make_paged_batch([1] * 5, contexts, 4, 2, 32, 16, torch.float32, CPU)
    args = (b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables)
    expected = varlen_paged_attention_ref(*args, b.scale)
    order = torch.argsort(b.seq_lens, descending=True).int()
    assert order.tolist() != list(range(5))  # the order differs from the batch's
    orders, decode = [], kernels.paged_decode_attention

    def spy(*args, **kwargs):
        orders.append(kwargs["order"])
        return decode(*args, **kwargs)

    monkeypatch.setattr(kernels, "paged_decode_attention", spy)
    for tuned in (True, False):
        batch = ForwardBatch(
            b.query_start_loc, b.seq_lens, torch.zeros(0), b.block_tables,
            b.query_start_loc[1:] - 1, 1, max(b.seq_lens.tolist()), 16,
            num_decodes=5, decode_order=order,
        )  # fmt: skip
        kernel_config = KernelConfig(tune_decode_attention=tuned)
        out = TritonAttention().attend(b.q, b.k_cache, b.v_cache, batch, kernel_config)
        assert_allclose(out, expected)
    assert orders[0] is order and orders[1] is None


def test_choose_num_splits_fills_the_gpu_without_tiny_splits():
    assert choose_num_splits(256, 8, 2048, num_sms=132) == 1  # the batch alone fills the SMs
    assert choose_num_splits(8, 8, 8192, num_sms=132) == 9  # a few long sequences: split
    assert choose_num_splits(1, 8, 300, num_sms=132) == 2  # … but never below 256 tokens a split
    assert choose_num_splits(1, 8, 32768, num_sms=132) == MAX_SPLITS


# ---- GPU: the H200 -----------------------------------------------------------------------------

GPU_DTYPES = [torch.bfloat16, torch.float16]
GPU_SHAPES = [(h_kv * g, h_kv, d) for d in (64, 128) for g, h_kv in ((1, 4), (2, 4), (8, 2))]
GPU_SHAPES.append((8, 2, 256))  # Qwen3.5's gated attention: 8 query heads, 2 KV heads of 256


@pytest.mark.gpu
def test_gpu_store_kvcache():
    k_cache = torch.randn(40, 16, 8, 128, device=CUDA, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    slot_mapping = torch.randperm(40 * 16, device=CUDA)[:300]
    slot_mapping[::7] = PAD_SLOT_ID
    k = torch.randn(300, 8, 128, device=CUDA, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    store_kvcache_ref(k, v, k_ref, v_ref, slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", GPU_SHAPES)
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_flash_prefill(dtype, num_heads, num_kv_heads, head_dim, block_size):
    q_lens, context_lens = [1, 100, 333, 700, 1030], [0, 517, 0, 1200, 17]
    batch = make_paged_batch(
        q_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, CUDA
    )
    check_prefill(batch)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_flash_prefill_long_context(block_size):
    """A 512-token chunk at the end of a 32k context, beside a whole 8k prompt."""
    q_lens, context_lens = [512, 8192, 3], [32768 - 512, 0, 20000]
    batch = make_paged_batch(q_lens, context_lens, 16, 8, 128, block_size, torch.bfloat16, CUDA)
    check_prefill(batch)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", GPU_SHAPES)
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_paged_decode(dtype, num_heads, num_kv_heads, head_dim, block_size, num_splits):
    context_lens = [0, 15, 16, 255, 1000, 2047, 4999]
    batch = make_paged_batch(
        [1] * 7, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, CUDA
    )
    check_decode(batch, num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 64])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("q_scale", [1.0, 8.0])  # 8: peaky scores, a few keys dominate
def test_gpu_paged_decode_32k(block_size, num_splits, q_scale):
    context_lens = [32767, 20000, 0, 512]
    batch = make_paged_batch([1] * 4, context_lens, 16, 8, 128, block_size, torch.bfloat16, CUDA)
    batch.q *= q_scale
    check_decode(batch, num_splits)


@pytest.mark.gpu
def test_gpu_paged_decode_padded_rows_read_nothing():
    """seq_len 0 (a CUDA graph's padding): output 0, the real rows unchanged."""
    batch = make_paged_batch([1] * 3, [700, 0, 31], 16, 8, 128, 16, torch.bfloat16, CUDA)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, batch.scale)
    expected = paged_decode_attention(*args)
    batch.seq_lens[1] = 0
    out = paged_decode_attention(*args)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[[0, 2]], expected[[0, 2]])


def compiled_for_hopper(code: str):
    """What `code` prints last (JSON), run in a fresh interpreter without TRITON_INTERPRET
    (which here makes every kernel an interpreted one), so Triton compiles for sm_90 with its own
    ptxas: no GPU needed."""
    import json
    import subprocess
    import sys

    from benchmarks import phase7_kernel_sass

    if not (phase7_kernel_sass.NVDISASM.exists() and phase7_kernel_sass.CUOBJDUMP.exists()):
        pytest.skip("this Triton has no NVIDIA backend tools")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
        cwd=phase7_kernel_sass.__file__.rsplit("/benchmarks/", 1)[0],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_whole_decode_tiles_compile_to_fewer_instructions():
    """`whole_tiles` is a speed lever, and no CPU test times anything; what it does can still be
    checked: compiled for the H200, the decode kernel's unmasked loop must cost well under the
    masked loop's instructions a tile (310 against 464 with Triton 3.6)."""
    counts = dict(compiled_for_hopper(
        "import json; from benchmarks.phase7_kernel_sass import decode_rows; print(json.dumps("
        "[[r['whole_tiles'], min(x['instructions'] for x in r['loops'])] for r in "
        "decode_rows(('bf16',))]))"
    ))  # fmt: skip
    assert counts[True] <= 0.75 * counts[False], counts  # masked loads back in: 0.80


def test_early_decode_loads_read_the_first_key_tile_before_the_wait():
    """`early_loads` is a speed lever too: compiled for the H200 with programmatic dependent
    launch, the decode kernel must issue its first key tile's loads (K and V, 16 KB each for a
    64-key tile of 128-wide bf16 heads over 128 threads: 8 vector loads a thread apiece) before
    `griddepcontrol.wait`, and without the lever no load at all (26 against 0, Triton 3.9).
    That the newest key is read only after the wait, the interpreter cannot show (it has no
    kernel before this one); the split tests show it is read at all."""
    counts = compiled_for_hopper(
        "import json; from benchmarks.phase7_kernel_sass import decode_loads_before_wait; "
        "print(json.dumps(decode_loads_before_wait()))"
    )
    assert counts["early_loads=False"]["loads_before_wait"] == 0, counts
    assert counts["early_loads=True"]["loads_before_wait"] >= 16, counts
    assert counts["early_loads=True"]["spill_instructions"] == 0, counts  # Qwen3's 128-wide heads


def test_rope_store_reads_its_token_position_before_the_wait():
    """q/k norm + RoPE + KV store (kernels/fused.py) loads its token's position, then that
    position's cos and sin, and its slot, before `griddepcontrol.wait`: they are the step's inputs
    and a fixed table, and the two dependent loads then overlap the QKV projection (8 loads
    with Triton 3.9; none if the wait comes first)."""
    counts = compiled_for_hopper(
        "import json; from benchmarks.phase7_kernel_sass import rope_store_loads_before_wait; "
        "print(json.dumps(rope_store_loads_before_wait()))"
    )
    assert counts["loads_before_wait"] >= 4, counts  # position, cos, sin, slot
