"""llguidance (braid's grammar library) and xgrammar side by side on this host, with the
embedded model's tokenizer: tokenizer conversion, compiling a JSON schema, filling one token
bitmask per step while a valid JSON text is fed token by token, and masking 32 rows of
logits. xgrammar is not a dependency of braid; install it to compare
(`pip install --no-deps xgrammar apache-tvm-ffi`: its own dependencies pull triton, which a
CPU never uses). Figures and the choice: docs/performance.md, "Structured outputs"."""

from __future__ import annotations

import json
import time

import numpy as np
import torch

from braid.config import default_model_path
from braid.engine.grammar import JSON_OPTIONS
from braid.loader.model_config import load_model_config
from braid.loader.tokenizer import load_tokenizer
from braid.worker.sampler import apply_grammar_mask

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags", "address"], "properties": {
              "name": {"type": "string"},
              "age": {"type": "integer", "minimum": 0, "maximum": 150},
              "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
              "address": {"type": "object", "required": ["city", "zip"],
                          "additionalProperties": False, "properties": {
                              "city": {"type": "string"},
                              "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
TEXT = json.dumps({"name": "Alice Smith", "age": 42, "tags": ["a", "c"],
                   "address": {"city": "Paris", "zip": "75001"}})


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def report(name: str, convert_s: float, compile_s: float, mask_s: list[float],
           apply_s: float) -> None:
    print(f"{name:12} tokenizer {convert_s * 1e3:7.1f} ms | schema {compile_s * 1e3:6.2f} ms | "
          f"mask: first {mask_s[0] * 1e6:7.1f} us, mean of the rest "
          f"{np.mean(mask_s[1:]) * 1e6:6.1f} us, max {max(mask_s[1:]) * 1e6:6.1f} us | "
          f"32 rows masked {apply_s * 1e6:6.1f} us")


def main() -> None:
    path = default_model_path()
    tokenizer = load_tokenizer(path)
    vocab = load_model_config(path).vocab_size
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    print(f"{len(ids)} tokens of JSON, vocabulary {vocab}")
    logits = torch.randn(32, vocab)

    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok, convert_s = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS)
    matcher, compile_s = timed(lambda: llguidance.LLMatcher(lltok, grammar))
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    mask_s = []
    for token in ids:
        mask_s.append(timed(lambda: llguidance.torch.fill_next_token_bitmask(matcher, mask))[1])
        assert matcher.consume_token(token), tokenizer.decode([token])
    rows = np.arange(32)
    masks = np.tile(mask.numpy(), (32, 1))
    apply_grammar_mask(logits, rows, masks)
    apply_s = timed(lambda: apply_grammar_mask(logits, rows, masks))[1]
    report("llguidance", convert_s, compile_s, mask_s, apply_s)

    try:
        import xgrammar
    except ImportError:
        print("xgrammar: not installed (see this script's docstring)")
        return
    info, convert_s = timed(lambda: xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab))
    compiler = xgrammar.GrammarCompiler(info)
    compiled, compile_s = timed(lambda: compiler.compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False))
    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, vocab)
    mask_s = []
    for token in ids:
        mask_s.append(timed(lambda: matcher.fill_next_token_bitmask(mask, 0))[1])
        assert matcher.accept_token(token), tokenizer.decode([token])
    masks = xgrammar.allocate_token_bitmask(32, vocab)
    xgrammar.apply_token_bitmask_inplace(logits, masks)
    apply_s = timed(lambda: xgrammar.apply_token_bitmask_inplace(logits, masks))[1]
    report("xgrammar", convert_s, compile_s, mask_s, apply_s)


if __name__ == "__main__":
    main()
