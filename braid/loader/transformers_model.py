"""The same checkpoint through Hugging Face transformers: the reference engine of
`bench-one-batch --backend hf` and `eval-mmlu --backend hf`."""

from __future__ import annotations

from pathlib import Path

import torch


def load_transformers_model(model: str, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' causal LM of a GGUF file (which transformers dequantizes) or a folder, in
    eval mode, its logging and progress bars quiet."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = Path(model)
    kwargs = {"gguf_file": path.name} if path.is_file() else {}
    folder = str(path.parent) if path.is_file() else str(path)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).eval()
