"""`loglinear eval --lm-eval`: lm-evaluation-harness on a tiny trained run, offline, with a local multiple-choice
task defined by a YAML in an --include-path folder."""

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.tasks import TaskManager  # noqa: E402

from loglinear.cli import main as cli_main  # noqa: E402
from loglinear.eval.harness import run_lm_eval  # noqa: E402
from loglinear.train.loop import TrainConfig, train  # noqa: E402

DOCS = [
    {"question": "def f(x):", "choices": ["return x", "pass", "@@@@ ~~"], "label": 0},
    {"question": "import", "choices": ["os", "sys as s", "}}}"], "label": 1},
    {"question": "for i in", "choices": ["range(10):", "]]"], "label": 0},
    {"question": "class A", "choices": ["(object):", ":::::", "(B)"], "label": 2},
    {"question": "x = [", "choices": ["1, 2]", "))))"], "label": 0},
    {"question": "while", "choices": ["True:", "$$", "x < 3:"], "label": 2},
]
TASK = """task: mytask
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
"""


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    train(TrainConfig(arch="ll_mamba2", d_model=32, n_layers=1, n_heads=2, data_dir=str(tiny_data), tokenizer="bytes",
                      seq_len=16, steps=2, global_batch=2, warmup=1, out_dir=str(out), eval_batches=1,
                      progress=False, device="cpu"))
    return out


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """A folder with mytask.yaml: DOCS as a local json dataset (datasets' cache in the folder too)."""
    root = tmp_path_factory.mktemp("tasks")
    (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (root / "mytask.yaml").write_text(TASK.format(docs=json.dumps(str(root / "docs.jsonl")),
                                                  cache=json.dumps(str(root / "cache"))))
    return root


def test_lm_eval_end_to_end_offline(run, tasks, tmp_path):
    out = tmp_path / "eval"
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run([sys.executable, "-m", "loglinear", "eval", str(run), "--lm-eval", "mytask",
                           "--include-path", str(tasks), "--lm-eval-limit", "4", "--device", "cpu", "--windows", "1",
                           "--niah-lengths", "--out", str(out), "--tag", "t"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    [record] = json.loads((out / "lm-eval-t.json").read_text())
    assert record["run"] == str(run.resolve()) and record["tasks"] == ["mytask"] and record["limit"] == 4
    assert record["lm_eval_version"] == "0.4.13" and record["device"] == "cpu"
    res = record["results"]["mytask"]
    assert res["examples"] == 4 and res["num_fewshot"] == 0
    assert 0 <= res["metrics"]["acc"]["value"] <= 1 and res["metrics"]["acc"]["stderr"] > 0
    assert "| mytask | acc |" in (out / "lm-eval-t.md").read_text()
    assert (out / "lm-t.json").exists()  # the perplexity evaluation still runs


def _loglikelihood(model, context: str, continuation: str) -> float:
    """log p(continuation | context) summed over its byte tokens."""
    ctx, cont = list(context.encode()), list(continuation.encode())
    with torch.no_grad():
        logp = model(torch.tensor([ctx + cont])).logits[0, len(ctx) - 1 : -1].log_softmax(-1)
    return float(logp[torch.arange(len(cont)), cont].sum())


def test_lm_eval_scores_are_the_models_loglikelihoods(run, tasks):
    from transformers import AutoModelForCausalLM

    results = run_lm_eval(run, ["mytask"], include_path=tasks, device="cpu", batch_size=2, seed=0)
    model = AutoModelForCausalLM.from_pretrained(str(run)).eval()
    samples = sorted(results["samples"]["mytask"], key=lambda s: s["doc_id"])
    assert [s["doc"] for s in samples] == DOCS
    hits, hits_norm = [], []
    for doc, sample in zip(DOCS, samples):
        got = [resp[0][0] for resp in sample["resps"]]
        want = [_loglikelihood(model, doc["question"], " " + choice) for choice in doc["choices"]]
        assert got == pytest.approx(want, rel=1e-4, abs=1e-4)
        hits.append(max(range(len(want)), key=want.__getitem__) == doc["label"])
        norm = [w / len(c) for w, c in zip(want, doc["choices"])]
        hits_norm.append(max(range(len(norm)), key=norm.__getitem__) == doc["label"])
    row = results["results"]["mytask"]
    assert row["acc,none"] == pytest.approx(sum(hits) / len(DOCS))
    assert row["acc_norm,none"] == pytest.approx(sum(hits_norm) / len(DOCS))


def test_unknown_task_is_one_error_line(run, tasks, tmp_path, capsys, monkeypatch):
    # lm-eval's built-in tasks are not indexed here (~30 s on two cores): the known names are the folder's
    monkeypatch.setattr(TaskManager, "__init__", functools.partialmethod(TaskManager.__init__, include_defaults=False))
    argv = ["eval", str(run), "--lm-eval", "mytask", "no_such_task", "--include-path", str(tasks),
            "--device", "cpu", "--out", str(tmp_path / "eval")]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no_such_task" in err[0] and "mytask" not in err[0], err
    assert not (tmp_path / "eval").exists()  # checked before any run is evaluated


def test_missing_lm_eval_names_the_extra(run, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval.models.huggingface", None)
    assert cli_main(["eval", str(run), "--lm-eval", "hellaswag", "--device", "cpu"]) == 2
    assert 'pip install "loglinear[eval]"' in capsys.readouterr().err
