"""phase7_optim: attention is bandwidth-bound, the CPU launches too slowly, one GPU is not enough.

This phase replaces the pure-torch attention of the earlier phases with Triton kernels
(`kernels/`: varlen FlashAttention prefill over the paged cache, paged decode attention, the KV
store) and adds CUDA graphs and tensor parallelism. Importing this package only defines things.
"""
