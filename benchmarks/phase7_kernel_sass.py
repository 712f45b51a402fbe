"""What the attention kernels' key loops compile to on a Hopper GPU, counted without one.

A decode step at large batch is bound by memory only while each key tile costs the SMs less time
than its bytes take to arrive; an fp8 cache halves the bytes and leaves the work, so whether a
lever that removes instructions pays shows in the machine code before any timing. Triton's
pip wheel carries the CUDA assembler (ptxas) and disassembler (nvdisasm), so a CPU machine can
compile a kernel for sm_90 and count the instructions of its loops: this script does that for
the paged decode kernel (bf16 and fp8 caches, each tile masked or the whole tiles without
masks) and the prefill kernel, at workload W's shapes (Qwen3-0.6B: 16 query heads on 8 KV
heads of 128, block size 16, the tuned tiles).

Per kernel it reports each loop (a backward branch over more than 50 instructions: the key
loops) with its instruction count per thread and per 64 keys for the whole block of threads,
and the count of each opcode. Counts are static (one pass through the loop body), not timings.
For decode attention (with and without `early_loads`, 128- and 256-wide heads) and q/k norm +
RoPE + store it also reports the global loads issued before the PDL wait, the spilled-register
instructions and the registers a thread holds (how many programs fit an SM); for the sampling
race, its instructions and Philox's multiplies.

Run (any machine with Triton): python -m benchmarks.phase7_kernel_sass [--out DIR]
Writes phase7_kernel_sass.json. The counts depend on the Triton version (the JSON names it).
"""

import collections
import re
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.harness import benchmark_parser, parse_args, write_result
from phase7_optim.kernels import flash_prefill, fused, paged_decode, sampling

TARGET = GPUTarget("cuda", 90, 32)  # Hopper (H100, H200)
GROUP, BLOCK_SIZE, HEAD_DIM = 2, 16, 128  # Qwen3-0.6B's GQA group, W's block size
LOOP_MIN_INSTRUCTIONS = 50
LOCAL = {"LDL", "STL"}  # local-memory loads and stores: what spilled registers cost
NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
CUOBJDUMP = NVDISASM.with_name("cuobjdump")
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_]+)")
LABEL = re.compile(r"^(\.L_x_\d+):$")
BACK_BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")


def signature(kernel, types: dict[str, str], constexprs: dict) -> ASTSource:
    """The kernel specialized as a launch from the engine would be: every pointer and every
    integer not in `types` 16-divisible (Triton's specialization of aligned arguments)."""
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        sig[name] = types.get(name, "i32")
        if sig[name].startswith("*") or name not in types:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)


def cubin_tool(tool: Path, args: list[str], cubin: bytes) -> str:
    """What one of the wheel's CUDA tools prints about a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run(
            [str(tool), *args, f.name], capture_output=True, text=True, check=True
        ).stdout


def loops(cubin: bytes) -> list[dict]:
    """The loops of a compiled kernel: instructions per thread in one pass, and per opcode."""
    sass = cubin_tool(NVDISASM, ["-c"], cubin).splitlines()
    labels = {m.group(1): i for i, line in enumerate(sass) if (m := LABEL.match(line.strip()))}
    found = []
    for end, line in enumerate(sass):
        m = BACK_BRANCH.search(line)
        start = labels.get(m.group(1)) if m else None
        if start is None or start >= end:
            continue
        ops = collections.Counter(
            m.group(1) for text in sass[start : end + 1] if (m := INSTRUCTION.match(text))
        )
        if sum(ops.values()) > LOOP_MIN_INSTRUCTIONS:
            found.append({"instructions": sum(ops.values()), "opcodes": dict(ops.most_common())})
    return found


def compile_loops(source: ASTSource, num_warps: int, num_stages: int, keys: int) -> dict:
    compiled = triton.compile(
        source, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages}
    )
    found = loops(compiled.asm["cubin"])
    for loop in found:  # the whole block's work, normalized to 64 keys
        loop["warp_instructions_per_64_keys"] = loop["instructions"] * num_warps * 64 // keys
    return {"shared_memory_bytes": compiled.metadata.shared, "loops": found}


def decode_source(
    config: paged_decode.DecodeConfig, cache: str, head_dim: int = HEAD_DIM
) -> ASTSource:
    """The decode split kernel as the engine launches it for one sequence's splits."""
    types = {"q_ptr": "*bf16", "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}",
             "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32", "order_ptr": "*i32",
             "part_out_ptr": "*bf16", "part_lse_ptr": "*fp32", "qk_scale": "fp32",
             "stride_pop": "i32", "stride_lses": "i32", "stride_lseh": "i32"}  # fmt: skip
    constexprs = dict(
        QUERY_GROUP_SIZE=GROUP, BLOCK_H=paged_decode.MIN_BLOCK_H, BLOCK_SIZE=BLOCK_SIZE,
        HEAD_DIM=head_dim, BLOCK_N=config.block_n, DIRECT=True, ORDERED=True,
        WHOLE_TILES=config.whole_tiles, EARLY=config.early_loads, PDL=True,
    )  # fmt: skip
    return signature(paged_decode._paged_decode_split_kernel, types, constexprs)


