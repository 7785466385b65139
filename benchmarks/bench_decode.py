"""Decoding cost vs context length: per-token latency and cache memory.

Models (2 layers at the paper's width, bf16 weights, vocab 4096 so the LM head does not hide the mixers):
    ll_mamba2 / mamba2          log-linear / plain Mamba-2   (hidden 1536, 48 heads x 64, state 128)
    ll_gdn / gdn                log-linear / plain GDN       (hidden 1536, 6 heads, key 192, value 384)
    llama_sdpa                  transformers Llama, SDPA, DynamicCache (hidden 1536, 12 heads x 128)
all with a SwiGLU MLP of 4096. <model>_graph: the same model decoding through FenwickCache(cuda_graph=True), each
step one CUDA graph replay, its states in static buffers of max_levels levels. For a context T the cache is built
directly at position T with random contents (a step's cost depends on the state's size, not its values):
L = ceil(log2 T) + 1 level states (log-linear), 1 state (plain), T keys/values (Llama). Then `--steps` greedy
steps of one token through the HF model are timed end to end (Python included), after warm-up. Llama's
DynamicCache appends by concatenation (a copy of the cache per step); it is cropped back to T after each step.

Also timed: the fused decode kernel alone (one layer's step in place, the GPU time of its CUDA-graph replay;
log-linear at positions drawn from [T/2, T) and at p = T, where every level is held) vs plain, for Mamba-2, GLA
(Mamba-2's shape with a decay per key channel) and GDN, and a correctness check of the kernel against the PyTorch
step on the device (all three), the ms per token through model.generate() (eager and graphed; without a stop token,
and with the eos token and min_new_tokens), and a check of graphed decoding against the ordinary cached steps.

    python benchmarks/bench_decode.py --out benchmarks/results            # device
    python benchmarks/bench_decode.py --tiny --out /tmp/bench             # CPU smoke run
    python benchmarks/bench_decode.py --kernel-only --contexts 65536 --kernel-variants gdn --out /tmp/k   # the step

--kernel-only times the fused step alone (no models, generate() or device checks; no plot): what
benchmarks/profiling/ab_trees.py --bench decode runs in each tree.

Writes decode-<gpu>.{json,md,png} (e.g. decode-H200; decode-cpu on the CPU) with the command, versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import statistics
import sys
import time

import torch

from loglinear.cli import check_script_options, refuse
from loglinear.fenwick import held_levels, levels_needed
from loglinear.layers.mixer import MixerState
from loglinear.models import (
    FenwickCache,
    LogLinearGatedDeltaNetConfig,
    LogLinearGatedDeltaNetForCausalLM,
    LogLinearMamba2Config,
    LogLinearMamba2ForCausalLM,
)
from loglinear.models.modeling import CACHE_KEY
from loglinear.ops.decode import KEY_WINDOW, MAX_KEY_WINDOW
from loglinear.report import machine_name, pyplot

MODELS = ("ll_mamba2", "mamba2", "ll_gdn", "gdn", "llama_sdpa",
          "ll_mamba2_graph", "mamba2_graph", "ll_gdn_graph", "gdn_graph")
GRAPH = "_graph"  # the same model decoding through FenwickCache(cuda_graph=True): each step one CUDA graph replay
KERNEL_VARIANTS = ("mamba2", "gla", "gdn")  # the fused step's rows: Mamba-2, GLA (its shape, a decay per key channel)


def model_configs(tiny: bool) -> dict[str, dict]:
    if tiny:
        width = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, intermediate_size=64)
        return {
            "mamba2": dict(width, num_heads=4, head_dim=16, state_size=16),
            "gdn": dict(width, num_heads=2, head_dim=16, expand_v=2.0),
            "llama": dict(width, num_attention_heads=2, num_key_value_heads=2, head_dim=16),
        }
    width = dict(vocab_size=4096, hidden_size=1536, num_hidden_layers=2, intermediate_size=4096)
    levels = dict(max_levels=22)  # decoding past 2^20 tokens (the default 21 levels stop at exactly 2^20)
    return {
        "mamba2": dict(width, num_heads=48, head_dim=64, state_size=128, **levels),
        "gdn": dict(width, num_heads=6, head_dim=192, expand_v=2.0, **levels),
        "llama": dict(width, num_attention_heads=12, num_key_value_heads=12, head_dim=128),
    }


def build(name: str, configs: dict, device, dtype):
    if name == "llama_sdpa":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(**configs["llama"], max_position_embeddings=1 << 21, attn_implementation="sdpa")
        return LlamaForCausalLM(config).to(device, dtype).eval()
    ll = name.startswith("ll_")
    name = name.removesuffix(GRAPH)
    if "mamba2" in name:
        model = LogLinearMamba2ForCausalLM(LogLinearMamba2Config(**configs["mamba2"], use_log_linear=ll))
    else:
        model = LogLinearGatedDeltaNetForCausalLM(LogLinearGatedDeltaNetConfig(**configs["gdn"], use_log_linear=ll))
    return model.to(device, dtype).eval()


def fenwick_cache_at(model, batch: int, context: int, device, cuda_graph: bool = False,
                     key_window: int | None = None) -> FenwickCache:
    """A FenwickCache of ``batch`` sequences that have seen ``context`` tokens (random contents in the levels that
    position holds, zeros in the others, as in a real state); graphed with Gated DeltaNet's key_window."""
    cache = FenwickCache(len(model.model.layers), cuda_graph=cuda_graph, key_window=key_window if cuda_graph else None)
    for i, block in enumerate(model.model.layers):
        mixer = block.mixer
        H = mixer.num_heads
        K = mixer.state_size if hasattr(mixer, "state_size") else mixer.head_k_dim
        V = mixer.head_dim if hasattr(mixer, "state_size") else mixer.head_v_dim
        L = levels_needed(context) if mixer.use_log_linear else 1
        positions = torch.full((batch,), context, dtype=torch.int64)
        held = held_levels(positions, L).to(device) if mixer.use_log_linear else torch.ones(batch, 1, device=device)
        levels = 0.01 * torch.randn(batch, L, H, K, V, device=device) * held[:, :, None, None, None]
        conv = torch.randn(batch, mixer.conv.kernel_size[0] - 1, mixer.conv.in_channels, device=device,
                           dtype=mixer.conv.weight.dtype)
        cache.update_state(i, MixerState(levels, positions, conv))
    return cache


