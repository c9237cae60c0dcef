"""Step3p5ForCausalLM beside transformers' Step 3.7, whose text config answers to model_type ``step3p5`` too:
the bundled tiny-step3p5 loads as this package's model through stock and hf_specdec's AutoModelForCausalLM,
and after ``import hf_specdec`` transformers' Step 3.7 configs and classes still resolve as transformers' own."""

import subprocess
import sys

import pytest
import torch
import transformers

import hf_specdec
from hf_specdec.assets import asset_path
from hf_specdec.models.step3p5 import Step3p5Config, Step3p5ForCausalLM, step3p7

from .tiny_step3p5 import random_ids, real_config_dict, tiny_model

needs_step3p7 = pytest.mark.skipif(not step3p7.is_available(), reason="this transformers has no Step 3.7")


def test_tiny_asset_loads_through_stock_auto_model():
    model, info = transformers.AutoModelForCausalLM.from_pretrained(asset_path("tiny-step3p5"),
                                                                    output_loading_info=True)
    assert type(model) is Step3p5ForCausalLM and type(model.config) is Step3p5Config
    assert model.num_mtp_layers == 3
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_tiny_asset_loads_through_hf_specdec_auto_model():
    model = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-step3p5"))
    stock = transformers.AutoModelForCausalLM.from_pretrained(asset_path("tiny-step3p5"), dtype=torch.float32)
    assert type(model) is Step3p5ForCausalLM and model.dtype == torch.float32 and model.has_mtp
    ids = random_ids(batch=1)
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert hf_specdec.last_generation_stats(model) is not None  # enabled: the paged path ran
    assert torch.equal(out, stock.generate(ids, max_new_tokens=6, do_sample=False))


def test_stock_auto_model_in_a_fresh_interpreter_with_step3p7_imported_first():
    """No import order or cached mapping in this test process hides a registration conflict."""
    script = (
        "import importlib.util, transformers\n"
        "if importlib.util.find_spec('transformers.models.step3p7'):\n"
        "    import transformers.models.step3p7.modeling_step3p7\n"
        "    transformers.AutoConfig.for_model('step3p7')\n"
        "import hf_specdec\n"
        f"model = transformers.AutoModelForCausalLM.from_pretrained({str(asset_path('tiny-step3p5'))!r})\n"
        "print(type(model).__name__, model.num_mtp_layers)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["Step3p5ForCausalLM", "3"]


@needs_step3p7
def test_step3p7_checkpoint_loads_as_transformers_classes(tmp_path):
    from transformers import Step3p7Config, Step3p7ForConditionalGeneration, Step3p7TextConfig
    from transformers.models.step3p7.modeling_step3p7 import Step3p7TextModel

    text = {"model_type": "step3p5", **{k: v for k, v in real_config_dict().items() if k != "model_type"}}
    config = Step3p7Config(text_config=text, vision_config=step3p7.MINIMAL_VISION_CONFIG)
    assert type(config.text_config) is Step3p7TextConfig
    step3p7.save_as_step3p7(tiny_model(), tmp_path)
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is Step3p7Config and type(loaded.text_config) is Step3p7TextConfig
    model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path)
    assert type(model) is Step3p7ForConditionalGeneration
    assert type(model.model.language_model) is Step3p7TextModel


@needs_step3p7
def test_config_json_written_by_step3p7_text_config_stays_transformers(tmp_path):
    from transformers import Step3p7TextConfig

    Step3p7TextConfig(num_hidden_layers=4, hidden_size=32, n_routed_experts=4, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16).save_pretrained(tmp_path)
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is Step3p7TextConfig and loaded.n_routed_experts == 4
    assert type(Step3p5Config.from_dict(loaded.to_dict())) is Step3p7TextConfig
    ours = Step3p5Config.from_dict(real_config_dict())
    assert type(ours) is Step3p5Config and ours.moe_num_experts == 3
