"""Language-model training on packed real text: AdamW, linear warmup + cosine decay, gradient clipping,
bf16 autocast on GPU, gradient accumulation, exact resume, a tqdm bar and a metrics jsonl log.

One process, or several under torchrun (data parallel with FSDP2, see parallel.py). The global batch
(`global_batch` windows per step) is the same for any number of processes: each rank takes its slice of
the step's windows, so N processes follow the single-process trajectory up to float reduction order.

`profile_step` N runs step N (1-based, as logged) under torch.profiler on every process and writes
out_dir/profile-rank<r>.txt: the step's wall time, the top kernels by device time (CUDA) or ops by self
CPU time, and the labelled context-parallel scopes (cp/..., loglinear.distributed).
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from loglinear.data.niah import insert_needles
from loglinear.data.text import PackedTokens, prepare_corpus, window_order
from loglinear.data.tokenizer import load_tokenizer
from loglinear.distributed import apply_context_parallel
from loglinear.distributed.training import ContextParallelPlan, plan_context_parallel
from loglinear.inputs import check_device, check_in_range, check_nonnegative_ints, check_positive_ints
from loglinear.train.checkpoint import CHECKPOINT, load_checkpoint, save_checkpoint
from loglinear.train.export import export_pretrained
from loglinear.train.factory import build_model, count_parameters
from loglinear.train.parallel import Parallel, all_reduce_mean, parallelize, setup_parallel, teardown
from loglinear.train.profiling import profiled_call

__all__ = [
    "TrainConfig", "train", "check_config", "saved_config", "RESUMABLE", "lm_loss", "cosine_schedule", "bf16_autocast",
    "model_from_config", "peak_memory_gib",
]


@dataclass
class TrainConfig:
    # model
    arch: str = "ll_mamba2"
    d_model: int = 256
    n_layers: int = 4
    n_heads: int | None = None
    model_overrides: dict = field(default_factory=dict)
    # data
    corpus: str | None = None  # None / "stdlib": the Python standard library's source; or a folder
    data_dir: str = "runs/data/stdlib-bpe4096"
    tokenizer: str = "bpe"
    vocab_size: int = 4096
    seq_len: int = 512
    needle_rate: float = 0.0  # fraction of training windows given needles + a query at the end
    needle_keys: int = 4  # each needle window gets 1..needle_keys keys
    # optimisation
    steps: int = 300
    global_batch: int = 16
    micro_batch: int | None = None  # windows per forward per process; None = all of the process's share
    context_parallel: int = 1  # processes sharing each window's sequence (loglinear.distributed); dp = world / cp
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    precision: str = "bf16"  # autocast dtype on CUDA ("bf16" or "fp32"); the CPU always runs fp32
    activation_checkpointing: bool = False  # recompute each block's activations in the backward (less memory)
    init: str | None = None  # a model folder (a finished run, `loglinear convert` output) whose weights start the run
    seed: int = 0
    # bookkeeping
    out_dir: str = "runs/lm"
    save_every: int = 100  # also a checkpoint every this many steps (0: only at the end)
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 8
    log_every: int = 10
    device: str | None = None
    stop_after: int | None = None  # end this run after this many steps (a later --resume continues)
    max_seconds: float | None = None  # end this run (checkpoint + validation) once training took this long
    progress: bool = True
    profile_step: int | None = None  # profile this step (1-based) on every process: out_dir/profile-rank<r>.txt


def cosine_schedule(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup to 1 over `warmup` steps, then cosine to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def lm_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"):
    """Next-token cross-entropy in fp32. inputs, targets: [B, T] (targets already shifted; -100 = ignore).
    reduction "none" gives [B, T]."""
    logits = model(input_ids=inputs, use_cache=False).logits.float()
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction, ignore_index=-100)
    return loss.view_as(targets) if reduction == "none" else loss


def model_from_config(cfg: TrainConfig, vocab_size: int) -> torch.nn.Module:
    return build_model(cfg.arch, vocab_size=vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers,
                       n_heads=cfg.n_heads, seed=cfg.seed, **cfg.model_overrides)


def load_initial_weights(model: torch.nn.Module, folder: str | Path) -> None:
    """Start from the weights of the Hugging Face model folder's model.safetensors (never a pickle). They must fit
    the model built from the run's options exactly; a ValueError lists what differs."""
    from safetensors.torch import load_file

    from loglinear.models.convert import load_exactly

    path = Path(folder) / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"init: no model.safetensors in {folder} (a finished run or a converted model)")
    load_exactly(model, load_file(path), f"init: {folder}'s weights do not fit the model of these options (give "
                 "the --arch, --d-model, --layers, --heads and --model-config it was made with)")


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute every block's activations in the backward (transformers' activation checkpointing: the same
    gradients, the blocks' activations are not kept)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def _optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas))


