"""GGUF files of every family braid reads, written from tiny random transformers checkpoints
the way llama.cpp's converter writes them (`gguf_writer.py`), read back through braid: the
config that matters and every tensor (whole, a rank's row slice, one expert's slice) must be
the folder's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import slow
from gguf import GGMLQuantizationType, GGUFWriter
from gguf_writer import write_gguf
from safetensors.torch import load_file

from braid.engine.request import SamplingParams
from braid.errors import UserError
from braid.frontend.llm import LLM
from braid.loader.gguf import gguf_config, iterate_gguf
from braid.loader.model_config import ModelConfig, load_model_config
from braid.models.config_fields import check_config_fields

# Exactly representable in float32, as GGUF stores it, so configs compare equal.
EPS = 2.0 ** -17
HEAD_DIM = 16
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=EPS,
              tie_word_embeddings=False)
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _configs() -> dict[str, tuple[str, dict]]:
    """Per family: the transformers config class and its small shapes (uneven enough that a
    wrong name, permutation or expert split cannot pass)."""
    return {
        "llama": ("LlamaConfig", dict(head_dim=HEAD_DIM, rope_parameters=DEFAULT_ROPE)),
        "mixtral": ("MixtralConfig", dict(head_dim=HEAD_DIM, num_local_experts=4,
                                          num_experts_per_tok=2,
                                          rope_parameters=DEFAULT_ROPE)),
        "qwen2": ("Qwen2Config", dict(rope_parameters={"rope_type": "default",
                                                        "rope_theta": 1000000.0})),
        "qwen3": ("Qwen3Config", dict(head_dim=HEAD_DIM, rope_parameters=DEFAULT_ROPE)),
        "qwen3moe": ("Qwen3MoeConfig", dict(head_dim=HEAD_DIM, num_experts=4,
                                             num_experts_per_tok=2, moe_intermediate_size=32,
                                             norm_topk_prob=True,
                                             rope_parameters=DEFAULT_ROPE)),
        # Six layers: five local, then a global one (Gemma 3's pattern); a linear-scaled
        # global rotary, as the 4B and larger models have.
        "gemma3": ("Gemma3TextConfig", dict(
            head_dim=HEAD_DIM, num_hidden_layers=6, sliding_window=32,
            query_pre_attn_scalar=HEAD_DIM, tie_word_embeddings=True,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 10000.0}})),
        "phi3": ("Phi3Config", dict(
            original_max_position_embeddings=64, sliding_window=48,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                             "long_factor": [1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0],
                             "short_factor": [1.0, 1.0, 1.125, 1.25, 1.25, 1.5, 1.5, 2.0]})),
    }


@dataclass(frozen=True)
class Tiny:
    """A tiny random checkpoint folder and the GGUF file written from it."""

    arch: str
    folder: Path
    gguf: Path
    config: dict
    tensors: dict[str, torch.Tensor]


def _randomize(model: torch.nn.Module) -> None:
    """Weights of std 1/sqrt(fan in); norms near their neutral value in multiples of 1/1024,
    so Gemma's converter's `w + 1` is exact in float32 and comes back bit for bit."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=generator) * p.shape[-1] ** -0.5)
            else:
                noise = torch.round(torch.randn(p.shape, generator=generator) * 100) / 1024
                p.copy_(noise + (1.0 if "norm" in name and "gemma" not in
                                 type(model).__name__.lower() else 0.0))


def _build(arch: str, tokenizer, root: Path) -> Tiny:
    import transformers

    class_name, shapes = _configs()[arch]
    special = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    config = getattr(transformers, class_name)(**{**COMMON, **special, **shapes})
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomize(model)
    folder = root / f"tiny-{arch}"
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    gguf = write_gguf(folder, root / f"tiny-{arch}.gguf")
    tensors = {}
    for file in folder.glob("*.safetensors"):
        tensors.update(load_file(str(file)))
    return Tiny(arch, folder, gguf, json.loads((folder / "config.json").read_text()), tensors)


@pytest.fixture(scope="session")
def tiny_models(tokenizer, tmp_path_factory):
    """`tiny_models(arch)`: one tiny checkpoint per family (SmolLM2's vocabulary and
    tokenizer) saved by transformers, and its GGUF, each built once a session."""
    root = tmp_path_factory.mktemp("gguf-families")
    built: dict[str, Tiny] = {}

    def get(arch: str) -> Tiny:
        if arch not in built:
            built[arch] = _build(arch, tokenizer, root)
        return built[arch]

    return get


@pytest.fixture(scope="session", params=list(_configs()))
def tiny(request, tiny_models) -> Tiny:
    return tiny_models(request.param)


def _rope_view(params: dict) -> dict:
    keys = ("rope_type", "rope_theta", "factor", "long_factor", "short_factor")
    return {**{k: params.get(k) for k in keys},
            "partial_rotary_factor": params.get("partial_rotary_factor", 1.0)}


