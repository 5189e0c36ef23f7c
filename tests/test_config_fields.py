"""The strict config check (braid.models.config_fields, with the tables of the families' specs):
every field of each supported architecture's transformers config class is classified, default
configs pass, and values braid does not compute are refused by name, through the registry as a
served folder would be."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from braid.errors import UserError
from braid.loader.model_config import load_model_config
from braid.models.config_fields import IMPLEMENTED, NEUTRAL, NO_EFFECT, check_config_fields
from braid.models.registry import ARCHITECTURES as SPECS
from braid.models.registry import model_class

ARCHITECTURES = sorted(SPECS)
# Small shapes, so a written config.json stays short (layer_types has one entry per layer).
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def hf_config(architecture: str, **changes) -> dict:
    """`config.json` of a small model of this architecture, as transformers writes it, with
    `changes` applied to the written dict (as a checkpoint's own file would carry them)."""
    cls = getattr(transformers, SPECS[architecture].hf_config_class)
    shapes = dict(SMALL)
    if architecture.startswith("Deepseek"):
        shapes.update(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None,
                      qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                      n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    config = cls(**shapes).to_dict()
    config["architectures"] = [architecture]
    config.update(changes)
    return config


def check_through_registry(architecture: str, config: dict, folder: Path) -> None:
    """Load `config` as a served folder's config.json and look its model class up (where the
    check runs)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    model_class(load_model_config(str(folder)))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_every_field_of_the_config_class_is_classified(architecture):
    cls = getattr(transformers, SPECS[architecture].hf_config_class)
    unclassified = sorted(set(cls().to_dict()) - set(SPECS[architecture].fields))
    assert not unclassified, (f"{cls.__name__} fields braid has not classified (implemented, "
                              f"no effect or neutral only): {unclassified}")
    assert {rule.kind for rule in SPECS[architecture].fields.values()} <= {
        IMPLEMENTED, NO_EFFECT, NEUTRAL}


def test_every_served_architecture_is_classified():
    """Each spec names itself, classifies fields and names a transformers config class."""
    for name, spec in SPECS.items():
        assert spec.name == name and spec.fields, name
        assert hasattr(transformers, spec.hf_config_class), spec.hf_config_class


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_default_configs_pass(architecture, tmp_path):
    cls = getattr(transformers, SPECS[architecture].hf_config_class)
    check_config_fields(architecture, cls().to_dict())
    check_through_registry(architecture, hf_config(architecture), tmp_path)


@pytest.mark.parametrize("architecture, changes", [
    # Llama 3.1's rotary, written the pre-transformers-5 way
    ("LlamaForCausalLM", dict(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192))),
    ("LlamaForCausalLM", dict(quantization_config=None, partial_rotary_factor=1.0,
                              mlp_bias=False, pretraining_tp=4, attention_bias=True)),
    # keys no class defines and that change nothing are ignored
    ("LlamaForCausalLM", dict(unsloth_version="x", max_length=20)),
    ("MistralForCausalLM", dict(sliding_window=4096)),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=4096, max_window_layers=1,
                              layer_types=["full_attention", "sliding_attention"],
                              rope_scaling=dict(type="yarn", factor=4.0,
                                                original_max_position_embeddings=32768))),
    ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, max_window_layers=1,
                                 mlp_only_layers=[0])),
    ("MixtralForCausalLM", dict(router_jitter_noise=0.1)),
    # AutoAWQ's and GPTQ's usual configs (braid.loader.awq_gptq)
    ("LlamaForCausalLM", dict(quantization_config=dict(
        quant_method="awq", bits=4, group_size=128, zero_point=True, version="gemm",
        modules_to_not_convert=None))),
    ("Qwen2ForCausalLM", dict(quantization_config=dict(
        quant_method="gptq", bits=8, group_size=128, desc_act=True, sym=True,
        checkpoint_format="gptq"))),
    ("Gemma3ForCausalLM", dict(rope_local_base_freq=10000.0, sliding_window_pattern=2,
                               rope_scaling=dict(rope_type="linear", factor=8.0))),
    ("Phi3ForCausalLM", dict(rope_scaling=dict(type="su", short_factor=[1.0] * 8,
                                               long_factor=[2.0] * 8))),
    ("DeepseekV2ForCausalLM", dict(moe_layer_freq=1, scoring_func="softmax", ep_size=1,
                                   aux_loss_alpha=0.001, seq_aux=True)),
    ("DeepseekV3ForCausalLM", dict(quantization_config={}, num_nextn_predict_layers=1,
                                   topk_method="noaux_tc")),
])
def test_implemented_and_neutral_values_pass(architecture, changes, tmp_path):
    check_through_registry(architecture, hf_config(architecture, **changes), tmp_path)


FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("architecture, changes, field, value", [
    ("LlamaForCausalLM", dict(mlp_bias=True), "mlp_bias", "True"),
    ("LlamaForCausalLM", dict(hidden_act="gelu"), "hidden_act", "'gelu'"),
    ("LlamaForCausalLM", dict(rope_scaling=dict(type="dynamic", factor=2.0)),
     "rope_scaling.type", "'dynamic'"),
    ("LlamaForCausalLM", dict(rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                   partial_rotary_factor=0.5)),
     "rope_parameters.partial_rotary_factor", "0.5"),
    ("LlamaForCausalLM", dict(partial_rotary_factor=0.75), "partial_rotary_factor", "0.75"),
    ("MistralForCausalLM", dict(quantization_config=FP8), "quantization_config.quant_method",
     "'fp8'"),
    ("Qwen2ForCausalLM", dict(layer_types=["full_attention", "chunked_attention"]),
     "layer_types", "'chunked_attention'"),
    ("Qwen3MoeForCausalLM", dict(hidden_act="relu"), "hidden_act", "'relu'"),
    ("Gemma3ForCausalLM", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping", "50.0"),
    ("Gemma3ForCausalLM", dict(final_logit_softcapping=30.0), "final_logit_softcapping",
     "30.0"),
    ("Gemma3ForCausalLM", dict(use_bidirectional_attention=True),
     "use_bidirectional_attention", "True"),
    ("Gemma3ForCausalLM", dict(hidden_activation="gelu"), "hidden_activation", "'gelu'"),
    ("Gemma3ForCausalLM", dict(rope_parameters={
        "sliding_attention": dict(rope_type="default", rope_theta=1e4),
        "full_attention": dict(rope_type="dynamic", rope_theta=1e6, factor=2.0)}),
     "rope_parameters.full_attention.rope_type", "'dynamic'"),
    # transformers reads a Phi-3 "yarn" as LongRoPE: YaRN would compute something else
    ("Phi3ForCausalLM", dict(rope_scaling=dict(type="yarn", factor=2.0)),
     "rope_scaling.type", "'yarn'"),
    ("Phi3ForCausalLM", dict(rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                  partial_rotary_factor=0.75)),
     "rope_parameters.partial_rotary_factor", "0.75"),
    ("MixtralForCausalLM", dict(hidden_act="gelu"), "hidden_act", "'gelu'"),
    ("DeepseekV2ForCausalLM", dict(moe_layer_freq=2), "moe_layer_freq", "2"),
    ("DeepseekV2ForCausalLM", dict(mlp_bias=True), "mlp_bias", "True"),
    ("DeepseekV3ForCausalLM", dict(quantization_config=FP8), "quantization_config.quant_method",
     "'fp8'"),
    ("LlamaForCausalLM", dict(quantization_config=dict(quant_method="awq", bits=4,
                                                       version="gemv")),
     "quantization_config.version", "'gemv'"),
    ("Qwen2ForCausalLM", dict(quantization_config=dict(quant_method="gptq", bits=3)),
     "quantization_config.bits", "3"),
])
def test_unimplemented_values_are_refused_by_name(architecture, changes, field, value,
                                                  tmp_path):
    with pytest.raises(UserError) as error:
        check_through_registry(architecture, hf_config(architecture, **changes), tmp_path)
    message = str(error.value)
    assert message.startswith(f"{architecture}: config field {field!r} = ")
    assert value in message and "braid does not implement it" in message


def test_neutral_booleans_are_not_numbers():
    """`mlp_bias: 1` is a bias, not False; `moe_layer_freq: true` is not 1."""
    with pytest.raises(UserError, match="mlp_bias"):
        check_config_fields("LlamaForCausalLM", {"mlp_bias": 1})
    with pytest.raises(UserError, match="moe_layer_freq"):
        check_config_fields("DeepseekV2ForCausalLM", {"moe_layer_freq": True})