def kv_cache_at(model, batch: int, context: int, device, dtype):
    from transformers import DynamicCache

    config = model.config
    cache = DynamicCache(config=config)
    shape = (batch, config.num_key_value_heads, context, config.head_dim)
    for i in range(config.num_hidden_layers):
        cache.update(torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype), i)
    return cache


def cache_bytes(name: str, cache) -> int:
    if name == "llama_sdpa":
        return sum(x.numel() * x.element_size() for layer in cache.layers for x in (layer.keys, layer.values))
    return cache.nbytes()


def kv_bytes_analytic(configs: dict, batch: int, context: int, dtype) -> int:
    c = configs["llama"]
    return 2 * c["num_hidden_layers"] * batch * context * c["num_key_value_heads"] * c["head_dim"] * dtype.itemsize


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def time_steps(name: str, model, cache, batch: int, context: int, steps: int, warmup: int, device) -> float:
    """Median-free mean ms per greedy step over ``steps`` steps (after ``warmup``), Python included."""
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)

    def step(ids):
        kw = {"position_ids": torch.full((batch, 1), context, device=device)} if name == "llama_sdpa" else {}
        out = model(ids, use_cache=True, **{CACHE_KEY: cache}, **kw)
        if name == "llama_sdpa":
            cache.crop(-1)  # back to T tokens
        return out.logits[:, -1].argmax(-1, keepdim=True)

    for _ in range(warmup):
        ids = step(ids)
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        ids = step(ids)
    sync(device)
    return 1000 * (time.perf_counter() - start) / steps


def median_us(fn, device) -> float:
    """Median microseconds of fn(): triton's do_bench (CUDA events) on the GPU, a host clock otherwise."""
    if device.type == "cuda":
        import triton.testing

        return 1000 * triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - start))
    return sorted(times)[1]


def graph_us(fn, device, iters: int = 20) -> float:
    """GPU microseconds of one call of fn as graphed decoding runs it: fn captured once in a CUDA graph (after
    warm-up calls on a side stream, as loglinear.models.graphs does), each replay after a 256 MB write that evicts L2
    (the states come from HBM, as in a model whose other layers ran in between), timed by CUDA events around the
    replay: from its first kernel to its last, kernels on side streams included (the step's launches overlap
    there), no host time. The median over iters. On the CPU: median_us."""
    if device.type != "cuda":
        return median_us(fn, device)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
        with torch.cuda.graph(graph):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1000 * start.elapsed_time(end))
    return statistics.median(times)