# Fields that change the computation, beyond ModelConfig's own, per family.
MATTERS = {
    "llama": ["attention_bias", "mlp_bias"],
    "mixtral": ["num_local_experts", "num_experts_per_tok", "sliding_window"],
    "qwen2": ["layer_types", "use_sliding_window", "sliding_window"],
    "qwen3": ["layer_types", "use_sliding_window", "sliding_window", "attention_bias"],
    "qwen3moe": ["use_sliding_window", "sliding_window", "attention_bias", "num_local_experts",
                 "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                 "decoder_sparse_step", "mlp_only_layers"],
    "gemma3": ["layer_types", "sliding_window", "query_pre_attn_scalar", "hidden_activation",
               "final_logit_softcapping", "attn_logit_softcapping", "attention_bias"],
    "phi3": ["sliding_window", "original_max_position_embeddings", "hidden_act"],
}


def test_the_config_is_the_folders(tiny):
    from_gguf = gguf_config(str(tiny.gguf))
    assert ModelConfig.from_hf_dict(from_gguf) == ModelConfig.from_hf_dict(tiny.config)
    check_config_fields(from_gguf["architectures"][0], from_gguf)  # nothing braid refuses
    assert from_gguf["model_type"] == tiny.config["model_type"]
    for key in MATTERS[tiny.arch]:
        assert from_gguf[key] == tiny.config[key], key
    rope, expected = from_gguf["rope_parameters"], tiny.config["rope_parameters"]
    if tiny.arch == "gemma3":
        assert rope.keys() == expected.keys()
        for kind in rope:
            assert _rope_view(rope[kind]) == _rope_view(expected[kind]), kind
    else:
        assert _rope_view(rope) == _rope_view(expected)
    # through braid's cache (the second call loads the entry the first one built)
    assert load_model_config(str(tiny.gguf)) == ModelConfig.from_hf_dict(from_gguf)
    assert load_model_config(str(tiny.gguf)).extra == from_gguf


def _expected(tiny: Tiny) -> dict[str, torch.Tensor]:
    tied = tiny.config["tie_word_embeddings"]
    return {n: t for n, t in tiny.tensors.items() if not (tied and n == "lm_head.weight")}


def test_every_tensor_and_slice_is_the_folders(tiny):
    config = load_model_config(str(tiny.gguf))
    weights = dict(iterate_gguf(str(tiny.gguf), config))
    expected = _expected(tiny)
    assert sorted(weights) == sorted(expected)
    for name, weight in weights.items():
        assert weight.shape == tuple(expected[name].shape), name
        assert torch.equal(weight.load(), expected[name]), name
    d = HEAD_DIM
    attention = "model.layers.1.self_attn."
    fused = tiny.arch == "phi3"
    for proj in ["qkv_proj"] if fused else ["q_proj", "k_proj"]:
        name = f"{attention}{proj}.weight"  # one head, from the second: a rank's rows
        assert torch.equal(weights[name].narrow(0, d, d), expected[name][d:2 * d]), name
    name = f"{attention}o_proj.weight"  # a row-parallel rank's columns
    assert torch.equal(weights[name].narrow(1, d, 2 * d), expected[name][:, d:3 * d])
    experts = [n for n in weights if ".experts.1." in n and n.startswith("model.layers.1.")]
    assert len(experts) == (3 if tiny.arch in ("mixtral", "qwen3moe") else 0)
    for name in experts:  # one expert's rows and columns, as a rank reads them
        assert torch.equal(weights[name].narrow(0, 3, 5), expected[name][3:8]), name
        assert torch.equal(weights[name].narrow(1, 2, 9), expected[name][:, 2:11]), name


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_quantized_rows_dequantize_as_the_whole_tensor(arch, tiny_models, tmp_path):
    """Q8_0 matrices: a rank's slice of rows (permuted heads, one expert) is exactly those
    rows of the dequantized tensor, and the tensor is near the folder's."""
    tiny = tiny_models(arch)
    path = write_gguf(tiny.folder, tmp_path / "q8.gguf", GGMLQuantizationType.Q8_0)
    config = load_model_config(str(path), use_cache=False)
    weights = dict(iterate_gguf(str(path), config))
    expected = _expected(tiny)
    assert sorted(weights) == sorted(expected)
    for name, weight in weights.items():
        whole = weight.load()
        scale = expected[name].abs().amax(dim=-1, keepdim=True) / 127
        # half a step, and the step itself rounded to float16
        assert (whole - expected[name]).abs().le(scale * 0.6 + 1e-7).all(), name
        if whole.ndim == 2 and whole.shape[0] >= 2 * HEAD_DIM:
            assert torch.equal(weight.narrow(0, HEAD_DIM, HEAD_DIM),
                               whole[HEAD_DIM:2 * HEAD_DIM]), name


@pytest.mark.parametrize("arch", [slow("llama"), slow("mixtral"), slow("qwen2"), slow("qwen3"),
                                  slow("qwen3moe"), slow("gemma3"), slow("phi3")])
def test_the_gguf_generates_what_the_folder_does(arch, tiny_models, prompt_ids):
    """Through braid's engine at tp 2: the same greedy tokens, and prompt logits, from the
    GGUF file as from the folder it was written from."""
    tiny = tiny_models(arch)
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    prompts = prompt_ids[:2]
    results = []
    for model in (tiny.folder, tiny.gguf):
        with LLM(str(model), tp=2, dtype="fp32") as llm:
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            results.append((tokens, llm.prompt_logits(prompts)))
    (folder_tokens, folder_logits), (gguf_tokens, gguf_logits) = results
    assert gguf_tokens == folder_tokens
    for a, b in zip(gguf_logits, folder_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1],
                         ids=lambda q: q.name)
