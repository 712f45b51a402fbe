"""Programmatic dependent launch (PDL, Hopper on): the next kernel starts before this one ends.

Problem: in a CUDA graph of a small model's decode step, kernels run back to back but each one
still starts cold: its programs are scheduled only when the previous kernel has finished, and its
first loads then wait a full memory latency. A GEMV on a few MB of weight spends more time so
than reading them (benchmarks/phase7_gemv.py).
Idea (CUDA's programmatic dependent launch, `griddepcontrol` in PTX): a kernel launched with
`launch_pdl=True` may start as soon as every program of the kernel before it has called
`gdc_launch_dependents` (or ended). It does what depends on nobody first (loads its weights),
then `gdc_wait`s: that returns once the previous kernel has completed and its writes are
visible. Every Triton kernel of a decode step (the norms, q/k norm + RoPE + store, SiLU-and-mul,
decode attention and its merge, the GEMV) is launched so and triggers at its start
(`launch_dependents`): where two of them follow each other, the second is already scheduled and
waiting when the first ends, and the gap between them (~1 µs each, some 170 a step) closes. A
kernel with nothing of its own to do before the wait waits first; the GEMV loads its weights,
decode attention its first keys, q/k norm + RoPE + store its tokens' positions and their cos and
sin. cuBLAS's kernels never trigger: what follows one starts when it ends, as without PDL.

Invariants:
- a kernel launched with PDL reads nothing an earlier kernel wrote, and writes nothing, before its
  `gdc_wait`: only what no kernel of the step writes is loaded before it (weights and tables,
  the step's inputs, copied in before its first kernel, and KV entries of earlier steps); every
  program of it reaches the wait (a kernel that could end before its predecessor would let its
  own successor overtake both);
- a kernel launched without PDL waits for the previous one as always, so triggering early is a
  hint with no effect on it; both calls are no-ops without PDL;
- `PDL=False` (CPU, the interpreter, Triton < 3.3, GPUs before Hopper) compiles neither call.
"""

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_PDL = True
except ImportError:
    gdc_launch_dependents = gdc_wait = None
    HAS_PDL = False


def supports_pdl(device: torch.device) -> bool:
    return HAS_PDL and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(enabled: bool) -> dict:
    """A kernel launch's extra options: launched with PDL, or as always (older Tritons know no
    `launch_pdl` option at all)."""
    return {"launch_pdl": True} if enabled else {}


@triton.jit
def launch_dependents(ENABLED: tl.constexpr):
    """Lets a PDL kernel queued after this one start now (it waits for this one's results)."""
    if ENABLED:
        gdc_launch_dependents()


@triton.jit
def wait_for_previous(ENABLED: tl.constexpr):
    """Waits until the kernel before this one has completed and its writes are visible."""
    if ENABLED:
        gdc_wait()
