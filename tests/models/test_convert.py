"""transformers Mamba2ForCausalLM checkpoints convert into the plain (use_log_linear=False) loglinear Mamba-2 with
the same logits, or into a log-linear one whose level weights start at exactly 1 (the same logits, then trainable);
structures our model cannot express, pickle weights and bad folders are refused with one clear message."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Mamba2Config, Mamba2ForCausalLM

from helpers import relative_error, save_perturbed

import loglinear  # noqa: F401  (registers our model types with the Auto classes)
from loglinear.cli import main
from loglinear.models import MODELS
from loglinear.models.convert import convert, convert_mamba2


def hf_mamba2(path, seed=0, **overrides):
    """A tiny random transformers Mamba2ForCausalLM (weights perturbed off their init) saved to path."""
    torch.manual_seed(seed)
    fields = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8, state_size=16,
                  n_groups=1, expand=2, conv_kernel=4, chunk_size=8, pad_token_id=0)
    return save_perturbed(Mamba2ForCausalLM(Mamba2Config(**fields | overrides)), path)


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(tie_word_embeddings=True, use_conv_bias=False),
    dict(hidden_size=64, num_heads=8, head_dim=16, state_size=8, conv_kernel=3, chunk_size=12,
         layer_norm_epsilon=1e-6),
    dict(n_groups=2),
    dict(n_groups=4, tie_word_embeddings=True),
], ids=["untied", "tied-no-conv-bias", "wide-chunk12", "groups2", "groups4-tied"])
def test_converted_model_gives_the_same_logits(tmp_path, overrides):
    hf = hf_mamba2(tmp_path / "src", **overrides)
    (tmp_path / "src" / "tokenizer.json").write_text('{"stand-in": true}')
    convert_mamba2(tmp_path / "src", tmp_path / "dst")
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert type(ours).__name__ == "LogLinearMamba2ForCausalLM"
    assert ours.config.use_log_linear is False and ours.config.intermediate_size == 0
    assert ours.config.n_groups == ours.config.norm_groups == overrides.get("n_groups", 1)
    assert (tmp_path / "dst" / "tokenizer.json").read_text() == '{"stand-in": true}'
    tied = ours.lm_head.weight.data_ptr() == ours.model.embeddings.weight.data_ptr()
    assert tied == bool(overrides.get("tie_word_embeddings"))
    ids = torch.randint(0, 97, (2, 21))  # 21: not a multiple of the chunk size
    with torch.no_grad():
        assert relative_error(hf(ids).logits, ours(ids).logits) <= 1e-5


def test_log_linear_conversion_starts_at_lambda_one_with_the_same_logits_and_then_learns_levels(tmp_path):
    hf = hf_mamba2(tmp_path / "src", seed=2)
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--log-linear"]) == 0
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert ours.config.use_log_linear is True and ours.config.level_activation == "sigmoid"
    ids = torch.randint(0, 97, (2, 21))
    for layer in ours.model.layers:
        lam = layer.mixer.level_scales(torch.randn(5, 32))
        assert torch.equal(lam, torch.ones_like(lam))  # exactly 1, not ~1
    with torch.no_grad():
        assert relative_error(hf(ids).logits, ours(ids).logits) <= 1e-5
    ours.train()
    ours(ids, labels=ids).loss.backward()
    assert all(layer.mixer.level_scales.proj.weight.grad.abs().sum() > 0 for layer in ours.model.layers)


def test_the_command_converts_and_keeps_the_source_dtype(tmp_path, capsys):
    hf = hf_mamba2(tmp_path / "src", seed=1).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    assert "converted" in capsys.readouterr().out
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype="auto")
    assert ours.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(ours.lm_head.weight, hf.lm_head.weight)


@pytest.mark.parametrize("overrides,message", [
    (dict(use_bias=True), "cannot convert use_bias = True"),
    (dict(time_step_limit=(0.0, 0.5)), "cannot convert time_step_limit = (0.0, 0.5)"),
    (dict(hidden_act="gelu"), "cannot convert hidden_act = 'gelu'"),
])
def test_structures_our_model_cannot_express_are_refused(tmp_path, overrides, message):
    fields = dict(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_heads=8, head_dim=8, n_groups=1)
    Mamba2Config(**fields | overrides).save_pretrained(tmp_path / "src")
    with pytest.raises(ValueError) as error:
        convert_mamba2(tmp_path / "src", tmp_path / "dst")
    assert str(error.value).startswith(message)
    assert not (tmp_path / "dst").exists()


def test_pickle_weights_and_bad_folders_are_refused(tmp_path, capsys):
    src = tmp_path / "src"
    Mamba2Config(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_heads=8, head_dim=8,
                 n_groups=1).save_pretrained(src)
    (src / "pytorch_model.bin").write_bytes(b"not to be unpickled")
    with pytest.raises(ValueError, match="pickle weights \\(pytorch_model.bin\\), which are not loaded"):
        convert_mamba2(src, tmp_path / "dst")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ValueError, match="is not an empty folder"):
        convert_mamba2(src, tmp_path / "full")
    (src / "config.json").write_text(json.dumps({"model_type": "mamba2", "hidden_size": 32, "num_heads": 3}))
    with pytest.raises(ValueError, match="invalid .*config.json: .*must equal num_heads \\* head_dim"):
        convert_mamba2(src, tmp_path / "dst")
    (src / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ValueError, match="model_type 'mamba'"):
        convert_mamba2(src, tmp_path / "dst")

    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "dst")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("loglinear convert: error: source folder") and len(err.splitlines()) == 1


@pytest.mark.parametrize("variant", ["mamba2", "gla"])
def test_a_plain_loglinear_model_becomes_log_linear_with_the_same_logits(tmp_path, variant):
    config_cls, _, lm_cls = MODELS[variant]
    torch.manual_seed(3)
    plain = lm_cls(config_cls(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_heads=2, chunk_size=8,
                              use_log_linear=False)).eval()
    plain.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="is a loglinear model already; --log-linear makes a plain one log-linear"):
        convert(tmp_path / "plain", tmp_path / "same")
    convert(tmp_path / "plain", tmp_path / "ll", log_linear=True)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ll").eval()
    assert ours.config.use_log_linear and ours.config.level_activation == "sigmoid"
    ids = torch.randint(0, 97, (2, 21))
    with torch.no_grad():
        assert relative_error(plain(ids).logits, ours(ids).logits) <= 1e-5
