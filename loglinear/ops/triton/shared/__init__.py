"""Pieces shared by the fused Triton kernels of every variant.

How a variant plugs in (mamba2/ is the worked example: fwd.py, chunk.py, bwd.py composed in backend.py):

  * Sequences are ranges ``[bos[n], eos[n])`` of one flat token axis (a dense batch is flattened, varlen
    is already flat); range n starts at the absolute, chunk-aligned chunk index ``chunk0[n]``. One program
    handles one (sequence, value head) and walks its chunks; q/k are read from group ``h // (H // G)``
    (no expanded copies).
  * tiles.py: ``load_tile`` / ``store_tile`` move a chunk of C rows of a [rows, HEADS, D] tensor (rows past
    ``eos`` read as 0, so padding tokens have g = 0: identity transitions); ``load_column`` reads one
    level of lambda for the chunk.
  * levels.py: the chunk-level Fenwick states of all levels live in one fp32 buffer [N, J, H, K, V]: the
    forward cascade (read every live level, decay lazily, merge at ctz(chunk + 1)) and its transpose
    (split, decay, accumulate reads) are jit helpers; a variant supplies only what a chunk reads from a
    level (its readout GEMM), what it deposits, and its transition (a scalar decay for Mamba-2, folded
    into the lazy per-level log-decays).
  * intra.py: ``intra_levels`` / ``level_weights`` build the in-chunk level weights Lambda[t, s] (one gather),
    ``store_level_sums`` their gradient's per-level row sums, and the Mamba-2 in-chunk block and its
    gradients; intra_channel.py the in-chunk scores and products with a per-channel decay (GLA), in stable
    sub-chunks.
  * launch.py: ``launch(kernel, grid, *args, **launch_options(kernel))``, every kernel launch: num_warps /
    num_stages from one per-kernel table (one fixed config under TRITON_INTERPRET=1), a build over an SM's shared
    memory launched at fewer stages.
  * rules.py: the per-variant numeric rules: ``dot_precision`` (tl.dot input_precision), ``dot_dtype``,
    ``kernel_chunk_size``.
  * heads.py: ``run_padded`` runs a backend's kernels on heads zero-padded to ``min_head_dim`` (bf16/fp16
    on CUDA: 64).
  * streams.py: ``ChainStreams``, a sequential chain kernel's segments on a side stream and the chunk-parallel
    kernels that read each finished segment beside it, on the current stream (the Gated DeltaNet scans; the
    decode step's passes over disjoint levels, on two side streams).
  * placement.py: ``placement`` / ``place`` / ``take``, packed sequences laid out as rows with zero tokens behind
    (Gated DeltaNet's padded rows), one scatter each way.
  * common.py: the interpreter switch, kernel-output allocation (``alloc``, NaN-poisoned by ``set_poison``
    in tests), ``next_pow2``, ``group_sum``.

A variant's backend.py exposes ``supports(inp)`` (the inputs its kernels take) and ``backend(inp,
output_final_state, chunk_size, use_qk_l2norm)``; the package __init__ registers them.
"""
