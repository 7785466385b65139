"""A plain ``import loglinear`` registers the model types with transformers' Auto classes without importing
transformers: AutoConfig and AutoModelForCausalLM load a saved model in a fresh process, whichever of loglinear and
transformers is imported first (AutoTokenizer and pipeline on a trained run: tests/train/test_export.py)."""

import json
import subprocess
import sys

import pytest

from loglinear.models import LogLinearMamba2Config, LogLinearMamba2ForCausalLM
from loglinear.train.export import export_pretrained


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter; a failed registration (a RuntimeWarning of loglinear._auto) is an error."""
    return subprocess.run([sys.executable, "-W", "error::RuntimeWarning:loglinear._auto", "-c", code, *args],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny log-linear Mamba-2 LM with the byte tokenizer, saved as a Hugging Face model."""
    path = tmp_path_factory.mktemp("model")
    (path / "bytes.json").write_text(json.dumps({"type": "bytes"}))
    config = LogLinearMamba2Config(vocab_size=257, hidden_size=16, num_hidden_layers=1, num_heads=2, state_size=4,
                                   chunk_size=4)
    model = LogLinearMamba2ForCausalLM(config)
    export_pretrained(path, model, model.state_dict(), path / "bytes.json")
    return path


def test_import_loglinear_does_not_import_transformers():
    done = run_python("import sys, loglinear\n"
                      "assert 'loglinear' in sys.modules\n"
                      "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'loglinear'))\n"
                      "assert not any(m.startswith(('transformers', 'loglinear.models')) for m in loaded), loaded")
    assert done.returncode == 0, done.stderr[-3000:]


LOAD = """
import sys
{imports}
run = sys.argv[1]
config = AutoConfig.from_pretrained(run)
model = AutoModelForCausalLM.from_pretrained(run)
assert type(config).__module__ == "loglinear.models.configuration", type(config)
assert type(config).__name__ == "LogLinearMamba2Config", type(config)
assert type(model).__module__ == "loglinear.models.modeling", type(model)
assert type(model).__name__ == "LogLinearMamba2ForCausalLM", type(model)
assert not [f for f in sys.meta_path if type(f).__module__ == "loglinear._auto"], "the finder must go once done"
"""

ORDERS = {
    "loglinear first": "import loglinear\nfrom transformers import AutoConfig, AutoModelForCausalLM",
    # transformers.modeling_layers imports AutoModel at its top, before defining what loglinear.models needs
    "loglinear, then a transformers model": "import loglinear\nfrom transformers import LlamaForCausalLM\n"
                                            "from transformers import AutoConfig, AutoModelForCausalLM",
    "transformers package first": "import transformers\nimport loglinear\n"
                                  "from transformers import AutoConfig, AutoModelForCausalLM",
}


@pytest.mark.parametrize("order", ORDERS)
def test_auto_classes_load_the_model_after_import_loglinear(model_dir, order):
    done = run_python(LOAD.format(imports=ORDERS[order]), str(model_dir))
    assert done.returncode == 0, done.stderr[-3000:]


def test_auto_classes_load_the_model_when_transformers_came_first(model_dir):
    imports = "from transformers import AutoConfig, AutoModelForCausalLM\nimport loglinear"
    done = run_python(LOAD.format(imports=imports), str(model_dir))
    assert done.returncode == 0, done.stderr[-3000:]
