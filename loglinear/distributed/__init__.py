"""Context parallelism for log-linear attention: one sequence sharded over the ranks of a process group.

The state entering every shard is computed exactly by a prefix scan of affine boundary maps across
ranks (ceil(log2 P) rounds, O(log T) level states per message), then each rank runs the public op from
it. See docs/context-parallel.md.

    context_parallel_attention                             the op of any variant on this rank's shard
    context_parallel_log_linear_mamba2 / _gated_deltanet   the named ops
    apply_context_parallel(model, group)                   every mixer of a loglinear model, in place
    previous_tokens                                        the halo of token-local look-back operators
    shard_bounds, shard_sequence, context_parallel_mesh    sharding a batch; the 2-D (dp, cp) mesh
"""

from loglinear.distributed.halo import previous_tokens
from loglinear.distributed.mesh import context_parallel_mesh, shard_bounds, shard_sequence
from loglinear.distributed.model import apply_context_parallel
from loglinear.distributed.ops import (
    context_parallel_attention,
    context_parallel_log_linear_gated_deltanet,
    context_parallel_log_linear_mamba2,
)

__all__ = [
    "context_parallel_attention",
    "context_parallel_log_linear_mamba2",
    "context_parallel_log_linear_gated_deltanet",
    "apply_context_parallel",
    "previous_tokens",
    "shard_bounds",
    "shard_sequence",
    "context_parallel_mesh",
]
