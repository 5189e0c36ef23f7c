"""The model's Hugging Face tokenizer, from a GGUF file's metadata or a model folder."""

from __future__ import annotations

import json
import logging
from importlib.metadata import version
from pathlib import Path

from braid.cache import cached
from braid.errors import UserError
from braid.loader.model_config import ModelConfig
from braid.platform import release_free_memory

# braid's corrections to transformers' GGUF tokenizer conversion; a change renames the cached
# conversions so that none made before it is loaded.
CONVERSION = "digits"
# llama.cpp's pre-tokenizers (`tokenizer.ggml.pre`) that split digits one by one before GPT-2's
# byte-level pattern (llama-vocab.cpp's STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE,
# MINERVA and MELLUM2 regexes)
DIGIT_SPLITTING = frozenset({"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                             "minerva-7b", "mellum2"})


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
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        release_free_memory()  # parsing's garbage: 35 MB of heap for Llama 3's vocabulary
        return tokenizer

    def convert():
        # not in rank processes: see test_launch
        from braid.loader.gguf import gguf_control_tokens, gguf_pre_tokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        split_digits(tokenizer, gguf_pre_tokenizer(str(path)))
        return restore_control_tokens(tokenizer, gguf_control_tokens(str(path)))

    def build(folder: Path) -> None:
        convert().save_pretrained(str(folder))

    def load(folder: Path):
        return AutoTokenizer.from_pretrained(str(folder))

    # The conversion is transformers' code and braid's corrections to it: a different version
    # of either gets an entry of its own.
    variant = f"{CONVERSION}-transformers-{version('transformers')}"
    tokenizer = cached(path, "tokenizer", build, load, variant) if use_cache else None
    tokenizer = tokenizer or convert()
    release_free_memory()  # parsing's garbage: 35 MB of heap for Llama 3's vocabulary
    return tokenizer


def split_digits(tokenizer, pre_tokenizer: str | None) -> None:
    """Split every digit off before the byte-level pieces where the file's vocabulary was
    learned that way (its `tokenizer.ggml.pre` is one of `DIGIT_SPLITTING`), as the original
    tokenizer and llama.cpp do. transformers' conversion knows none of these names and keeps
    GPT-2's pieces, which differ wherever a digit follows other characters: "\\n\\n3" became
    two newline tokens and a digit instead of one double-newline token and a digit."""
    if pre_tokenizer not in DIGIT_SPLITTING:
        return
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def restore_control_tokens(tokenizer, control: dict[int, tuple[str, bool]]):
    """`tokenizer` (converted from a GGUF file by transformers) with the file's control and
    user-defined tokens `control` (`gguf_control_tokens`) whole at their own ids.

    transformers' conversion of a byte-level BPE vocabulary maps every token through the
    byte-to-unicode table, so a token that is not ASCII (DeepSeek-R1-Distill-Qwen's
    `<｜User｜>`, `<｜begin▁of▁sentence｜>`) lands at its id under a mangled name and is not an
    added token: the chat template's markers then tokenize as several pieces and the BOS and
    EOS are appended as new ids past the model's vocabulary. Those tokens are renamed back and
    added at their ids; tokens the conversion kept are left as they are."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = state["model"].get("vocab")
    if not isinstance(vocab, dict):
        return tokenizer
    names = {i: name for name, i in vocab.items()}
    added = {entry["id"]: entry for entry in state["added_tokens"]}
    restored = {}
    for i, (text, special) in control.items():
        if names.get(i, text) == text or added.get(i, {}).get("content") == text:
            continue
        vocab.pop(names[i])
        vocab[text] = i
        restored[text] = i
        added[i] = {"id": i, "content": text, "single_word": False, "lstrip": False,
                    "rstrip": False, "normalized": False, "special": special}
    if not restored:
        return tokenizer
    # the same texts appended past the vocabulary by the conversion go
    state["added_tokens"] = sorted(
        (entry for i, entry in added.items() if restored.get(entry["content"], i) == i),
        key=lambda entry: entry["id"])
    from tokenizers import Tokenizer

    tokenizer._tokenizer = Tokenizer.from_str(json.dumps(state))
    return tokenizer


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
