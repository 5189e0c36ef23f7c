"""What braid knows about a model family, in one place.

Each family module (`braid.models.llama`, `qwen`, ...) ends with `FAMILY`, the `Architecture`s it
serves: the model class, the strict classification of the Hugging Face config's fields, how
llama.cpp writes it as a GGUF file (`GGUFMapping`) and how `braid make-random-model` writes a
random checkpoint of it (`RandomModel`). `braid.models.registry` builds its lookups from the
family modules it lists; the generic code reads them there: the config check
(`braid.models.config_fields`), GGUF reading (`braid.loader.gguf_families`) and the random
checkpoints (`braid.random_model`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from braid.models.config_fields import Rule


@dataclass(frozen=True)
class GGUFFile:
    """What a family's GGUF config hook reads of a file."""

    # A metadata value by `gguf.Keys` template: get(key, default=None).
    get: Callable[..., Any]
    # Every tensor's shape (PyTorch order) by GGUF name ("blk.0.attn_q.bias").
    shapes: Mapping[str, tuple[int, ...]]
    # A small tensor's values (Phi-3's rope factors).
    values: Callable[[str], list[float]]


# Completes the `config.json` dict read from a GGUF file's common metadata
# (`braid.loader.gguf_families.config_dict`) with the family's own fields, in place.
GGUFConfigHook = Callable[[dict, GGUFFile], None]


@dataclass(frozen=True)
class GGUFMapping:
    """How llama.cpp's converter (`convert_hf_to_gguf.py`) writes an architecture as a GGUF
    file, so that reading undoes it. A hook reads metadata keys through `gguf.Keys`, imported
    inside it: rank processes, which load the family modules, never import the `gguf`
    package."""

    arch: str  # `general.architecture`
    config: GGUFConfigHook
    # Where families share a GGUF architecture (Mixtral is written as `llama` with experts):
    # whether this one's files have experts (`expert_count` > 0). None: any file of `arch`.
    experts: bool | None = None
    # Q/K rows interleaved per head for llama.cpp's "normal" rotary (LlamaModel.permute); the
    # other architectures rotate NeoX-style and are stored as Hugging Face stores them.
    rotary_permuted: bool = False
    # Added to every `*norm.weight` by the converter (Gemma's `1 + w` folded in).
    norm_offset: float = 0.0
    # transformers' module holding the feed-forward, and its experts' projection names.
    ffn_module: str = "mlp"
    expert_leaf: str = r"\w+_proj"
    # Tensors that hold config values, not weights (read by `config`, never loaded).
    config_tensors: tuple[str, ...] = ()


@dataclass(frozen=True)
class RandomModel:
    """How `braid make-random-model --arch NAME` writes a random-weight checkpoint."""

    name: str  # the `--arch` name
    # Preset ("tiny", "bench") -> the arguments of the architecture's transformers config
    # class (`transformers`), or else the `config.json` entries beyond the common ones.
    presets: Mapping[str, dict]
    # Built with transformers' own config and model classes and saved by `save_pretrained`;
    # else written by braid from `presets` (DeepSeek, Llama).
    transformers: bool = True
    # The chat template written into the tokenizer, in the family's own turn format (the
    # embedded tokenizer's own is ChatML). Text is emitted by expressions only: transformers
    # renders templates with trim_blocks.
    chat_template: str | None = None
    # Norm weights are drawn near this: 0 for norms that scale by 1 + w (Gemma).
    norm_center: float = 1.0
    # The model scales its embeddings up by sqrt(hidden) (Gemma): they are drawn with the
    # LM head's std 1/sqrt(hidden), as tied ones are, to keep the residual stream of order one.
    scaled_embedding: bool = False


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture braid serves (a `config.json`'s `architectures[0]`)."""

    name: str  # "Qwen3ForCausalLM"
    model: type[nn.Module]
    model_type: str  # config.json's `model_type`
    hf_config_class: str  # transformers' config class ("Qwen3Config")
    # Every field of `hf_config_class`, and the older or remote-code keys checkpoints carry,
    # classified by what braid does with it (`braid.models.config_fields`).
    fields: Mapping[str, Rule]
    gguf: GGUFMapping | None = None  # None: braid reads no GGUF file of it
    random: RandomModel | None = None  # None: no `make-random-model` preset


# Building blocks of the random presets. SmolLM2's heads at head dim 16 (the decode operator's
# smallest): 9 query and 3 KV heads split unevenly at tp 2 (a KV head's group across ranks) and
# tp 3; 256 MLP columns split unevenly at tp 3. Every tiny preset built with transformers'
# classes starts from it.
TINY = dict(hidden_size=144, intermediate_size=256, num_attention_heads=9, num_key_value_heads=3,
            max_position_embeddings=2048)
# Bench presets take the widths of a ~1B model of the family (or of its smallest) at 4 layers,
# with the family's rotary bases.
BENCH = dict(max_position_embeddings=8192)
# Sliding window of the tiny presets: shorter than the test prompts plus their generations, so
# windowed layers see a different set of keys than full ones.
TINY_WINDOW = 48
