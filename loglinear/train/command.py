"""``loglinear train``: train a language model on real text (default: the Python standard library's
source). One process, or torchrun --nproc_per_node N -m loglinear.cli train ... for FSDP2 data parallel."""

from __future__ import annotations

import argparse
import json
import os

from loglinear.train.factory import ARCHS
from loglinear.train.loop import TrainConfig, saved_config, train

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--arch", default=d.arch, choices=ARCHS, help="the model: transformer (Llama, the softmax "
                   "baseline), a variant (plain Mamba-2 / Gated DeltaNet) or ll_<variant> (its log-linear model)")
    p.add_argument("--d-model", type=int, default=d.d_model, help="model width (hidden size)")
    p.add_argument("--layers", type=int, default=d.n_layers, help="number of blocks")
    p.add_argument("--heads", type=int, default=None, help="attention / mixer heads (default: heads of 64 channels, "
                   "at least one: d_model // 64; for Mamba-2, at expand 2, twice that)")
    p.add_argument("--model-config", type=json.loads, default={}, help="JSON of extra config fields")
    p.add_argument("--corpus", default=None, help="'stdlib' (default: the Python standard library's "
                   "source), 'python' (the standard library and the installed packages' source) or a folder of "
                   ".txt/.md/.py/.jsonl files")
    p.add_argument("--data-dir", default=None, help="where the tokenized corpus is cached "
                   "(default: runs/data/<corpus>-<tokenizer><vocab>)")
    p.add_argument("--tokenizer", default=d.tokenizer, choices=["bpe", "bytes"],
                   help="bpe: a byte-level BPE trained on the corpus; bytes: UTF-8 bytes and an end-of-text token")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size,
                   help="vocabulary of the BPE tokenizer (--tokenizer bytes: always 257)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per training window")
    p.add_argument("--needle-rate", type=float, default=d.needle_rate,
                   help="fraction of training windows given needles and a query (teaches retrieval)")
    p.add_argument("--needle-keys", type=int, default=d.needle_keys,
                   help="a needle window gets 1 to this many keys, drawn at random")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps of the whole run")
    p.add_argument("--global-batch", type=int, default=d.global_batch, help="windows per step, all processes")
    p.add_argument("--micro-batch", type=int, default=None, help="windows per forward per process "
                   "(default: the process's whole share of the step, no gradient accumulation)")
    p.add_argument("--context-parallel", type=int, default=d.context_parallel,
                   help="processes sharing each sequence (log-linear models; processes = data parallel x this)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate of AdamW")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio,
                   help="the cosine schedule ends at this fraction of --lr")
    p.add_argument("--warmup", type=int, default=d.warmup, help="steps of linear warmup to --lr")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help="AdamW weight decay of the parameters with two or more dimensions (none on the others)")
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="largest gradient norm (clipped above it)")
    p.add_argument("--precision", default=d.precision, choices=["bf16", "fp32"],
                   help="bf16: bf16 autocast on CUDA; fp32: none (the CPU always runs fp32)")
    p.add_argument("--init", default=None, metavar="DIR",
                   help="start from the weights of this model folder (a finished run, or `loglinear convert` "
                   "output); the model options must match it")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in the backward: the same gradients in less memory, "
                   "about one more forward per step")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seeds the model's initialisation, the order of the windows and the needles")
    p.add_argument("--out-dir", default=None, help="the run's folder: checkpoints, metrics.jsonl and the Hugging Face "
                   "model (default: runs/lm/<arch>)")
    p.add_argument("--save-every", type=int, default=d.save_every,
                   help="also write a checkpoint every this many steps (0: only at the end)")
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="validation loss every this many steps (0: only at the end)")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches,
                   help="validation batches of --global-batch windows each")
    p.add_argument("--log-every", type=int, default=d.log_every,
                   help="append the training loss, learning rate, ... to <out-dir>/metrics.jsonl every this many "
                        "steps")
    p.add_argument("--device", default=None,
                   help="torch device, e.g. cpu or cuda:1 (default: cuda:<LOCAL_RANK> if CUDA is available, else cpu)")
    p.add_argument("--resume", action="store_true", help="continue from <out-dir>/checkpoint.pt with the run's saved "
                   "settings (options given again must agree with them, except how long it runs and how it reports)")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in <out-dir>")
    p.add_argument("--stop-after", type=int, default=None, help="end this run after this many steps "
                   "(checkpointed; --resume continues it exactly)")
    p.add_argument("--max-seconds", type=float, default=None, help="end this run (checkpoint, validation) "
                   "once training took this many seconds")
    p.add_argument("--profile-step", type=int, default=None, help="run this step (1-based; after the first "
                   "steps' compilation) under torch.profiler on every process: <out-dir>/profile-rank<r>.txt "
                   "(top kernels or ops, the context-parallel scopes cp/..., the step's wall time)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    corpus_name = a.corpus.rstrip("/").split("/")[-1] if a.corpus else "stdlib"
    vocab = a.vocab_size if a.tokenizer == "bpe" else ""
    return TrainConfig(
        arch=a.arch, d_model=a.d_model, n_layers=a.layers, n_heads=a.heads, model_overrides=a.model_config,
        corpus=a.corpus, data_dir=a.data_dir or f"runs/data/{corpus_name}-{a.tokenizer}{vocab}",
        tokenizer=a.tokenizer, vocab_size=a.vocab_size, seq_len=a.seq_len, needle_rate=a.needle_rate,
        needle_keys=a.needle_keys, steps=a.steps, global_batch=a.global_batch, micro_batch=a.micro_batch,
        context_parallel=a.context_parallel,
        lr=a.lr, min_lr_ratio=a.min_lr_ratio, warmup=a.warmup, weight_decay=a.weight_decay,
        grad_clip=a.grad_clip, precision=a.precision, activation_checkpointing=a.activation_checkpointing, init=a.init,
        seed=a.seed, out_dir=a.out_dir or f"runs/lm/{a.arch}",
        save_every=a.save_every, eval_every=a.eval_every, eval_batches=a.eval_batches, log_every=a.log_every,
        device=a.device, stop_after=a.stop_after, max_seconds=a.max_seconds, progress=not a.no_progress,
        profile_step=a.profile_step,
    )


# TrainConfig fields set by options of other names (the rest: the option's dest is the field's name)
FIELD_OPTIONS = {"n_layers": ("layers",), "n_heads": ("heads",), "model_overrides": ("model_config",),
                 "data_dir": ("data_dir", "corpus", "tokenizer", "vocab_size"), "progress": ("no_progress",)}


def resumed_config(cfg: TrainConfig, given: set[str]) -> TrainConfig:
    """cfg's out_dir run's saved config, with the fields of the options given on the command line taken from cfg
    (train() then refuses those that a resumed run cannot change)."""
    saved = saved_config(cfg.out_dir)
    if saved is None:
        return cfg
    fields = {name: getattr(cfg if set(FIELD_OPTIONS.get(name, (name,))) & given or name == "out_dir" else saved, name)
              for name in TrainConfig.__dataclass_fields__}
    return TrainConfig(**fields)


def run(args: argparse.Namespace) -> int:
    if args.tokenizer == "bytes" and "vocab_size" in getattr(args, "given", set()):
        raise ValueError("--vocab-size sets the BPE tokenizer's vocabulary; --tokenizer bytes has 257 tokens")
    cfg = config_from_args(args)
    if args.resume:
        cfg = resumed_config(cfg, getattr(args, "given", set()))
    res = train(cfg, resume=args.resume, overwrite=args.overwrite)
    if os.environ.get("RANK", "0") != "0":
        return 0
    if res["val_loss"] is not None:
        print(f"{cfg.arch}: {res['params'] / 1e6:.2f}M params, step {res['step']}, "
              f"val loss {res['val_loss']:.4f}, {res['train_seconds']:.0f} s -> {cfg.out_dir}")
    if res["step"] < cfg.steps:
        print(f"stopped at step {res['step']} of {cfg.steps} (checkpointed); continue with: loglinear train "
              f"--out-dir {cfg.out_dir} --resume")
    return 0