def decode_rows(caches: tuple[str, ...] = ("bf16", "fp8e4nv")) -> list[dict]:
    tuned = paged_decode.TUNED_DECODE_CONFIG
    rows = []
    for cache in caches:
        for config in (tuned, replace(tuned, whole_tiles=False)):
            source = decode_source(config, cache)
            result = compile_loops(source, config.num_warps, config.num_stages, config.block_n)
            rows.append({"kernel": "paged decode", "cache": cache,
                         "whole_tiles": config.whole_tiles, **result})  # fmt: skip
    return rows


def decode_loads_before_wait(cache: str = "bf16", head_dim: int = HEAD_DIM) -> dict[str, dict]:
    """With `early_loads` and without: how many global loads (PTX `ld.global`) the decode
    kernel issues before it waits for the kernel before it (`griddepcontrol.wait`), and how many
    local-memory loads and stores (registers spilled) its machine code holds."""
    counts = {}
    for early in (True, False):
        config = replace(paged_decode.TUNED_DECODE_CONFIG, early_loads=early)
        source = decode_source(config, cache, head_dim)
        counts[f"early_loads={early}"] = before_wait(source, config.num_warps, config.num_stages)
    return counts


def rope_store_loads_before_wait() -> dict:
    """The same for q/k norm + RoPE + KV store (kernels/fused.py) at Qwen3-0.6B's shapes, which
    reads its token's position, cos, sin and slot before the wait."""
    types = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "q_w_ptr", "k_w_ptr",
                                        "q_out_ptr", "k_cache_ptr", "v_cache_ptr")}  # fmt: skip
    types.update(cos_ptr="*fp32", sin_ptr="*fp32", positions_ptr="*i32",
                 slot_mapping_ptr="*i32", eps="fp32")  # fmt: skip
    constexprs = dict(
        BLOCK_H=16, BLOCK_KV=8, BLOCK_SIZE=BLOCK_SIZE, HEAD_DIM=HEAD_DIM, HALF=HEAD_DIM // 2,
        TAIL=0, NORM=True, OFFSET=False, PAD_SLOT=fused.PAD_SLOT_ID, PDL=True,
    )  # fmt: skip
    source = signature(fused._qk_norm_rope_store_kernel, types, constexprs)
    return before_wait(source, num_warps=4, num_stages=1)


def before_wait(source: ASTSource, num_warps: int, num_stages: int) -> dict:
    """A kernel compiled for sm_90: its PTX global loads before `griddepcontrol.wait` (what it
    reads while the kernel before it still runs) and its local-memory instructions."""
    compiled = triton.compile(
        source, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages}
    )
    ptx = compiled.asm["ptx"].partition("griddepcontrol.wait")[0]
    return {
        "loads_before_wait": len(re.findall(r"\bld\.global", ptx)),
        "spill_instructions": spills(compiled.asm["cubin"]),
        "registers_per_thread": registers(compiled.asm["cubin"]),
    }


