"""The model's Hugging Face tokenizer, from a GGUF file's metadata or a model folder."""

from __future__ import annotations

import logging
from importlib.metadata import version
from pathlib import Path

from braid.cache import cached
from braid.config import ModelConfig, UserError


def load_tokenizer(model: str, use_cache: bool = True):
    """A `transformers` tokenizer that tokenizes exactly as the model's own (`tokenizer(text)`).

    A GGUF file's vocabulary is converted once and kept in braid's cache (the conversion takes
    seconds at every launch otherwise).
    """
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    path = Path(model)
    if not path.is_file():
        return AutoTokenizer.from_pretrained(str(path))

    def convert():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    def build(folder: Path) -> None:
        convert().save_pretrained(str(folder))

    def load(folder: Path):
        return AutoTokenizer.from_pretrained(str(folder))

    # The conversion is transformers' code: a different version gets an entry of its own.
    variant = f"transformers-{version('transformers')}"
    tokenizer = cached(path, "tokenizer", build, load, variant) if use_cache else None
    return tokenizer or convert()


def eos_token_ids(model_config: ModelConfig, tokenizer) -> frozenset[int]:
    """End-of-sequence ids: the checkpoint's and the tokenizer's."""
    eos = set(model_config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return frozenset(eos)


def apply_chat_template(tokenizer, prompt: str) -> list[int]:
    """Token ids of `prompt` as one user turn in the model's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("this model has no chat template; run without --chat")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
