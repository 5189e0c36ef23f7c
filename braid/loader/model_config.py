"""The `ModelConfig` of a checkpoint: a Hugging Face folder's `config.json`, or a GGUF file's
metadata turned into the same dict (`braid.loader.gguf.gguf_config`) and kept in braid's cache
(parsing the metadata takes seconds)."""

from __future__ import annotations

import json
from pathlib import Path

from braid.cache import cached
from braid.config import ModelConfig
from braid.errors import UserError

CONFIG_FILE = "config.json"


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
