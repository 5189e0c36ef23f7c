"""Which model class serves which Hugging Face architecture name."""

from __future__ import annotations

from torch import nn

from braid.errors import UserError
from braid.loader.model_config import ModelConfig
from braid.models.config_fields import check_config_fields
from braid.models.deepseek_v2 import DeepseekV2ForCausalLM
from braid.models.gemma3 import Gemma3ForCausalLM
from braid.models.llama import LlamaForCausalLM
from braid.models.mistral import MistralForCausalLM, MixtralForCausalLM
from braid.models.phi3 import Phi3ForCausalLM
from braid.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The class for `config.architecture`, or a `UserError` listing what is supported or
    naming a config field whose value braid does not compute (`check_config_fields`)."""
    try:
        cls = MODELS[config.architecture]
    except KeyError:
        raise UserError(f"architecture {config.architecture!r} is not supported "
                        f"(supported: {', '.join(sorted(MODELS))})") from None
    check_config_fields(config.architecture, config.extra)
    return cls
