"""fla checkpoints: GatedDeltaNetForCausalLM converts into our plain Gated DeltaNet with the same logits as fla's own
model (run here: fla's kernels under TRITON_INTERPRET=1 on the CPU, its one-token-at-a-time path for T <= 64), or
into a log-linear one at lambda = 1 exactly; fla's Mamba2ForCausalLM (transformers' weight names, its own config
names) into our Mamba-2; blocks ours cannot express are refused, naming the field."""

import json

import pytest
import torch
import triton.runtime.autotuner as autotuner
from transformers import AutoModelForCausalLM

from helpers import relative_error, save_perturbed

import loglinear  # noqa: F401  (registers our model types with the Auto classes)
from loglinear.cli import main
from loglinear.models.convert import convert_fla_gated_deltanet

fla_models = pytest.importorskip("fla.models", reason="flash-linear-attention is in the test extra")


@pytest.fixture(autouse=True)
def one_config(monkeypatch):
    """fla's autotuned kernels under the interpreter: the first config (autotuning would time kernels on a GPU)."""
    if torch.cuda.is_available():
        return
    run = autotuner.Autotuner.run

    def first_config(self, *args, **kwargs):
        self.configs = self.configs[:1]
        return run(self, *args, **kwargs)

    monkeypatch.setattr(autotuner.Autotuner, "run", first_config)


def fla_gated_deltanet(path, seed=0, **overrides):
    """A tiny random fla GatedDeltaNetForCausalLM (weights perturbed off their init) saved to path."""
    torch.manual_seed(seed)
    fields = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, expand_v=2.0,
                  fuse_cross_entropy=False)
    return save_perturbed(fla_models.GatedDeltaNetForCausalLM(fla_models.GatedDeltaNetConfig(**fields | overrides)),
                          path)


def test_converted_models_give_fla_logits(tmp_path):
    """Plain and log-linear conversions of one fla model (tied embeddings, a 3-tap conv, 4 heads, expand_v 1, its
    own MLP width) against fla's logits (fla runs once: slow under the interpreter)."""
    fla = fla_gated_deltanet(tmp_path / "src", tie_word_embeddings=True, conv_size=3, num_heads=4, head_dim=16,
                             expand_v=1.0, intermediate_size=96)
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "plain")]) == 0
    convert_fla_gated_deltanet(tmp_path / "src", tmp_path / "ll", log_linear=True)
    ids = torch.randint(0, 97, (2, 13))
    with torch.no_grad():
        expected = fla(ids).logits.float()
    for name, log_linear in (("plain", False), ("ll", True)):
        ours = AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        assert type(ours).__name__ == "LogLinearGatedDeltaNetForCausalLM"
        assert ours.config.use_log_linear is log_linear and ours.config.tie_word_embeddings
        with torch.no_grad():
            assert relative_error(expected, ours(ids).logits.float()) <= 1e-5, name


@pytest.mark.parametrize("overrides,message", [
    (dict(num_v_heads=4), "cannot convert num_v_heads = 4"),
    (dict(use_gate=False), "cannot convert use_gate = False"),
    (dict(use_short_conv=False), "cannot convert use_short_conv = False"),
    (dict(allow_neg_eigval=True), "cannot convert allow_neg_eigval = True"),
    (dict(attn={"layers": [1], "num_heads": 2}), "cannot convert attn = "),
    (dict(output_gate_activation="sigmoid"), "cannot convert output_gate_activation = 'sigmoid'"),
])
def test_blocks_ours_cannot_express_are_refused(tmp_path, overrides, message):
    (tmp_path / "src").mkdir()
    config = dict(model_type="gated_deltanet", vocab_size=97, hidden_size=64, num_hidden_layers=1, num_heads=2,
                  head_dim=32)
    (tmp_path / "src" / "config.json").write_text(json.dumps(config | overrides))
    with pytest.raises(ValueError) as error:
        convert_fla_gated_deltanet(tmp_path / "src", tmp_path / "dst")
    assert str(error.value).startswith(message)
    assert not (tmp_path / "dst").exists()


