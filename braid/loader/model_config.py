"""What a checkpoint is (`ModelConfig`), read from a Hugging Face folder's `config.json`, or from
a GGUF file's metadata turned into the same dict (`braid.loader.gguf.gguf_config`) and kept in
braid's cache (parsing the metadata takes seconds)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from braid.cache import cached
from braid.errors import UserError

CONFIG_FILE = "config.json"


def rope_kind(scaling: dict | None) -> str:
    """The scaling type of a Hugging Face `rope_scaling` / `rope_parameters` dict (the key is
    `rope_type`, or `type` in older configs such as DeepSeek's)."""
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, from a Hugging Face `config.json` dict (a GGUF file's
    metadata arrives as one: `braid.loader.model_config`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def widest_activation(self) -> int:
        """Widest per-token tensor a collective carries: the hidden size, or DeepSeek's fused
        q_a/kv_a projection output when the DP linear all-gathers it."""
        latent = self.extra.get("kv_lora_rank")
        if latent is None:
            return self.hidden_size
        fused = (self.extra.get("q_lora_rank") or 0) + latent + self.extra["qk_rope_head_dim"]
        return max(self.hidden_size, fused)

    @staticmethod
    def from_hf_dict(cfg: dict) -> ModelConfig:
        """Build from the contents of a Hugging Face `config.json`."""
        archs = cfg.get("architectures") or [cfg.get("model_type", "unknown")]
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None and isinstance(rope_scaling, dict):
            rope_theta = rope_scaling.get("rope_theta")
        if isinstance(rope_scaling, dict) and rope_kind(rope_scaling) == "default":
            rope_scaling = None
        return ModelConfig(
            architecture=archs[0],
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
            eos_token_ids=eos_ids,
            extra=cfg,
        )


def check_model_path(model: str) -> None:
    """`UserError` unless `model` is a GGUF file or a folder with a `config.json`."""
    path = Path(model)
    if not path.exists():
        raise UserError(f"model path does not exist: {model}")
    if path.is_file() and path.suffix != ".gguf":
        raise UserError(f"{model} is a file but not a .gguf file; pass a GGUF file or a folder")
    if path.is_dir() and not (path / CONFIG_FILE).exists():
        raise UserError(f"{model} has no config.json; pass a Hugging Face model folder or GGUF")


def load_model_config(model: str, use_cache: bool = True) -> ModelConfig:
    """Config of a GGUF file or a Hugging Face folder; `UserError` naming what is wrong."""
    check_model_path(model)
    path = Path(model)
    if path.is_file():
        return ModelConfig.from_hf_dict(gguf_config_dict(path, use_cache))
    return ModelConfig.from_hf_dict(json.loads((path / CONFIG_FILE).read_text()))


def gguf_config_dict(path: str | Path, use_cache: bool = True) -> dict:
    """The Hugging Face config dict of a GGUF file, from braid's cache when it holds it."""
    from braid.loader.gguf import gguf_config  # imports the gguf package: only for GGUF files

    def build(folder: Path) -> None:
        (folder / CONFIG_FILE).write_text(json.dumps(gguf_config(str(path))))

    def load(folder: Path) -> dict:
        return json.loads((folder / CONFIG_FILE).read_text())

    config = cached(path, "config", build, load) if use_cache else None
    return config or gguf_config(str(path))