def _step_windows(data: PackedTokens, cfg: TrainConfig, step: int, tok) -> np.ndarray:
    """[global_batch, T + 1]: the step's windows, with needles (1..needle_keys keys) inserted into a seeded
    fraction of them."""
    rows = data.windows(window_order(data.num_windows, step, cfg.global_batch, cfg.seed))
    if cfg.needle_rate > 0:
        rng = np.random.default_rng([cfg.seed, step])
        for i in np.flatnonzero(rng.random(len(rows)) < cfg.needle_rate):
            rows[i] = insert_needles(rows[i], tok, int(rng.integers(1, cfg.needle_keys + 1)), rng)
    return rows


def bf16_autocast(device_type: str, bf16: bool) -> torch.autocast:
    """bf16 autocast where it is wanted and the device is CUDA; a disabled context elsewhere (CPU runs fp32)."""
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16 and device_type == "cuda")


def _autocast(par: Parallel, cfg: TrainConfig):
    return bf16_autocast(par.device.type, cfg.precision == "bf16")


@torch.no_grad()
def evaluate_loss(model, val: PackedTokens, cfg: TrainConfig, par: Parallel,
                  cp: ContextParallelPlan | None = None) -> float:
    """Mean validation loss over `eval_batches` batches of evenly spaced windows (split over processes)."""
    cp = cp or ContextParallelPlan(1, 0, None, par.rank, par.world_size)
    n = min(val.num_windows, cfg.eval_batches * cfg.global_batch)
    idx = torch.linspace(0, val.num_windows - 1, n).long()[cp.data_rank :: cp.data_size]
    mb = cfg.micro_batch or max(1, cfg.global_batch // cp.data_size)
    model.eval()
    total = torch.zeros((), device=par.device)
    for i in range(0, len(idx), mb):
        x, y = cp.shard(*val.batch(idx[i : i + mb]))
        with _autocast(par, cfg):
            total += lm_loss(model, x.to(par.device), y.to(par.device), reduction="sum")
    model.train()
    return float(all_reduce_mean(total, par)) * par.world_size / (n * cfg.seq_len)


def _train_step(model, rows: np.ndarray, cfg: TrainConfig, par: Parallel, cp: ContextParallelPlan) -> torch.Tensor:
    """Forward/backward of this rank's share of the step's windows (its slice of their sequence under
    context parallelism); returns the mean loss (this rank)."""
    share = cfg.global_batch // cp.data_size
    mine = torch.from_numpy(rows[cp.data_rank * share : (cp.data_rank + 1) * share])
    mb = cfg.micro_batch or share
    accum = share // mb
    total = torch.zeros((), device=par.device)
    for i in range(accum):
        chunk = mine[i * mb : (i + 1) * mb].to(par.device)
        if par.distributed:
            model.set_requires_gradient_sync(i == accum - 1)
        with _autocast(par, cfg):
            loss = lm_loss(model, *cp.shard(chunk[:, :-1], chunk[:, 1:])) / accum
        loss.backward()
        total += loss.detach()
    return total


def _optimizer_step(
    model, optimizer: torch.optim.Optimizer, scheduler, rows: np.ndarray, cfg: TrainConfig, par: Parallel,
    cp: ContextParallelPlan,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One training step on the step's windows rows [global_batch, T + 1]: forward/backward, clipping, AdamW,
    schedule. Returns (the loss averaged over processes, the gradient norm before clipping)."""
    loss = all_reduce_mean(_train_step(model, rows, cfg, par, cp), par)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss, grad_norm


def _check(cfg: TrainConfig, par: Parallel, cp: ContextParallelPlan) -> None:
    share, rem = divmod(cfg.global_batch, cp.data_size)
    if rem or share == 0:
        raise ValueError(f"global_batch {cfg.global_batch} must be a positive multiple of the {cp.data_size} "
                         f"data-parallel replicas ({par.world_size} processes / "
                         f"context_parallel {cfg.context_parallel})")
    if cfg.micro_batch is not None and share % cfg.micro_batch:
        raise ValueError(f"micro_batch {cfg.micro_batch} must divide the per-process batch {share}")


def _log(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


TRAIN_CONFIG = "train_config.json"  # the run's TrainConfig (config.json is the Hugging Face model's)

# fields a resumed run may change: how long it runs and how it reports, never its trajectory (more steps also
# stretch the cosine schedule from the resumed step on)
RESUMABLE = ("steps", "stop_after", "max_seconds", "progress", "profile_step", "device", "log_every", "eval_every",
             "save_every", "eval_batches", "out_dir", "activation_checkpointing")


def saved_config(out_dir: str | Path) -> TrainConfig | None:
    """The TrainConfig a run in out_dir was started with (its train_config.json), or None if there is none."""
    path = Path(out_dir) / TRAIN_CONFIG
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    fields = {k: v for k, v in saved.items() if k in TrainConfig.__dataclass_fields__}
    return TrainConfig(**fields | {"betas": tuple(fields.get("betas", TrainConfig.betas))})


def check_config(cfg: TrainConfig) -> None:
    """ValueError naming the first TrainConfig value that cannot work."""
    positive = ("d_model", "n_layers", "vocab_size", "seq_len", "steps", "global_batch", "context_parallel",
                "eval_batches", "log_every", "needle_keys")
    optional = ("n_heads", "micro_batch", "stop_after")  # None: the default rule
    check_positive_ints(**{name: getattr(cfg, name) for name in positive
                           + tuple(n for n in optional if getattr(cfg, n) is not None)})
    check_nonnegative_ints(**{name: getattr(cfg, name) for name in ("warmup", "save_every", "eval_every")})
    ranges = {"lr": (0, math.inf, False), "grad_clip": (0, math.inf, False), "weight_decay": (0, math.inf, True),
              "min_lr_ratio": (0, 1, True), "needle_rate": (0, 1, True)}
    for name, (low, high, closed) in ranges.items():
        check_in_range(name, getattr(cfg, name), low, high, low_closed=closed)
    if cfg.max_seconds is not None and not cfg.max_seconds >= 0:
        raise ValueError(f"max_seconds must be >= 0, got {cfg.max_seconds!r}")
    if cfg.device is not None:
        check_device("device", cfg.device)
    if cfg.profile_step is not None and not (isinstance(cfg.profile_step, int) and 1 <= cfg.profile_step <= cfg.steps):
        raise ValueError(f"profile_step must be a step in [1, steps = {cfg.steps}], got {cfg.profile_step!r}")


def _check_run_dir(cfg: TrainConfig, resume: bool, overwrite: bool) -> None:
    """resume: a checkpoint must exist and cfg may differ from the saved config only in RESUMABLE fields;
    otherwise an existing run is replaced only with overwrite."""
    out = Path(cfg.out_dir)
    if resume:
        if not (out / CHECKPOINT).is_file():
            raise ValueError(f"resume: no checkpoint at {out / CHECKPOINT}; train without resume to start this run")
        saved = saved_config(out)
        if saved is not None:
            changed = [f"{name}: {getattr(saved, name)!r} -> {getattr(cfg, name)!r}"
                       for name in TrainConfig.__dataclass_fields__
                       if name not in RESUMABLE and getattr(saved, name) != getattr(cfg, name)]
            if changed:
                raise ValueError(f"resume: the run in {out} was started with other settings, which a resumed run "
                                 f"cannot change: {'; '.join(changed)}")
    elif not overwrite and any((out / name).exists() for name in (CHECKPOINT, "metrics.jsonl")):
        raise ValueError(f"{out} already holds a run; resume it (resume=True, --resume) or replace it "
                         "(overwrite=True, --overwrite)")


def train(cfg: TrainConfig, resume: bool = False, overwrite: bool = False) -> dict:
    """Train (or, with resume, continue from out_dir/checkpoint.pt). Returns {"step", "losses", "val_loss", ...}.

    Writes out_dir/{train_config.json, metrics.jsonl, checkpoint.pt} and, when the run ends (or stops), the
    Hugging Face model and tokenizer (loglinear.train.export). ValueError for a resume without a checkpoint or
    with a changed trajectory (fields outside RESUMABLE), and for a new run over an existing one without
    overwrite."""
    check_config(cfg)
    _check_run_dir(cfg, resume, overwrite)
    par = setup_parallel(cfg.device)
    interrupt = _Interrupt()
    try:
        return _train(cfg, par, resume, interrupt)
    finally:
        interrupt.restore()
        teardown(par)


class _Interrupt:
    """SIGINT / SIGTERM while training: the current step finishes, a checkpoint is written and the run stops
    (resume continues it exactly). A second signal stops at once (KeyboardInterrupt). Handlers are installed in
    the main thread only and restored after the run."""

    def __init__(self):
        self.received: str | None = None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _train(cfg: TrainConfig, par: Parallel, resume: bool, interrupt: _Interrupt) -> dict:
    cp = plan_context_parallel(cfg.context_parallel, par.rank, par.world_size, par.device, cfg.seq_len)
    _check(cfg, par, cp)
    out = Path(cfg.out_dir)
    if par.is_main:
        meta = prepare_corpus(cfg.corpus, cfg.data_dir, tokenizer=cfg.tokenizer, vocab_size=cfg.vocab_size)
        out.mkdir(parents=True, exist_ok=True)
        if not resume:  # a replaced run's metrics do not continue into this one's
            (out / "metrics.jsonl").unlink(missing_ok=True)
    if par.distributed:
        torch.distributed.barrier()
    meta = json.loads((Path(cfg.data_dir) / "meta.json").read_text())
    tok = load_tokenizer(Path(cfg.data_dir) / "tokenizer.json")
    data = PackedTokens.from_dir(cfg.data_dir, "train", cfg.seq_len)
    val = PackedTokens.from_dir(cfg.data_dir, "val", cfg.seq_len)

    model = model_from_config(cfg, meta["vocab_size"])
    n_params = count_parameters(model)
    if cfg.init is not None and not resume:
        load_initial_weights(model, cfg.init)
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    if cp.size > 1:
        model = apply_context_parallel(model, cp.group)
    model = parallelize(model, par)
    optimizer = _optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: cosine_schedule(s, cfg.warmup, cfg.steps, cfg.min_lr_ratio))
    start = load_checkpoint(out, model, optimizer, scheduler) if resume else 0
    if par.is_main:
        (out / TRAIN_CONFIG).write_text(json.dumps(dict(asdict(cfg), params=n_params, vocab=meta["vocab_size"]),
                                                   indent=1))

    end = cfg.steps if cfg.stop_after is None else min(cfg.steps, start + cfg.stop_after)
    metrics = out / "metrics.jsonl"
    bar = tqdm(range(start, end), initial=start, total=cfg.steps, disable=not (cfg.progress and par.is_main),
               desc=f"train {cfg.arch}", dynamic_ncols=True)
    losses, t0, tokens = [], time.perf_counter(), 0
    for step in bar:
        rows = _step_windows(data, cfg, step, tok)
        run_step = partial(_optimizer_step, model, optimizer, scheduler, rows, cfg, par, cp)
        profiled = step + 1 == cfg.profile_step
        if profiled:
            title = (f"loglinear train: step {step + 1}, rank {par.rank} of {par.world_size}, {par.device}, "
                     f"context parallel {cp.size} (cp rank {cp.rank}), {cfg.arch} d_model {cfg.d_model} "
                     f"x {cfg.n_layers} layers, seq_len {cfg.seq_len}, global batch {cfg.global_batch}")
            loss, grad_norm = profiled_call(run_step, par, out / f"profile-rank{par.rank}.txt", title)
        else:
            loss, grad_norm = run_step()
        losses.append(float(loss))  # the same value on every process (all-reduced): they all stop together
        if not math.isfinite(losses[-1]):
            if par.is_main:
                _log(metrics, {"step": step + 1, "loss": losses[-1], "stopped": "non-finite loss"})
            raise FloatingPointError(
                f"the training loss is {losses[-1]} at step {step + 1}: the run diverged (try a lower --lr, a longer "
                f"--warmup or a smaller --grad-clip); {out} keeps its last checkpoint, not this step's weights")
        tokens += cfg.global_batch * cfg.seq_len
        log_now = (step + 1) % cfg.log_every == 0 or step + 1 == end
        peak = peak_memory_gib(par) if log_now else None
        if par.is_main:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if log_now:
                dt = time.perf_counter() - t0
                _log(metrics, {"step": step + 1, "loss": losses[-1], "lr": scheduler.get_last_lr()[0],
                               "grad_norm": float(grad_norm), "tokens": (step + 1) * cfg.global_batch * cfg.seq_len,
                               "elapsed_s": round(dt, 2), "tok_per_s": round(tokens / dt)}
                     | ({"peak_mem_gib": peak} if peak is not None else {}) | ({"profiled": True} if profiled else {}))
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < end:
            v = evaluate_loss(model, val, cfg, par, cp)
            if par.is_main:
                _log(metrics, {"step": step + 1, "val_loss": v})
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < end:
            save_checkpoint(out, step + 1, model, optimizer, scheduler, par)
        timed_out, interrupted = _stop_now(cfg, t0, par, interrupt) if step + 1 < end else (False, False)
        if timed_out or interrupted:
            end = step + 1
            break
    else:
        timed_out = interrupted = False
    weights = save_checkpoint(out, end, model, optimizer, scheduler, par)
    val_loss = evaluate_loss(model, val, cfg, par, cp) if end == cfg.steps or timed_out else None
    if par.is_main and val_loss is not None:
        _log(metrics, {"step": end, "val_loss": val_loss, "val_ppl": math.exp(val_loss)}
             | ({"stopped": f"max_seconds={cfg.max_seconds}"} if timed_out else {}))
    if par.is_main and interrupted:
        _log(metrics, {"step": end, "stopped": interrupt.received or "a signal on another process"})
    if par.is_main:
        fresh = model_from_config(cfg, meta["vocab_size"])  # the plain class (no FSDP / context-parallel wrapping)
        export_pretrained(out, fresh, weights, Path(cfg.data_dir) / "tokenizer.json")
    return {"step": end, "losses": losses, "val_loss": val_loss, "params": n_params,
            "train_seconds": time.perf_counter() - t0, "timed_out": timed_out, "interrupted": interrupted}


def peak_memory_gib(par: Parallel) -> float | None:
    """The largest `torch.cuda.max_memory_allocated` of any process so far, in GiB (None off CUDA).
    Every process must call it (a max all-reduce with several)."""
    if par.device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(par.device) / 2**30
    if par.distributed:
        most = torch.tensor(peak, device=par.device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        peak = float(most)
    return round(peak, 3)


def _stop_now(cfg: TrainConfig, t0: float, par: Parallel, interrupt: _Interrupt) -> tuple[bool, bool]:
    """(max_seconds passed, a stop signal arrived); every process stops at the same step: with several, the
    flags are reduced over processes."""
    flags = torch.tensor([cfg.max_seconds is not None and time.perf_counter() - t0 > cfg.max_seconds,
                          interrupt.received is not None], dtype=torch.float32)
    if par.distributed:
        flags = flags.to(par.device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    return bool(flags[0]), bool(flags[1])
