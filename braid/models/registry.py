"""Which model class serves which Hugging Face architecture name."""

from __future__ import annotations

from torch import nn

from braid.config import ModelConfig, UserError
from braid.models.deepseek_v2 import DeepseekV2ForCausalLM
from braid.models.llama import LlamaForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The class for `config.architecture`, or a `UserError` listing what is supported."""
    try:
        return MODELS[config.architecture]
    except KeyError:
        raise UserError(f"architecture {config.architecture!r} is not supported "
                        f"(supported: {', '.join(sorted(MODELS))})") from None