def test_a_5_bit_gguf_decodes_as_transformers_on_its_weights(qtype, tiny_models, prompt_ids,
                                                               tmp_path):
    """The tiny llama written in Q5_0 or Q5_1 (every matrix), bf16 at tp 1: its weights stay
    blocks, interleaved for the int8 kernel where the CPU has one (llama.cpp's arithmetic, its
    inputs rounded to int8). Fed the same tokens, transformers' fp32 model on the file's
    dequantized weights ranks each greedy token within LOGIT_MARGIN of its best."""
    from test_ggml_blocks import check_shortfalls
    from transformers import AutoModelForCausalLM

    path = write_gguf(tiny_models("llama").folder, tmp_path / "q5.gguf", qtype)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                     dtype=torch.float32).eval()
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    with LLM(str(path), tp=1, dtype="bf16") as llm:
        (ready,) = llm.core.executor.readies
        outputs = [llm.generate([ids], params)[0] for ids in prompt_ids]  # one row a step
    assert ready.weight_bytes < 0.3 * sum(p.numel() for p in reference.parameters()) * 4
    check_shortfalls(reference, prompt_ids, outputs)


def test_the_embedded_llama_config_is_unchanged(model_path):
    """The embedded SmolLM2 GGUF's config, as braid read it before GGUF went through the
    Hugging Face dict."""
    assert load_model_config(model_path, use_cache=False) == ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        rms_norm_eps=9.999999747378752e-06, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, rope_scaling=None, eos_token_ids=(2,))


def test_an_unknown_gguf_architecture_names_the_supported_ones(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UserError, match=r"'gpt2' is not supported \(supported: llama, qwen2, "
                                        r"qwen3, qwen3moe, gemma3, phi3\)"):
        load_model_config(str(path), use_cache=False)


@pytest.mark.slow  # converts a tokenizer of its own
def test_control_tokens_that_are_not_ascii_keep_their_ids(tiny_models, tmp_path):
    """DeepSeek-R1-Distill-Qwen's GGUF names its chat markers `<｜User｜>`...: transformers'
    conversion alone mangles such control tokens and appends the BOS and EOS past the
    vocabulary; braid's tokenizer keeps each whole at its id."""
    from transformers import AutoTokenizer

    from braid.loader.tokenizer import load_tokenizer

    renamed = {1: "<｜User｜>", 2: "<｜Assistant｜>"}  # SmolLM2's <|im_start|>, <|im_end|>
    path = write_gguf(tiny_models("llama").folder, tmp_path / "renamed.gguf",
                      renamed_tokens=renamed)
    converted = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert converted.encode("<｜User｜>", add_special_tokens=False) != [1]  # the bug guarded
    tokenizer = load_tokenizer(str(path), use_cache=False)
    text = "<｜User｜>Hello<｜Assistant｜>"
    assert tokenizer.encode(text, add_special_tokens=False) == [
        1, *tokenizer.encode("Hello", add_special_tokens=False), 2]
    assert tokenizer.eos_token_id == 2
    assert tokenizer.decode([1, 2]) == "<｜User｜><｜Assistant｜>"
    # the BOS and EOS (ids 1 and 2 here) the conversion appended past the vocabulary are gone
    assert len(tokenizer) == len(converted) - 2 == tokenizer.vocab_size


def test_the_embedded_tokenizer_splits_text_as_llama_cpp(tokenizer):
    """The file's pre-tokenizer ("smollm") splits digits one by one before GPT-2's pieces:
    the ids are llama.cpp's `llama-tokenize` on the same file (transformers' own conversion made
    two newline tokens of the "\\n\\n" before the 3)."""
    assert tokenizer("In 2024:\n\n3 apples, 12.5%\r\n")["input_ids"] == [
        788, 216, 34, 32, 34, 36, 42, 1116, 35, 13855, 28, 216, 33, 34, 30, 37, 21, 2738]