def registers(cubin: bytes) -> int:
    """Registers a thread of the kernel holds (cuobjdump's resource usage): with the threads of a
    program, how many programs fit an SM's 65,536 beside each other."""
    usage = cubin_tool(CUOBJDUMP, ["--dump-resource-usage"], cubin)
    return int(re.search(r"REG:(\d+)", usage).group(1))


def spills(cubin: bytes) -> int:
    """Local-memory loads and stores (LDL, STL) in a compiled kernel: registers spilled."""
    sass = cubin_tool(NVDISASM, ["-c"], cubin).splitlines()
    return sum(1 for line in sass if (m := INSTRUCTION.match(line)) and m.group(1) in LOCAL)


def prefill_row() -> dict:
    config = flash_prefill.PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
    types = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
             "out_ptr": "*bf16", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
             "block_tables_ptr": "*i32", "qk_scale": "fp32", "first_seq": "i32"}  # fmt: skip
    constexprs = dict(
        QUERY_GROUP_SIZE=GROUP, BLOCK_SIZE=BLOCK_SIZE, HEAD_DIM=HEAD_DIM,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, LONGEST_FIRST=True,
    )  # fmt: skip
    source = signature(flash_prefill._flash_attn_varlen_paged_kernel, types, constexprs)
    result = compile_loops(source, config.num_warps, config.num_stages, config.block_n)
    return {"kernel": "prefill (the unmasked loop, then the diagonal band)", "cache": "bf16",
            "config": config.__dict__, **result}  # fmt: skip


def sampling_race() -> dict:
    """The exponential race (kernels/sampling.py) at Qwen3's vocabulary chunks, bf16 logits: its
    instructions, the high halves of Philox's products (IMAD.HI: two a round, ten rounds a call)
    and spills. The interpreter runs Triton's language with numpy's rules; only the compiler
    says whether the kernel is one a GPU can run."""
    types = {"logits_ptr": "*bf16", "keys_ptr": "*i64", "counters_ptr": "*i64",
             "inv_temperature_ptr": "*fp32", "greedy_ptr": "*i1", "best_ptr": "*fp32",
             "best_idx_ptr": "*i32"}  # fmt: skip
    source = signature(sampling._exponential_race_kernel, types, {"BLOCK": sampling.VOCAB_BLOCK})
    compiled = triton.compile(source, target=TARGET, options={"num_warps": 4, "num_stages": 2})
    sass = cubin_tool(NVDISASM, ["-c"], compiled.asm["cubin"]).splitlines()
    return {
        "instructions": sum(1 for line in sass if INSTRUCTION.match(line)),
        "multiply_high": sum(1 for line in sass if re.search(r"\bIMAD\.HI\b", line)),
        "spill_instructions": spills(compiled.asm["cubin"]),
    }


def build_parser():
    return benchmark_parser(__doc__, threads=False)  # compiles only: --quick changes nothing


def main():
    args = parse_args(build_parser())
    rows = [*decode_rows(), prefill_row()]
    for r in rows:
        counts = ", ".join(str(loop["instructions"]) for loop in r["loops"])
        flag = f" whole_tiles={r['whole_tiles']}" if "whole_tiles" in r else ""
        print(f"{r['kernel']} {r['cache']}{flag}: loops of {counts} instructions a thread")
    loads = {
        f"{cache}, head_dim {head_dim}": decode_loads_before_wait(cache, head_dim)
        for cache in ("bf16", "fp8e4nv")
        for head_dim in (HEAD_DIM, 256)
    }
    print(f"paged decode, global loads before the wait: {loads}")
    rope = rope_store_loads_before_wait()
    print(f"q/k norm + RoPE + store, global loads before the wait: {rope}")
    race = sampling_race()
    print(f"the exponential race: {race}")
    result = {"target": "sm_90", "triton": triton.__version__, "rows": rows,
              "decode_loads_before_wait": loads, "rope_store_loads_before_wait": rope,
              "sampling_race": race}  # fmt: skip
    print(f"wrote {write_result('phase7_kernel_sass', result, args.out)}")


if __name__ == "__main__":
    main()
