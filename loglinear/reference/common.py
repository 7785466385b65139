"""The two generic forms of the exact references.

Both forms take inputs already expanded to value heads and cast to the compute dtype:
q, k: [B, T, H, K]; v: [B, T, H, V]; gates: {name: [B, T, H] or per channel [B, T, H, K]};
level_scales: [B, T, H, L].
A variant (loglinear.variants) supplies only its transfer matrix (materialized) or its per-token transition
and deposited key (recurrent).
"""

from __future__ import annotations

import torch

from loglinear.fenwick import carry, level_matrix, levels_needed
from loglinear.variants import Variant


def level_mask(level_scales: torch.Tensor, start: int = 0) -> torch.Tensor:
    """M^H[b, h, t, s] = lambda_t[level(t, s)] for s <= t, else 0.  level_scales: [B, T, H, L] -> [B, H, T, T]."""
    B, T, H, L = level_scales.shape
    lev = level_matrix(T, start=start, device=level_scales.device)  # [T, T]
    lam = level_scales.permute(0, 2, 1, 3)  # [B, H, T, L]
    idx = lev[None, None].expand(B, H, T, T)
    mask = torch.gather(lam, 3, idx)
    return torch.tril(mask)


def materialized(
    transfer: torch.Tensor, v: torch.Tensor, level_scales: torch.Tensor, scale: float
) -> torch.Tensor:
    """O = scale * (transfer * M^H) V.   transfer: [B, H, T, T] (beta_s q_t^T P_{t,s} k_s) -> o: [B, T, H, V]."""
    weights = transfer * level_mask(level_scales)
    return scale * torch.einsum("bhts,bshv->bthv", weights, v)


def recurrent(
    variant: Variant, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: dict[str, torch.Tensor],
    level_scales: torch.Tensor, scale: float, levels: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-level recurrent cascade of spec section 4, one token at a time.

    levels: [B, Ls, H, K, V] incoming level states (None: empty); positions: [B] tokens already consumed.
    Per token at absolute position p: (1) carry: levels 0..ctz(p) merge into ctz(p)+1 (p > 0);
    (2) the token's transition A_t on every level; (3) level 0 += k~ v^T (k~ = variant.deposit_key);
    (4) o = scale * sum_l lambda[l] S[l]^T q.
    Returns o: [B, T, H, V], the final levels [B, Lf, H, K, V] and positions [B].
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if positions is None:
        positions = torch.zeros(B, dtype=torch.int64)
    n_levels = levels_needed(int(positions.max()) + T)
    if levels is not None:
        n_levels = max(n_levels, levels.shape[1])
    if level_scales.shape[-1] < n_levels:
        raise ValueError(f"level_scales has {level_scales.shape[-1]} levels, {n_levels} are needed")
    S = q.new_zeros(B, n_levels, H, K, V)
    if levels is not None:
        S = S + torch.nn.functional.pad(levels.to(q.dtype), (0, 0, 0, 0, 0, 0, 0, n_levels - levels.shape[1]))
    level0 = (torch.arange(n_levels, device=q.device) == 0).to(q.dtype).view(1, n_levels, 1, 1, 1)
    outs = []
    # the tokens as views with one autograd node per tensor (x[:, t] in the loop: a whole-size gradient per token)
    qs, ks, vs, lams = q.unbind(1), k.unbind(1), v.unbind(1), level_scales[..., :n_levels].unbind(1)
    gate_steps = {name: x.unbind(1) for name, x in gates.items()}
    for t in range(T):
        S = carry(S, positions + t)
        gates_t = {name: xs[t] for name, xs in gate_steps.items()}
        S = variant.transition(S, ks[t], gates_t)
        deposit = torch.einsum("bhk,bhv->bhkv", variant.deposit_key(ks[t], gates_t), vs[t])
        S = S + level0 * deposit[:, None]
        outs.append(scale * torch.einsum("blhkv,bhk,bhl->bhv", S, qs[t], lams[t]))  # lams[t]: [B, H, L]
    return torch.stack(outs, dim=1), S, positions + T
