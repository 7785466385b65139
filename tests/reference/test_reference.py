"""The two exact forms agree, and with lambda = 1 they are plain Mamba-2 / Gated DeltaNet."""

import pytest
import torch

from helpers import assert_close, make_inputs, mamba2_args
from loglinear import reference as R


@pytest.mark.parametrize("B,T,G,H", [(1, 1, 1, 1), (2, 2, 1, 2), (2, 37, 2, 4), (1, 70, 1, 3)])
def test_materialized_equals_recurrent(B, T, G, H):
    x = make_inputs(B, T, G, H)
    o_mat = R.log_linear_mamba2_materialized(**mamba2_args(x))
    o_rec, _ = R.log_linear_mamba2_recurrent(**mamba2_args(x))
    assert_close(o_rec, o_mat, 1e-12, "mamba2")
    o_mat = R.log_linear_gated_deltanet_materialized(**x, use_qk_l2norm=True)
    o_rec, _ = R.log_linear_gated_deltanet_recurrent(**x, use_qk_l2norm=True)
    assert_close(o_rec, o_mat, 1e-12, "gated deltanet")


def plain_mamba2(q, k, v, g, scale):
    """S_t = exp(g_t) S_{t-1} + k_t v_t^T;  o_t = scale S_t^T q_t.   q, k: [B, T, H, K]."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for t in range(T):
        S = torch.exp(g[:, t])[..., None, None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, 1)


def plain_gated_deltanet(q, k, v, g, beta, scale):
    """S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, written with an explicit K x K matrix."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    eye = torch.eye(K, dtype=q.dtype)
    outs = []
    for t in range(T):
        kt, bt = k[:, t], beta[:, t][..., None, None]
        A = torch.exp(g[:, t])[..., None, None] * (eye - bt * kt[..., :, None] * kt[..., None, :])
        S = A @ S + bt * kt[..., :, None] * v[:, t, :, None, :]
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, 1)


@pytest.mark.parametrize("T", [1, 5, 33])
def test_unit_lambda_is_the_plain_model(T):
    x = make_inputs(2, T, 2, 2)
    x["level_scales"] = torch.ones_like(x["level_scales"])
    scale = 0.7
    o, _ = R.log_linear_mamba2_recurrent(**mamba2_args(x), scale=scale)
    assert_close(o, plain_mamba2(x["q"], x["k"], x["v"], x["g"], scale), 1e-12, "mamba2")
    o = R.log_linear_gated_deltanet_materialized(**x, scale=scale)
    expected = plain_gated_deltanet(x["q"], x["k"], x["v"], x["g"], x["beta"], scale)
    assert_close(o, expected, 1e-12, "gated deltanet")


def test_level_buckets_weight_the_right_keys():
    """One key per position with lambda one-hot on a level: the output sees exactly that bucket."""
    T, K = 13, 13
    eye = torch.eye(T, K, dtype=torch.float64)
    q = torch.ones(1, T, 1, K, dtype=torch.float64)
    k = eye[None, :, None, :]
    v = torch.arange(1.0, T + 1, dtype=torch.float64).view(1, T, 1, 1)
    g = torch.zeros(1, T, 1, dtype=torch.float64)
    for lvl in range(5):
        lam = torch.zeros(1, T, 1, 5, dtype=torch.float64)
        lam[..., lvl] = 1
        o, _ = R.log_linear_mamba2_recurrent(q, k, v, g, lam, scale=1.0)
        for t in range(T):
            bucket = [s for s in range(t + 1) if (t ^ s).bit_length() == lvl]
            assert o[0, t, 0, 0].item() == pytest.approx(sum(s + 1 for s in bucket))


@pytest.mark.parametrize("T, cut", [(1, 0), (33, 13)])
def test_plain_call_is_the_plain_model_with_a_one_level_state(T, cut):
    """level_scales=None: the plain recurrence, its state S_T as one level, continued from any position."""
    x = mamba2_args(make_inputs(2, T, 2, 2))
    del x["level_scales"]
    scale = 0.7
    expected = plain_mamba2(x["q"], x["k"], x["v"], x["g"], scale)
    o, state = R.log_linear_mamba2_recurrent(**x, level_scales=None, scale=scale, output_final_state=True)
    assert_close(o, expected, 1e-12, "o")
    assert state.levels.shape[1] == 1 and state.positions.tolist() == [T, T]
    first = {n: t[:, :cut] for n, t in x.items()}
    rest = {n: t[:, cut:] for n, t in x.items()}
    outs = []
    if cut:
        o1, mid = R.log_linear_mamba2_recurrent(**first, level_scales=None, scale=scale, output_final_state=True)
        outs.append(o1)
    else:
        mid = None
    o2, end = R.log_linear_mamba2_recurrent(**rest, level_scales=None, scale=scale, initial_state=mid,
                                            output_final_state=True)
    assert_close(torch.cat(outs + [o2], 1), expected, 1e-12, "continued o")
    assert_close(end.levels, state.levels, 1e-12, "continued state")
