"""A request's prompts as token ids: completion prompts (text or ids), and chat
conversations through the model's chat template. A prompt that cannot be made is a 400
naming the field."""

from __future__ import annotations

from braid.server.api_errors import APIError
from braid.server.protocol import ChatMessage


def completion_prompts(tokenizer, prompt) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of each prompt (a string, strings, token ids, lists of ids)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    prompts, texts = [], []
    for p in prompt:
        if isinstance(p, str):
            prompts.append(tokenize_text(tokenizer, p, "prompt"))
            texts.append(p)
        else:
            prompts.append(list(p))
            texts.append(None)
    return prompts, texts


def tokenize_text(tokenizer, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; 400 if the tokenizer cannot take it (a lone surrogate)."""
    try:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    except Exception as e:  # noqa: BLE001 - the text's fault: the tokenizer is fine otherwise
        raise APIError(400, f"{field} cannot be tokenized: {e}", field) from None


def chat_prompt(tokenizer, messages: list[ChatMessage], tools: list[dict] | None = None,
                template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a conversation (and the tools it offers) through the model's chat
    template, given `template_kwargs` beside (`enable_thinking`, say)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    conversation = []
    for message in messages:
        entry = message.model_dump(exclude_none=True)
        text = message.text()
        if text is not None or not entry.get("tool_calls"):
            # Without content a template fails on a missing key; an assistant's tool calls
            # keep their null content, which templates test for
            entry["content"] = text or ""
        conversation.append(entry)
    try:
        ids = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, tools=tools or None,
            **(template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - a template's own complaint about the messages
        raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from e
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