def kernel_times(configs: dict, contexts: list[int], batches: list[int], device, key_window: int,
                 variants: tuple[str, ...] = KERNEL_VARIANTS, draws: int = 8) -> list[dict]:
    """The fused step of one layer alone (the GPU time of its graph replay, graph_us), in place as CUDA-graph
    decoding runs it: log-linear (a buffer of L = levels_needed(T + 1) lazy levels, their log-scales beside them,
    and for Gated DeltaNet a key window of ``key_window`` tokens) vs plain (one level). The log-linear step touches
    the levels its position holds, so it is timed at positions drawn uniformly from [T/2, T) for every sequence (the
    mean over ``draws`` draws: a context of about T) and at p = T (a power of two: every level is touched, and Gated
    DeltaNet's window turns, the worst case). Gated DeltaNet's window step also over ``key_window`` consecutive
    tokens from a turn (its mean: what a token costs, the rewrite at each turn shared out), and its step that
    rewrites every held level (no lazy levels) at the drawn positions. A row per (variant of ``variants``, batch,
    context)."""
    from loglinear.ops.decode import KeyWindow
    from loglinear.ops.triton.decode import fused_decode_step

    rows = []
    gen = torch.Generator().manual_seed(0)
    mamba2 = (1, configs["mamba2"]["num_heads"], configs["mamba2"]["state_size"], configs["mamba2"]["head_dim"])
    shapes = {"mamba2": (*mamba2, "scalar"), "gla": (*mamba2, "channel"),  # GLA: a decay per key channel
              "gdn": (configs["gdn"]["num_heads"], configs["gdn"]["num_heads"], configs["gdn"]["head_dim"],
                      int(configs["gdn"]["head_dim"] * configs["gdn"]["expand_v"]), "delta")}
    for variant in variants:
        G, H, K, V, transition = shapes[variant]
        gdn = transition == "delta"
        for batch in batches:
            for context in contexts:
                L = levels_needed(context + 1)
                bf16 = dict(device=device, dtype=torch.bfloat16)  # the models' dtypes: q, k, v bf16; g, beta, lam fp32
                q, k, v = (torch.randn(batch, G, K, **bf16), torch.randn(batch, G, K, **bf16),
                           torch.randn(batch, H, V, **bf16))
                g = -torch.rand(batch, H, *((K,) if transition == "channel" else ()), device=device)
                beta = torch.rand(batch, H, device=device)
                lam = torch.rand(batch, H, L, device=device)

                log_scales = torch.zeros(batch, L, H, *g.shape[2:], device=device)
                # start 0: the window's block in token form at every position, as in decoding past the first turn
                start = torch.zeros(batch, dtype=torch.int64, device=device)
                window = KeyWindow.empty_at(start, key_window, G, H, K, V, torch.float32) if gdn else None

                def step_us(levels: torch.Tensor, pos: torch.Tensor, fenwick: bool, lazy: bool = True) -> float:
                    pos = pos.to(device)  # on the device, as in graphed decoding: no copy in the timed call
                    fn = lambda: fused_decode_step(q, k, v, g, beta if gdn else None, lam, levels,  # noqa: E731
                                                   pos, 0.1, fenwick=fenwick, l2norm_qk=gdn, out=levels,
                                                   log_scales=log_scales if fenwick and lazy else None,
                                                   window=window if fenwick and lazy else None)
                    return graph_us(fn, device)

                def mean_us(levels: torch.Tensor, positions: list[torch.Tensor], lazy: bool = True) -> float:
                    return sum(step_us(levels, pos, True, lazy) for pos in positions) / len(positions)

                levels = torch.randn(batch, L, H, K, V, device=device)  # the cost depends on positions, not values
                drawn = [torch.randint(context // 2, context, (batch,), generator=gen) for _ in range(draws)]
                row = {
                    "variant": variant, "batch": batch, "context": context, "levels": L,
                    "log_linear_us": mean_us(levels, drawn),
                    # lazy levels kept in bf16 (FenwickCache's level_dtype), the same positions
                    "log_linear_bf16_us": mean_us(levels.to(torch.bfloat16), drawn),
                    "log_linear_worst_us": step_us(levels, torch.full((batch,), context), True),
                    "plain_us": step_us(torch.randn(batch, 1, H, K, V, device=device), torch.full((batch,), context),
                                        False),
                    "state_bytes": levels.numel() * 4,
                }
                if gdn:
                    turn = drawn[0] // key_window * key_window
                    run = [turn + i for i in range(key_window)]
                    row.update(window_mean_us=mean_us(levels, run),
                               window_mean_bf16_us=mean_us(levels.to(torch.bfloat16), run),
                               every_level_us=mean_us(levels, drawn, lazy=False))
                rows.append(row)
    return rows


def check_kernel(device) -> dict:
    """Fused kernel vs the PyTorch step on the device, every variant with a fused decode kernel (fp32, GQA, rows
    at different positions; random levels), and every variant's lazy levels over six in-place steps (random levels
    where the positions hold them, zero elsewhere; Gated DeltaNet with a window of 4 tokens)."""
    from loglinear.ops.decode import KeyWindow, decode_step, lazy_level_states
    from loglinear.variants import GATED_DELTANET, GLA, MAMBA2

    errors = {}
    for variant in (MAMBA2, GATED_DELTANET, GLA):
        N, G, H, K, V, L = 5, 2, 4, 64, 96, 12
        gates = {n: x[:, 0].to(device) for n, x in variant.sample_gates(N, 1, H, K).items()}
        args = (variant, torch.randn(N, G, K, device=device), torch.randn(N, G, K, device=device) / 8,
                torch.randn(N, H, V, device=device), gates, torch.rand(N, H, L, device=device),
                torch.randn(N, L, H, K, V, device=device), torch.tensor([0, 1, 8, 1023, 2047], device=device), 0.125)
        o1, s1 = decode_step(*args, l2norm_qk=True, backend="triton")
        o2, s2 = decode_step(*args, l2norm_qk=True, backend="torch")
        errors[variant.name] = {
            "o_rel_err": float((o1 - o2).norm() / o2.norm()), "state_rel_err": float((s1 - s2).norm() / s2.norm()),
        }
    for variant in (MAMBA2, GLA, GATED_DELTANET):  # lazy levels in place (graphed decoding's), consecutive steps
        N, G, H, K, V, L = 5, 2, 4, 64, 96, 12
        gen = torch.Generator(device=device).manual_seed(1)
        pos = torch.tensor([0, 1, 8, 1023, 2041], device=device)
        held = held_levels(pos, L)[:, :, None, None, None]
        states = [torch.randn(N, L, H, K, V, device=device, generator=gen) * held for _ in range(2)]
        states[1] = states[0].clone()
        scales = [torch.zeros(N, L, H, *((K,) if variant is GLA else ()), device=device) for _ in range(2)]
        windows = [KeyWindow.empty_at(pos, 4, G, H, K, V, torch.float32) if variant.delta_rule else None
                   for _ in range(2)]
        err = {"o_rel_err": 0.0, "state_rel_err": 0.0}
        for step in range(6):  # the delta rule's window of 4 turns at 4, 8, 1024 and 2044
            gates = {n: x[:, 0].to(device) for n, x in variant.sample_gates(N, 1, H, K).items()}
            args = (variant, torch.randn(N, G, K, device=device), torch.randn(N, G, K, device=device) / 8,
                    torch.randn(N, H, V, device=device), gates, torch.rand(N, H, L, device=device))
            o = [decode_step(*args, states[i], pos + step, 0.125, out=states[i], log_scales=scales[i],
                             window=windows[i], l2norm_qk=variant.delta_rule, backend=b)[0]
                 for i, b in enumerate(("triton", "torch"))]
            full = [lazy_level_states(x, ls, w, pos + step + 1) for x, ls, w in zip(states, scales, windows)]
            err["o_rel_err"] = max(err["o_rel_err"], float((o[0] - o[1]).norm() / o[1].norm()))
            err["state_rel_err"] = max(err["state_rel_err"], float((full[0] - full[1]).norm() / full[1].norm()))
        errors[f"{variant.name}_lazy"] = err
    return errors


@torch.no_grad()
def check_model_parity(device) -> dict:
    """Cached prefill + single-token steps vs the full forward, fp32 tiny models on the device (left padding)."""
    errors = {}
    for name in ("ll_mamba2", "mamba2", "ll_gdn", "gdn"):
        configs = model_configs(tiny=True)
        model = build(name, configs, device, torch.float32)
        ids = torch.randint(0, 64, (3, 100), device=device)
        mask = torch.ones_like(ids)
        mask[1, :17], mask[2, :64] = 0, 0
        full = model(ids, attention_mask=mask, use_cache=False).logits
        out = model(ids[:, :90], attention_mask=mask[:, :90], use_cache=True)
        logits, cache = [out.logits], out[CACHE_KEY]
        for t in range(90, 100):
            out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], use_cache=True, **{CACHE_KEY: cache})
            logits.append(out.logits)
            cache = out[CACHE_KEY]
        real = mask.bool()
        step = torch.cat(logits, 1)[real]
        errors[name] = float((step - full[real]).norm() / full[real].norm())
    return errors


