"""`braid make-random-model` for the families built with transformers' own classes: each tiny
preset loads back into transformers with exactly its weights, computes finite logits that do
not collapse onto a few tokens, has the shapes and windows it promises, and carries a chat
template in its family's format that braid's tokenizer loading picks up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import slow
from safetensors import safe_open

from braid.cli import build_parser
from braid.errors import UserError
from braid.loader.tokenizer import apply_chat_template, load_tokenizer
from braid.models.config_fields import check_config_fields
from braid.models.registry import RANDOM_MODELS
from braid.random_model import (
    ARCHS,
    CHAT_TEMPLATES,
    COMMON_PRESETS,
    PRESETS,
    make_random_model,
    model_config,
    transformers_config,
    weight_shapes,
)

# The default suite builds the families whose tiny presets differ most (MoE with a dense layer,
# Gemma's norms and layer kinds, Phi-3's fused tensors); the others run in `make test-all`.
NEW_ARCHS = ["qwen3_moe", "gemma3", "phi3", slow("mistral"), slow("qwen2"), slow("qwen3"),
             slow("mixtral")]
FAMILY_ARCHS = ["gemma3", "mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen3_moe"]

# What each tiny preset promises (config.json as transformers writes it).
EXPECTED = {
    "mistral": dict(architectures=["MistralForCausalLM"], sliding_window=48, head_dim=16,
                    num_hidden_layers=2),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], sliding_window=48, use_sliding_window=True,
                  layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], head_dim=32, tie_word_embeddings=True),
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], head_dim=32, num_hidden_layers=3,
                      num_local_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      moe_intermediate_size=52, decoder_sparse_step=1, mlp_only_layers=[1]),
    "mixtral": dict(architectures=["MixtralForCausalLM"], num_local_experts=8,
                    num_experts_per_tok=2),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                   sliding_window=48, query_pre_attn_scalar=24, head_dim=16,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={
                       "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                       "full_attention": dict(rope_type="default", rope_theta=1e6)}),
    "phi3": dict(architectures=["Phi3ForCausalLM"], sliding_window=48),
}
# A tensor name of each family's checkpoint layout (hub names, per-expert MoE tensors).
EXPECTED_TENSOR = {
    "mistral": "model.layers.1.self_attn.k_proj.weight",
    "qwen2": "model.layers.0.self_attn.q_proj.bias",
    "qwen3": "model.layers.0.self_attn.k_norm.weight",
    "qwen3_moe": "model.layers.2.mlp.experts.7.gate_proj.weight",
    "mixtral": "model.layers.0.block_sparse_moe.experts.7.w3.weight",
    "gemma3": "model.layers.2.pre_feedforward_layernorm.weight",
    "phi3": "model.layers.0.self_attn.qkv_proj.weight",
}
# The turn markers each family's template writes around a system, user and assistant turn.
TURNS = {
    "mistral": ["[INST] Be brief.\n\nHi [/INST]Hello<|im_end|>[INST] Why? [/INST]"],
    "mixtral": ["[INST] Be brief.\n\nHi [/INST]Hello<|im_end|>[INST] Why? [/INST]"],
    "qwen2": ["<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
              "<|im_start|>assistant\n"],
    "qwen3": ["<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n"],
    "qwen3_moe": ["<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n"],
    "gemma3": ["<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
               "<start_of_turn>model\nHello<end_of_turn>\n", "<start_of_turn>model\n"],
    "phi3": ["<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>\n"
             "<|user|>\nWhy?<|end|>\n<|assistant|>\n"],
}
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Why?"}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer):
    """One tiny folder per family, built on first use and shared by the module's tests."""
    root = tmp_path_factory.mktemp("random-models")
    built: dict[str, Path] = {}

    def folder(arch: str) -> Path:
        if arch not in built:
            built[arch] = make_random_model(arch, "tiny", str(root / arch), tokenizer=tokenizer)
        return built[arch]

    return folder