def test_conv_biases_have_no_place_in_ours(tmp_path):
    from safetensors.torch import load_file, save_file

    fla_gated_deltanet(tmp_path / "src", num_hidden_layers=1)
    weights = load_file(tmp_path / "src" / "model.safetensors")
    weights["model.layers.0.attn.q_conv1d.bias"] = torch.zeros(64)
    save_file(weights, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected: model.layers.0.attn.q_conv1d.bias"):
        convert_fla_gated_deltanet(tmp_path / "src", tmp_path / "dst")


def test_fla_mamba2_converts_with_its_own_config_names(tmp_path):
    """fla's norm_eps (here not transformers' default) and dt_* fields are read, not left at transformers' defaults.
    One q/k group: fla's CPU path tiles groups over heads (h % G) where its GPU kernels and ours use h // (H / G)."""
    torch.manual_seed(3)
    config = fla_models.Mamba2Config(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8,
                                     state_size=16, n_groups=1, chunk_size=8, norm_eps=1e-6, fuse_cross_entropy=False)
    fla = save_perturbed(fla_models.Mamba2ForCausalLM(config), tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert ours.config.norm_eps == 1e-6
    ids = torch.randint(0, 97, (2, 21))
    with torch.no_grad():
        assert relative_error(fla(ids).logits.float(), ours(ids).logits.float()) <= 1e-5


@pytest.mark.parametrize("field,value,message", [
    ("D_has_hdim", True, "cannot convert D_has_hdim = True"),
    ("rmsnorm", False, "cannot convert rmsnorm = False"),
    ("norm_before_gate", True, "cannot convert norm_before_gate = True"),
])
def test_fla_mamba2_blocks_ours_cannot_express_are_refused(tmp_path, field, value, message):
    from loglinear.models.convert import convert_mamba2

    (tmp_path / "src").mkdir()
    config = dict(model_type="mamba2", vocab_size=97, hidden_size=32, num_hidden_layers=1, num_heads=8, head_dim=8,
                  n_groups=1, norm_eps=1e-5, **{field: value})
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        convert_mamba2(tmp_path / "src", tmp_path / "dst")
    assert str(error.value).startswith(message)


@pytest.fixture
def fla_log_linear_on_cpu(monkeypatch):
    """fla's log-linear Mamba-2 layer runs only on CUDA: on the CPU its eval path, with fla's own quadratic
    reference of the log-linear op (float64) in place of its Triton op."""
    import fla.layers.log_linear_mamba2 as layer
    from fla.ops.log_linear_attn.naive import naive_log_linear_attn

    def naive(q, k, v, g, level_scales, scale=1.0, **_):
        args = (t.double() for t in (q, k, v, g, level_scales))
        return naive_log_linear_attn(*args, scale).to(v.dtype), None

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False, **_):
        return self.cuda_kernels_forward(hidden_states, None, False, attention_mask)[0], None, past_key_values

    if not torch.cuda.is_available():
        monkeypatch.setattr(layer, "chunk_log_linear_attn", naive)
        monkeypatch.setattr(layer.LogLinearMamba2, "forward", forward)


def test_fla_log_linear_mamba2_converts_to_ours(tmp_path, fla_log_linear_on_cpu):
    """fla's level weights softplus(L * (W x)) over its 15 levels, W in the last rows of its in_proj, two q/k groups
    (its log-linear path maps heads to groups as ours does), tied embeddings."""
    torch.manual_seed(4)
    config = fla_models.LogLinearMamba2Config(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_heads=8,
                                              head_dim=8, state_size=16, n_groups=2, tie_word_embeddings=True,
                                              fuse_cross_entropy=False)
    fla = save_perturbed(fla_models.LogLinearMamba2ForCausalLM(config), tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert ours.config.use_log_linear and ours.config.max_levels == 15 and ours.config.norm_groups == 2
    ids = torch.randint(0, 97, (2, 21))
    with torch.no_grad():
        assert relative_error(fla(ids).logits.float(), ours(ids).logits.float()) <= 1e-5


@pytest.mark.parametrize("field,value,message", [
    ("dt_limit", [0.0, 0.5], "cannot convert dt_limit = [0.0, 0.5]"),
    ("D_has_hdim", True, "cannot convert D_has_hdim = True"),
    ("use_bias", True, "cannot convert use_bias = True"),
    ("attnres_block_size", 2, "cannot convert attnres_block_size = 2"),
])
def test_fla_log_linear_mamba2_blocks_ours_cannot_express_are_refused(field, value, message):
    from loglinear.models.convert_fla import log_linear_mamba2_config

    raw = dict(model_type="log_linear_mamba2", vocab_size=97, hidden_size=32, num_hidden_layers=1, num_heads=8,
               head_dim=8, state_size=16, **{field: value})
    with pytest.raises(ValueError) as error:
        log_linear_mamba2_config(raw, 15)
    assert str(error.value).startswith(message)