@torch.no_grad()
def check_graph_parity(device) -> dict:
    """Greedy steps through FenwickCache(cuda_graph=True) (CUDA graph replays) vs the ordinary cached steps, fp32
    tiny models on the device, left padding: relative error of the logits."""
    errors = {}
    for name in ("ll_mamba2", "mamba2", "ll_gdn", "gdn"):
        model = build(name, model_configs(tiny=True), device, torch.float32)
        ids = torch.randint(0, 64, (3, 40), device=device)
        mask = torch.ones_like(ids)
        mask[1, :7] = 0
        logits = []
        for cache in (FenwickCache(2), FenwickCache(2, cuda_graph=True)):
            out = model(ids, attention_mask=mask, use_cache=True, **{CACHE_KEY: cache})
            steps, step_mask = [out.logits[:, -1:]], mask
            for _ in range(30):  # from position 40 past 64 (a 7-level carry)
                step_mask = torch.cat([step_mask, torch.ones_like(step_mask[:, :1])], 1)
                nxt = steps[-1].argmax(-1)
                steps.append(model(nxt, attention_mask=step_mask, use_cache=True, **{CACHE_KEY: cache}).logits)
            logits.append(torch.cat(steps, 1))
        if cache.graph is None or cache.graph.graph is None:
            raise RuntimeError(f"{name}: the steps did not run as a CUDA graph")
        errors[name] = float((logits[1] - logits[0]).norm() / logits[0].norm())
    return errors


NO_STOP = "none"  # generate() without an eos token: max_new_tokens is the only stopping criterion
EOS_STOP = "eos+min_new_tokens"  # the model's eos token, min_new_tokens forcing the length
STOPS = (NO_STOP, EOS_STOP)


def generate_kwargs(model, stop: str, n: int) -> dict:
    """generate()'s arguments for exactly ``n`` new tokens, greedy. NO_STOP: eos_token_id=None, so no eos stopping
    criterion and no logits processor (the decoding loop's own cost); EOS_STOP: the model's eos token and
    min_new_tokens=n, so two min-length logits processors and an eos stopping criterion run every step."""
    if stop == NO_STOP:
        return dict(max_new_tokens=n, eos_token_id=None, do_sample=False)
    if stop != EOS_STOP:
        raise ValueError(f"stop is one of {STOPS}, got {stop!r}")
    eos = model.generation_config.eos_token_id
    if eos is None:
        raise ValueError(f"{type(model).__name__} has no eos token: {EOS_STOP} would measure {NO_STOP}")
    return dict(max_new_tokens=n, min_new_tokens=n, eos_token_id=eos, do_sample=False)


