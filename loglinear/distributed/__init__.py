"""Context parallelism for log-linear attention: one sequence sharded over the ranks of a process group.

The state entering every shard is computed exactly by a prefix scan of affine boundary maps across
ranks (ceil(log2 P) rounds, O(log T) level states per message), then each rank runs the public op from
it. See docs/context-parallel.md.
"""

from loglinear.distributed.ops import context_parallel_log_linear_gated_deltanet, context_parallel_log_linear_mamba2

__all__ = ["context_parallel_log_linear_mamba2", "context_parallel_log_linear_gated_deltanet"]
