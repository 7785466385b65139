"""A finished run's folder is a Hugging Face model: Auto classes, the tokenizer and pipeline load it in a fresh
process and give what the training model gives."""

import subprocess
import sys

import pytest
import torch

from loglinear.train.checkpoint import read_checkpoint
from loglinear.train.export import hf_tokenizer
from loglinear.train.loop import TrainConfig, model_from_config, train

CHECK = """
import sys, torch
import loglinear  # registers the loglinear model types with the Auto classes
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
run = sys.argv[1]
model, tok = AutoModelForCausalLM.from_pretrained(run), AutoTokenizer.from_pretrained(run)
ids = tok("def f(x):\\n    return x", return_tensors="pt").input_ids
torch.save({"logits": model(ids).logits, "ids": ids, "eos": (tok.eos_token_id, model.config.eos_token_id)},
           sys.argv[2])
text = pipeline("text-generation", model=run)("def f", max_new_tokens=4, do_sample=False)[0]["generated_text"]
assert text.startswith("def f"), text
"""


@pytest.mark.parametrize("arch,tokenizer", [("ll_mamba2", "bytes"), ("transformer", "bytes")])
def test_run_directory_is_a_hugging_face_model(tiny_data, tmp_path, arch, tokenizer):
    cfg = TrainConfig(arch=arch, d_model=32, n_layers=1, n_heads=2, data_dir=str(tiny_data), tokenizer=tokenizer,
                      seq_len=16, steps=2, global_batch=2, warmup=1, out_dir=str(tmp_path), eval_batches=1,
                      progress=False, device="cpu")
    train(cfg)
    assert {"config.json", "model.safetensors", "tokenizer.json", "train_config.json"} <= {
        p.name for p in tmp_path.iterdir()}
    done = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path), str(tmp_path / "out.pt")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert got["ids"][0].tolist() == list(b"def f(x):\n    return x")  # the training tokenizer's ids
    assert got["eos"] == (256, 256)
    model = model_from_config(cfg, 257)
    model.load_state_dict(read_checkpoint(tmp_path / "checkpoint.pt")["model"])
    with torch.no_grad():
        torch.testing.assert_close(got["logits"], model(input_ids=got["ids"], use_cache=False).logits)


def test_bpe_tokenizer_keeps_its_ids(tmp_path):
    from loglinear.data.tokenizer import train_bpe

    bpe = train_bpe(["def f(x): return x\n" * 50, "class A: pass\n" * 50], 300)
    bpe.save(tmp_path / "tokenizer.json")
    hf = hf_tokenizer(tmp_path / "tokenizer.json")
    text = "def g(y): return y\nclass B: pass"
    assert hf(text).input_ids == bpe.encode(text) and hf.eos_token_id == bpe.eos_id