@torch.no_grad()
def time_generate(model, ids: torch.Tensor, n: int, graph: bool, stop: str, device) -> float:
    """Seconds of one model.generate() call of ``n`` new tokens from a fresh FenwickCache (prefill included),
    after checking it produced exactly ``n``."""
    cache = FenwickCache(len(model.model.layers), cuda_graph=graph)
    sync(device)
    start = time.perf_counter()
    out = model.generate(ids, **generate_kwargs(model, stop, n), **{CACHE_KEY: cache})
    sync(device)
    seconds = time.perf_counter() - start
    if out.shape[1] - ids.shape[1] != n:
        raise RuntimeError(f"generate() with stop={stop!r} produced {out.shape[1] - ids.shape[1]} new tokens, "
                           f"not {n}: the short/long difference would not be {n} tokens")
    return seconds


def ms_per_generated_token(model, ids: torch.Tensor, graph: bool, stop: str, device, short: int, long: int,
                           repeats: int) -> dict:
    """ms per generated token: after a warm-up call, ``repeats`` interleaved pairs (short, long, short, long, ...),
    each pair's (t_long - t_short) / (long - short) (prefill and generate()'s setup cancel); their median, min, max."""
    time_generate(model, ids, short, graph, stop, device)  # warm-up: kernels compiled, the graph captured once
    per_pair = []
    for _ in range(repeats):
        t_short = time_generate(model, ids, short, graph, stop, device)
        t_long = time_generate(model, ids, long, graph, stop, device)
        per_pair.append(1000 * (t_long - t_short) / (long - short))
    return {"ms_per_token": statistics.median(per_pair), "ms_per_token_min": min(per_pair),
            "ms_per_token_max": max(per_pair)}