@pytest.fixture(scope="module")
def prompt(tokenizer) -> torch.Tensor:
    """Longer than the 48-token windows, so windowed layers see fewer keys than full ones."""
    text = ("The tide came in over the flat sand while the gulls argued about the last of the "
            "fish; a boy with a red kite ran along the water, and his sister counted shells. ")
    return torch.tensor([tokenizer(text * 2)["input_ids"]])


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_tiny_preset_loads_into_transformers_and_computes(arch, folders, prompt):
    from transformers import AutoModelForCausalLM

    folder = folders(arch)
    model, info = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
    assert not any(info.values()), info  # missing, unexpected, mismatched keys, errors
    with torch.inference_mode():
        logits = model.eval()(prompt).logits[0]
    assert prompt.shape[1] > 48 and torch.isfinite(logits).all()
    predicted = logits.argmax(-1)
    # Not collapsed onto a few tokens, nor copying the input token at each position.
    assert len(set(predicted.tolist())) >= prompt.shape[1] // 4
    assert (predicted == prompt[0]).float().mean() < 0.2
    # The checkpoint's tensors are the drawn ones: loading reproduces them exactly.
    state = model.state_dict()
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for name in ("model.embed_tokens.weight", "model.norm.weight"):
            assert torch.equal(f.get_tensor(name), state[name])


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_tiny_preset_config_and_tensors(arch, folders, tokenizer):
    folder = folders(arch)
    config = json.loads((folder / "config.json").read_text())
    for key, value in EXPECTED[arch].items():
        assert config[key] == value, key
    assert config["vocab_size"] == len(tokenizer) == 49152
    assert (config["bos_token_id"], config["eos_token_id"]) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert (config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"]) == (144, 9, 3)
    check_config_fields(config["architectures"][0], config)  # braid serves what it writes
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert EXPECTED_TENSOR[arch] in names
        norms = [f.get_tensor(n) for n in names if n.endswith("norm.weight")]
        biases = [f.get_tensor(n) for n in names if n.endswith(".bias")]
        gate = next((f.get_tensor(n) for n in names if n.endswith(("mlp.gate.weight",
                                                                   "moe.gate.weight"))), None)
    # Gemma's norms scale by 1 + w: weights near 0; the others' near 1. Biases small.
    centre = 0.0 if arch == "gemma3" else 1.0
    weights = torch.cat([n.flatten() for n in norms])
    assert abs(weights.mean().item() - centre) < 0.02 and (weights - centre).abs().max() < 0.6
    assert all(b.abs().max() < 1.0 for b in biases)
    assert (arch == "qwen2") == bool(biases)
    if gate is not None:  # router rows with std 1/sqrt(hidden)
        assert gate.shape == (8, 144) and abs(gate.std().item() - 144 ** -0.5) < 0.01


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_chat_template_is_the_familys(arch, folders):
    """braid's tokenizer loading (as `braid serve --model FOLDER` does) gets the family's
    template, which renders a whole conversation and a generation prompt."""
    tokenizer = load_tokenizer(str(folders(arch)))
    assert tokenizer.chat_template == CHAT_TEMPLATES[arch]
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False,
                                         add_generation_prompt=True)
    for turns in TURNS[arch]:
        assert turns in text, text
    assert apply_chat_template(tokenizer, "Hi")  # `generate --chat`'s token ids


def test_templates_default_system_and_thinking():
    """Qwen2.5's default system prompt; Qwen3's empty thinking block on request."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    user = [{"role": "user", "content": "Hi"}]
    qwen2 = env.from_string(CHAT_TEMPLATES["qwen2"]).render(messages=user,
                                                            add_generation_prompt=True)
    assert qwen2.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    qwen3 = env.from_string(CHAT_TEMPLATES["qwen3"])
    assert qwen3.render(messages=user, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n")
    assert qwen3.render(messages=user, add_generation_prompt=True,
                        enable_thinking=False).endswith("assistant\n<think>\n\n</think>\n\n")
    mistral = env.from_string(CHAT_TEMPLATES["mistral"]).render(
        messages=user, bos_token="<s>", eos_token="</s>", add_generation_prompt=True)
    assert mistral == "<s>[INST] Hi [/INST]"


def test_the_same_seed_draws_the_same_weights(folders, tokenizer, tmp_path):
    again = make_random_model("phi3", "tiny", str(tmp_path / "again"), tokenizer=tokenizer)
    other = make_random_model("phi3", "tiny", str(tmp_path / "other"), seed=1,
                              tokenizer=tokenizer)
    name = "model.layers.1.mlp.gate_up_proj.weight"
    tensors = []
    for folder in (folders("phi3"), again, other):
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            tensors.append(f.get_tensor(name))
    assert torch.equal(tensors[0], tensors[1]) and not torch.equal(tensors[0], tensors[2])


def test_cli_offers_every_family(tmp_path):
    parser = build_parser()
    for arch in ARCHS:
        assert parser.parse_args(["make-random-model", "--arch", arch, "out"]).arch == arch
    assert set(FAMILY_ARCHS) | {"llama", "deepseek_v2", "deepseek_v3"} == set(ARCHS)
    assert set(CHAT_TEMPLATES) == set(FAMILY_ARCHS)
    with pytest.raises(UserError, match="--arch"):
        make_random_model("gemma2", "tiny", str(tmp_path / "x"))


def test_every_family_has_the_common_presets_and_others_are_refused_by_name():
    for arch in ARCHS:
        presets = list(RANDOM_MODELS[arch].random.presets)
        assert presets[:len(COMMON_PRESETS)] == COMMON_PRESETS, arch
        assert set(presets) <= set(PRESETS), arch
    with pytest.raises(UserError, match=r"--arch qwen3 has no preset '1b' \(its presets: tiny, "
                                        r"bench, 8b\)"):
        make_random_model("qwen3", "1b", "unused")


def test_the_real_shape_presets_are_llama_3s():
    """What `--preset 1b` writes, checked without writing it (2.5 GB): Llama-3.2-1B's config."""
    config = model_config("llama", "1b", 128256, None, None)
    assert {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "vocab_size",
                                   "tie_word_embeddings")} == {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "tie_word_embeddings": True}
    names = [name for name, _ in weight_shapes(config)]
    assert "lm_head.weight" not in names and len(names) == 2 + 16 * 9  # tied: no head


def test_the_qwen3_8b_preset_is_qwen3_8bs_shape(tokenizer):
    """What `--arch qwen3 --preset 8b` builds, checked on its transformers config (16 GB of
    weights otherwise): Qwen3-8B's widths, heads and vocabulary."""
    config = transformers_config("qwen3", "8b", tokenizer)
    assert {k: getattr(config, k) for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")} == {
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "tie_word_embeddings": False}
    assert config.rope_parameters["rope_theta"] == 1e6
