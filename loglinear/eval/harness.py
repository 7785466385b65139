"""lm-evaluation-harness tasks on trained runs (``loglinear eval --lm-eval``).

A run folder is a Hugging Face model (loglinear.train.export): after ``import loglinear.models`` registers the
loglinear model types, the Auto classes load it, and lm-eval's Hugging Face model class
(``lm_eval.models.huggingface.HFLM``) scores the loaded model and tokenizer like any causal LM (no hub look-ups,
so it works offline). Multiple-choice tasks compare the summed log-likelihoods of each choice's tokens after the
context (acc; acc_norm divides them by the choices' lengths in characters). Needs the ``eval`` extra:
``pip install "loglinear[eval]"``.

Results: lm-eval's dict (run_lm_eval), one json record per run (lm_eval_record) and the files
<out>/lm-eval-<tag>.json (the records) and .md (per run a table task | metric | value | stderr) (lm_eval_report).
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from loglinear.report import markdown_table, write_json

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

__all__ = ["require_lm_eval", "task_manager", "run_lm_eval", "lm_eval_record", "lm_eval_report"]

INSTALL = 'pip install "loglinear[eval]"'


def require_lm_eval() -> None:
    """Raise a ValueError naming the extra to install if lm-eval or what its Hugging Face model class imports
    (accelerate, transformers) is missing."""
    try:
        import lm_eval.models.huggingface  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--lm-eval needs lm-evaluation-harness ({e}): {INSTALL}") from e


def task_manager(tasks: list[str], include_path: str | Path | None = None) -> TaskManager:
    """An lm-eval TaskManager that knows every name in `tasks` (tasks, groups or tags), with the task YAMLs of
    the folder `include_path` (they override built-in tasks of the same name).

    When the folder defines every name in `tasks` as a task, only the folder is indexed (indexing lm-eval's ~15K
    built-in task configs takes ~15 s). Raises a ValueError naming the unknown names before any model is loaded.
    """
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not Path(include_path).is_dir():
            raise FileNotFoundError(f"--include-path {include_path}: no such folder")
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if set(tasks) <= set(local.all_subtasks):
            return local
    manager = TaskManager(include_path=None if include_path is None else str(include_path))
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s): {', '.join(unknown)} (`lm-eval ls tasks` lists them)")
    return manager


def run_lm_eval(run_dir: str | Path, tasks: list[str], *, include_path: str | Path | None = None,
                device: str | torch.device, batch_size: int, limit: int | None = None,
                num_fewshot: int | None = None, seed: int, manager: TaskManager | None = None) -> dict:
    """lm-eval's ``simple_evaluate`` of `tasks` on the run's model: its results dict, with "results" (per task
    "<metric>,<filter>" and "<metric>_stderr,<filter>"), "n-samples", "n-shot", "samples" (per document the
    requests and the model's answers, e.g. (log-likelihood, is greedy) per choice), "config", "date", ...

    limit: documents per task (None: all). num_fewshot: None = each task's own default. seed: python's, numpy's,
    torch's and the few-shot sampler's. bf16 autocast on CUDA (as the perplexity evaluation). manager: a
    task_manager(tasks, include_path) built beforehand (default: built here).
    """
    require_lm_eval()
    import loglinear.models  # noqa: F401  (registers the loglinear model types with the Auto classes)
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    manager = task_manager(tasks, include_path) if manager is None else manager
    device = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(str(run_dir)).to(device).eval()
    lm = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(str(run_dir)), backend="causal",
              batch_size=batch_size, mixed_precision_dtype=torch.bfloat16 if device.type == "cuda" else None)
    return simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, device=str(device),
                           batch_size=batch_size, limit=limit, num_fewshot=num_fewshot, random_seed=seed,
                           numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)


def _metrics(row: dict) -> dict[str, dict]:
    """One task's lm-eval result row -> {metric: {"value", "stderr"}}; the metric is named without lm-eval's
    ",none" filter suffix (other filters stay: "exact_match,strict-match"); stderr None where lm-eval has none."""
    metrics = {}
    for key, value in row.items():
        name, _, filt = key.partition(",")
        if filt and not name.endswith("_stderr"):
            stderr = row.get(f"{name}_stderr,{filt}")
            metrics[name if filt == "none" else key] = {
                "value": value, "stderr": stderr if isinstance(stderr, (int, float)) else None}
    return metrics


def lm_eval_record(run_dir: str | Path, tasks: list[str], results: dict) -> dict:
    """One run's json record from run_lm_eval's results: the run folder (absolute), the tasks asked for, the
    lm-eval version, limit, device, batch size, seed and start date, and per task (and group) the documents
    scored ("examples"; None for a group), the few-shot count and the metrics."""
    config = results["config"]
    return {
        "run": str(Path(run_dir).resolve()), "tasks": list(tasks), "lm_eval_version": results["lm_eval_version"],
        "limit": config["limit"], "device": config["device"], "batch_size": config["batch_size"],
        "seed": config["random_seed"],
        "date": datetime.fromtimestamp(results["date"]).astimezone().isoformat(timespec="seconds"),
        "results": {task: {"examples": results["n-samples"].get(task, {}).get("effective"),
                           "num_fewshot": results["n-shot"].get(task), "metrics": _metrics(row)}
                    for task, row in results["results"].items()},
    }


def lm_eval_report(records: list[dict], out: Path, title: str) -> str:
    """Write out.json (the records) and out.md (per run a table task | metric | value | stderr); return the
    markdown."""
    md = f"# {title}\n"
    for r in records:
        rows = [[task, name, m["value"], "" if m["stderr"] is None else m["stderr"]]
                for task, res in r["results"].items() for name, m in res["metrics"].items()]
        shots = ", ".join(f"{task} {res['examples']} ({res['num_fewshot']}-shot)" for task, res in r["results"].items()
                          if res["examples"] is not None)
        md += (f"\n## {r['run']}\n\nlm-eval {r['lm_eval_version']} on {r['device']}, {r['date']}; documents "
               f"scored: {shots}.\n\n" + markdown_table(["task", "metric", "value", "stderr"], rows))
    write_json(out.with_suffix(".json"), records)
    out.with_suffix(".md").write_text(md)
    return md
