"""The model's Hugging Face tokenizer, from a GGUF file's metadata or a model folder."""

from __future__ import annotations

import logging
from pathlib import Path

from braid.config import UserError


def load_tokenizer(model: str):
    """A `transformers` tokenizer that tokenizes exactly as the model's own (`tokenizer(text)`)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    path = Path(model)
    if path.is_file():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


def apply_chat_template(tokenizer, prompt: str) -> list[int]:
    """Token ids of `prompt` as one user turn in the model's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("this model has no chat template; run without --chat")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