def generate_times(configs: dict, device, prompt: int = 64, short: int = 32, long: int = 160, repeats: int = 3,
                   graphs: tuple[bool, ...] = (False, True)) -> list[dict]:
    """ms per generated token through model.generate() (greedy, B = 1), eager cache vs CUDA graph (on the CPU the
    graphed step runs eagerly), each without a stop token (NO_STOP) and with the eos token and min_new_tokens
    (EOS_STOP): ms_per_generated_token, a row per (model, graph, stop)."""
    rows = []
    for name in ("ll_mamba2", "mamba2", "ll_gdn", "gdn"):
        model = build(name, configs, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        ids = torch.randint(0, model.config.vocab_size, (1, prompt), device=device)
        for graph in graphs:
            for stop in STOPS:
                rows.append({"model": name + (GRAPH if graph else ""), "stop": stop, "prompt": prompt,
                             "new_tokens": [short, long], "repeats": repeats,
                             **ms_per_generated_token(model, ids, graph, stop, device, short, long, repeats)})
                print(rows[-1], flush=True)
    return rows


GUARDED = ("kernel_failed", "generate", "kernel_check", "graph_parity", "model_parity")  # run()'s guarded parts


def failed(results: dict, part: str) -> bool:
    """Did the guarded part (guarded) raise?"""
    return isinstance(results.get(part), dict) and "error" in results[part]


def guarded(fn, *args):
    """fn(*args), or the error it raised (a failing check is reported, the timings still run)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - reported in the results
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def times_kernels(args) -> bool:
    """Whether the fused step's rows run: on a GPU, or tiny under the Triton interpreter."""
    return torch.device(args.device).type == "cuda" or args.tiny and os.environ.get("TRITON_INTERPRET") == "1"


def run(args, save) -> dict:
    """Timings, then the kernel alone, then the device checks (--kernel-only: the kernel alone); ``save(results)``
    after each phase."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    configs = model_configs(args.tiny)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "triton": triton_version(), "configs": configs, "steps": args.steps,
               "key_window": args.key_window,
               "rows": []}
    free = torch.cuda.mem_get_info()[0] if device.type == "cuda" else 8 << 30
    for name in [] if args.kernel_only else args.models:
        model = build(name, configs, device, dtype)
        for batch in args.batches:
            for context in args.contexts:
                row = {"model": name, "batch": batch, "context": context}
                if name == "llama_sdpa":
                    row["cache_bytes_analytic"] = kv_bytes_analytic(configs, batch, context, dtype)
                    if 2.2 * row["cache_bytes_analytic"] > free:
                        row["skipped"] = "KV cache does not fit"
                        results["rows"].append(row)
                        print(row, flush=True)
                        continue
                    cache = kv_cache_at(model, batch, context, device, dtype)
                else:
                    cache = fenwick_cache_at(model, batch, context, device, cuda_graph=name.endswith(GRAPH),
                                             key_window=args.key_window)
                row["cache_bytes"] = cache_bytes(name, cache)
                timed = guarded(time_steps, name, model, cache, batch, context, args.steps, args.warmup, device)
                row["ms_per_token" if isinstance(timed, float) else "failed"] = timed
                if name.endswith(GRAPH):  # the static buffers the first step moved the states into
                    row["cache_bytes"] = cache_bytes(name, cache)
                results["rows"].append(row)
                print(row, flush=True)
                del cache
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        del model
        save(results)
    if times_kernels(args):
        kernel = guarded(kernel_times, configs, args.contexts, args.batches, device, args.key_window,
                         tuple(args.kernel_variants))
        results["kernel" if isinstance(kernel, list) else "kernel_failed"] = kernel
        print(kernel, flush=True)
        save(results)
    if device.type == "cuda" and not args.kernel_only:
        results["generate"] = guarded(generate_times, configs, device)
        save(results)
        results["kernel_check"] = guarded(check_kernel, device)
        save(results)
        results["graph_parity"] = guarded(check_graph_parity, device)
        save(results)
        results["model_parity"] = guarded(check_model_parity, device)
        print("kernel check", results["kernel_check"], "model parity", results["model_parity"], flush=True)
        save(results)
    return results


def summary(results: dict) -> list[str]:
    """The targets, checked on the measured rows."""
    rows = [r for r in results["rows"] if "ms_per_token" in r]
    lines = []
    by = {(r["model"], r["batch"], r["context"]): r for r in results["rows"]}
    contexts = sorted({r["context"] for r in results["rows"] + results.get("kernel", [])}) or [0]
    ref = 65536 if 65536 in contexts else contexts[len(contexts) // 2]
    for variant, plain in (("ll_mamba2", "mamba2"), ("ll_gdn", "gdn")):
        for batch in sorted({r["batch"] for r in rows}):
            a, b = by.get((variant, batch, ref)), by.get((plain, batch, ref))
            if a and b and "ms_per_token" in a and "ms_per_token" in b:
                lines.append(f"- {variant} / {plain} step at T={ref}, B={batch}: "
                             f"{a['ms_per_token'] / b['ms_per_token']:.2f}x "
                             f"(target <= 1.5x)")
            lat = [by[(variant, batch, t)]["ms_per_token"] for t in contexts
                   if "ms_per_token" in by.get((variant, batch, t), {})]
            if lat:
                lines.append(f"- {variant} B={batch}: step latency {min(lat):.2f}..{max(lat):.2f} ms "
                             f"over T={contexts[0]}..{contexts[-1]} "
                             f"(x{max(lat) / min(lat):.2f}; "
                             f"log factor {levels_needed(contexts[-1]) / levels_needed(contexts[0]):.2f})")
    for graphed in ("ll_mamba2_graph", "mamba2_graph", "ll_gdn_graph", "gdn_graph"):
        r = by.get((graphed, 1, ref))
        if r and "ms_per_token" in r:
            eager = by.get((graphed.removesuffix(GRAPH), 1, ref), {}).get("ms_per_token")
            versus = f" (eager {eager:.2f} ms)" if eager else ""
            lines.append(f"- {graphed} B=1 T={ref}: {r['ms_per_token']:.3f} ms per token{versus} (target <= 1.0 ms)")
    gen = results.get("generate")
    if isinstance(gen, list):
        lines.append(generate_summary(gen))
    lines += [f"- {part}: FAILED ({results[part]['error']})" for part in GUARDED if failed(results, part)]
    top = contexts[-1]
    for variant in ("ll_mamba2", "ll_gdn"):
        for batch in sorted({r["batch"] for r in results["rows"]}):
            a, kv = by.get((variant, batch, top)), by.get(("llama_sdpa", batch, top))
            if a and kv and "cache_bytes" in a:
                kv_b = kv.get("cache_bytes", kv.get("cache_bytes_analytic"))
                lines.append(f"- {variant} cache at T={top}, B={batch}: {a['cache_bytes'] / 2**20:.1f} MiB = "
                             f"{100 * a['cache_bytes'] / kv_b:.2f}% of the KV cache ({kv_b / 2**30:.1f} GiB) "
                             f"(target <= 2%)")
    for r in results.get("kernel", []):
        if r["context"] == ref:
            lines.append(f"- fused kernel {r['variant']} B={r['batch']} T={ref}: "
                         f"log-linear {r['log_linear_us']:.1f} us at positions in [T/2, T) "
                         f"({r['log_linear_worst_us']:.1f} us at p = T, all {r['levels']} levels touched) vs plain "
                         f"{r['plain_us']:.1f} us = {r['log_linear_us'] / r['plain_us']:.2f}x "
                         f"({r['log_linear_worst_us'] / r['plain_us']:.2f}x)"
                         + (f"; bf16 levels {r['log_linear_bf16_us']:.1f} us = "
                            f"{r['log_linear_bf16_us'] / r['plain_us']:.2f}x" if r.get("log_linear_bf16_us") else "")
                         + (f"; per token over {results.get('key_window')} tokens from a turn "
                            f"{r['window_mean_us']:.1f} us = {r['window_mean_us'] / r['plain_us']:.2f}x, bf16 levels "
                            f"{r['window_mean_bf16_us']:.1f} us = {r['window_mean_bf16_us'] / r['plain_us']:.2f}x; "
                            f"every held level rewritten {r['every_level_us']:.1f} us" if "window_mean_us" in r else "")
                         + (" (target <= 4x)" if r["batch"] == 16 else ""))
    return lines


def generate_by_model(gen: list[dict]) -> dict[str, dict[str, dict]]:
    """generate_times' rows by model, then by stop."""
    by: dict[str, dict[str, dict]] = {}
    for r in gen:
        by.setdefault(r["model"], {})[r["stop"]] = r
    return by


def generate_summary(gen: list[dict]) -> str:
    """The target line of generate_times' rows: per model NO_STOP's median, EOS_STOP's in parentheses."""
    cells = []
    for model, stops in generate_by_model(gen).items():
        cells.append(" ".join([model] + [f"{stops[s]['ms_per_token']:.3f}" if s == NO_STOP
                                         else f"({s} {stops[s]['ms_per_token']:.3f})" for s in STOPS if s in stops]))
    return (f"- through generate(), B=1, greedy: {', '.join(cells)} ms per token "
            "(no stop token; in parentheses with the eos token and min_new_tokens)")


def generate_markdown(gen: list[dict]) -> list[str]:
    """generate_times' rows as a section: what the two configurations are, then median (min..max) per model."""
    def cell(r: dict | None) -> str:
        if r is None:
            return "—"
        return f"{r['ms_per_token']:.3f} ({r['ms_per_token_min']:.3f}..{r['ms_per_token_max']:.3f})"

    r0 = gen[0]
    short, long = r0["new_tokens"]
    lines = ["", "## Through generate(): ms per generated token (B=1, greedy)", "",
             f"The time of generate() with {long} new tokens minus that with {short} (prefill and setup cancel), over "
             f"the difference; prompt {r0['prompt']} tokens, a fresh cache per call; the median over "
             f"{r0['repeats']} interleaved (short, long) pairs after a warm-up call (min..max). "
             f"`{NO_STOP}`: no eos token (eos_token_id=None), so generate() stops at max_new_tokens only and runs no "
             "logits processor: the decoding loop's own cost. "
             f"`{EOS_STOP}`: the model's eos token with min_new_tokens forcing the length, so min-length logits "
             "processors and an eos stopping criterion run every step.", "",
             "| model | " + " | ".join(STOPS) + " |", "|---" * (len(STOPS) + 1) + "|"]
    for model, stops in generate_by_model(gen).items():
        lines.append(f"| {model} | " + " | ".join(cell(stops.get(s)) for s in STOPS) + " |")
    return lines


def write_markdown(results: dict, path: str) -> None:
    contexts = sorted({r["context"] for r in results["rows"]})
    lines = [f"# Decoding: per-token latency and cache memory vs context "
             f"({results['device']}, torch {results['torch']})", "",
             *([f"{results['date']}; `{results['command']}`", ""] if "command" in results else []),
             ("2-layer models at the paper's width, bf16 weights, fp32 Fenwick states, bf16 KV cache; "
              f"{results['steps']} greedy steps through the HF model per point (Python included). "
              if results["rows"] else "The fused step alone (--kernel-only). ")
             + "See benchmarks/bench_decode.py.", "", "## Targets", ""] + summary(results)
    for batch in sorted({r["batch"] for r in results["rows"]}):
        lines += ["", f"## Batch {batch}: ms per token", "",
                  "| model | " + " | ".join(f"{t:,}" for t in contexts) + " |",
                  "|---" * (len(contexts) + 1) + "|"]
        for name in dict.fromkeys(r["model"] for r in results["rows"]):
            cells = []
            for t in contexts:
                r = next((r for r in results["rows"]
                          if (r["model"], r["batch"], r["context"]) == (name, batch, t)), None)
                cells.append("—" if r is None or "ms_per_token" not in r else f"{r['ms_per_token']:.2f}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += ["", f"## Batch {batch}: cache MiB (KV: analytic where it did not fit)", "",
                  "| model | " + " | ".join(f"{t:,}" for t in contexts) + " |", "|---" * (len(contexts) + 1) + "|"]
        for name in dict.fromkeys(r["model"] for r in results["rows"]):
            cells = []
            for t in contexts:
                r = next((r for r in results["rows"]
                          if (r["model"], r["batch"], r["context"]) == (name, batch, t)), None)
                b = None if r is None else r.get("cache_bytes", r.get("cache_bytes_analytic"))
                cells.append("—" if b is None else f"{b / 2**20:,.1f}" + ("*" if "cache_bytes" not in r else ""))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if isinstance(results.get("generate"), list) and results["generate"]:
        lines += generate_markdown(results["generate"])
    if results.get("kernel"):
        lines += ["", "## Fused decode kernel alone (one layer, in place; GPU time of one CUDA-graph replay, cold L2, "
                  "us)", "",
                  "Log-linear: the mean over draws of every sequence's position from [T/2, T), and at p = T (a power "
                  "of two: every level held before the token merges into a new one, the most a step touches); "
                  f"lazy levels (log-scales; Gated DeltaNet also a key window of {results.get('key_window')} tokens, "
                  "turning at p = T), as graphed "
                  "decoding keeps them; bf16 levels: the "
                  "same positions with the lazy levels in bf16 (level_dtype). Plain: one level.",
                  "",
                  "| variant | batch | T | levels | log-linear us | at p = T | bf16 levels us | plain us | ratio "
                  "| at p = T |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["kernel"]:
            bf16 = f"{r['log_linear_bf16_us']:.1f}" if r.get("log_linear_bf16_us") else "—"
            lines.append(f"| {r['variant']} | {r['batch']} | {r['context']:,} | {r['levels']} | "
                         f"{r['log_linear_us']:.1f} | {r['log_linear_worst_us']:.1f} | {bf16} | {r['plain_us']:.1f} | "
                         f"{r['log_linear_us'] / r['plain_us']:.2f} | {r['log_linear_worst_us'] / r['plain_us']:.2f} |")
        window = [r for r in results["kernel"] if "window_mean_us" in r]
        if window:
            lines += ["", f"Gated DeltaNet's key window ({results.get('key_window')} tokens): per token over that many "
                      "consecutive tokens from a turn (the held levels' rewrite at the turn shared out), and the step "
                      "that rewrites every held level instead (no lazy levels, fp32, the drawn positions).", "",
                      "| batch | T | per token us | bf16 levels us | every level rewritten us | plain us "
                      "| ratio (bf16) |", "|---|---|---|---|---|---|---|"]
            for r in window:
                lines.append(f"| {r['batch']} | {r['context']:,} | {r['window_mean_us']:.1f} | "
                             f"{r['window_mean_bf16_us']:.1f} | {r['every_level_us']:.1f} | {r['plain_us']:.1f} | "
                             f"{r['window_mean_us'] / r['plain_us']:.2f} "
                             f"({r['window_mean_bf16_us'] / r['plain_us']:.2f}) |")
    if "kernel_check" in results:
        lines += ["", f"Kernel check on the device (fused vs PyTorch step, fp32): {results['kernel_check']}"]
    if "graph_parity" in results:
        lines += ["", "CUDA graph check on the device (graphed vs ordinary cached steps, fp32, left padding, relative "
                  f"error of the logits): {results['graph_parity']}"]
    if "model_parity" in results:
        lines += ["", "Model check on the device (cached prefill + steps vs full forward, fp32, left padding, "
                  f"relative error of the logits): {results['model_parity']}"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(results: dict, path: str) -> None:
    plt = pyplot()
    batches = sorted({r["batch"] for r in results["rows"]})
    fig, axes = plt.subplots(2, len(batches), figsize=(6 * len(batches), 8), squeeze=False)
    for j, batch in enumerate(batches):
        for name in dict.fromkeys(r["model"] for r in results["rows"]):
            rows = [r for r in results["rows"] if r["model"] == name and r["batch"] == batch]
            lat = [(r["context"], r["ms_per_token"]) for r in rows if "ms_per_token" in r]
            mem = [(r["context"], r.get("cache_bytes", r.get("cache_bytes_analytic")) / 2**20) for r in rows]
            if lat:
                axes[0, j].plot(*zip(*lat), marker="o", label=name)
            axes[1, j].plot(*zip(*mem), marker="o", label=name, linestyle="--" if name == "llama_sdpa" else "-")
        axes[0, j].set(xscale="log", yscale="log", xlabel="context T", ylabel="ms per token", title=f"batch {batch}")
        axes[1, j].set(xscale="log", yscale="log", xlabel="context T", ylabel="cache MiB")
        axes[0, j].legend(fontsize=8)
        axes[1, j].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--contexts", nargs="+", type=int,
                        default=[1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="tiny models (CPU smoke run)")
    parser.add_argument("--kernel-only", action="store_true",
                        help="the fused step's rows alone: no models, generate() or device checks (what "
                             "benchmarks/profiling/ab_trees.py --bench decode compares)")
    parser.add_argument("--kernel-variants", nargs="+", default=list(KERNEL_VARIANTS), choices=KERNEL_VARIANTS,
                        help="the variants of the fused step's rows")
    parser.add_argument("--key-window", type=int, default=KEY_WINDOW,
                        help="tokens of Gated DeltaNet's key window (graphed models and the kernel rows; a power of "
                             f"two from 2 to {MAX_KEY_WINDOW})")
    args = parser.parse_args(argv)
    check_script_options("bench_decode.py", {"--steps": (args.steps, 1), "--warmup": (args.warmup, 0),
                                             "--contexts": (args.contexts, 1), "--batches": (args.batches, 1),
                                             "--key-window": (args.key_window, 2)}, args.device)
    if args.key_window & (args.key_window - 1):
        refuse("bench_decode.py", f"--key-window must be a power of two, got {args.key_window}")
    if args.key_window > MAX_KEY_WINDOW:
        refuse("bench_decode.py", f"--key-window must be <= {MAX_KEY_WINDOW}, got {args.key_window}")
    if args.kernel_only and not times_kernels(args):
        refuse("bench_decode.py", "--kernel-only needs a CUDA device (or --tiny under TRITON_INTERPRET=1)")
    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    gpu = machine_name(args.device)
    stem = os.path.join(args.out, f"decode-{gpu}")
    command = "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:]))
    date = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"

    def save(results: dict) -> None:
        results.update(command=command, date=date)
        with open(stem + ".json", "w") as f:
            json.dump(results, f, indent=1)
        write_markdown(results, stem + ".md")

    results = run(args, save)
    if results["rows"]:  # the plot is of the models' rows
        plot(results, stem + ".png")
    print("\n".join(summary(results)))
    if any(failed(results, part) for part in GUARDED):
        sys.exit(1)  # written down, and not silent: a part that raised fails the run


if __name__ == "__main__":
    main()
