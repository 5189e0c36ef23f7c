"""The HTTP side of `braid serve` (`ServeSettings`): its flags, declared once."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from braid import settings
from braid.errors import UserError
from braid.server.embeddings import POOLINGS
from braid.server.protocol import RequestLimits
from braid.server.reasoning import REASONING_PARSERS
from braid.server.tool_calls import TOOL_CALL_PARSERS
from braid.settings import read_text, setting


@dataclass(frozen=True)
class ServeSettings:
    """What `braid serve` does beside running the engine."""

    host: str = setting("127.0.0.1", "address to bind (127.0.0.1: this host only)")
    port: int = setting(30000, "port to listen on")
    served_model_name: str | None = setting(
        None, "the model's name in the API (default: the checkpoint's name)")
    api_key: str | None = setting(
        None, "require 'Authorization: Bearer KEY' on every route but /health and /metrics "
        "(visible in ps: prefer --api-key-file or $BRAID_API_KEY)")
    api_key_file: str | None = setting(None, "read the API key from this file", metavar="PATH")
    api_key_all_routes: bool = setting(False, "require the key on /health and /metrics too")
    report_cached_tokens: bool = setting(
        True, "leave usage.prompt_tokens_details.cached_tokens out of responses (it tells a "
        "client which of its prompt blocks others sent; so do the prefix-cache counters of "
        "/metrics: see --api-key-all-routes)", off_flag="--no-cached-tokens")
    limits: RequestLimits = field(default_factory=RequestLimits)
    chat_template: str | None = setting(
        None, "a Jinja chat template replacing the model's (e.g. one that takes tools)",
        metavar="FILE")
    tool_call_parser: str = setting(
        "auto", "how tool calls are read from the output of tool_choice auto (auto: from the "
        "chat template's markers)", choices=("auto", "none", *TOOL_CALL_PARSERS))
    reasoning_parser: str = setting(
        "auto", "how a reasoning model's think block is split from its answer into "
        "reasoning_content (auto: where the chat template shows its think markers)",
        choices=("auto", "none", *REASONING_PARSERS))
    pooling: str = setting(
        "auto", "how /v1/embeddings pools a prompt's final hidden states (auto: as the "
        "checkpoint's sentence-transformers config says, else the last token's)",
        choices=POOLINGS)
    responses_store_size: int = setting(
        256, "most /v1/responses answers kept for previous_response_id and GET (in memory, "
        "the least recently used evicted; 0: none kept)", metavar="N", at_least=0)
    log_level: str = setting("info", "uvicorn's log level",
                             choices=("critical", "error", "warning", "info", "debug"))
    limit_concurrency: int = setting(
        1024, "most open connections; beyond, 503 at once (each may buffer a body of up to "
        "--max-request-bytes, so this bounds their memory)", metavar="N", at_least=1)
    shutdown_timeout: float = setting(
        2.0, "on SIGINT/SIGTERM, seconds in-flight requests get to finish before they are "
        "aborted", metavar="S", at_least=0)

    def __post_init__(self) -> None:
        settings.check(self)
        if self.api_key is not None and self.api_key_file is not None:
            raise UserError("give --api-key or --api-key-file, not both")

    def key(self) -> str | None:
        """The server's key: --api-key, the first line of --api-key-file, or $BRAID_API_KEY;
        `UserError` for a key that cannot be one or a key-only route setting without one."""
        key = self.api_key
        if self.api_key_file is not None:
            lines = read_text(self.api_key_file, "--api-key-file").splitlines()
            key = lines[0].strip() if lines else ""
        if key is None:
            key = os.environ.get("BRAID_API_KEY") or None
        if key is not None and (not key or any(c.isspace() for c in key)):
            raise UserError("the API key must be one word without spaces")
        if self.api_key_all_routes and key is None:
            raise UserError("--api-key-all-routes needs a key (--api-key, --api-key-file or "
                            "$BRAID_API_KEY)")
        return key

    def chat_template_text(self) -> str | None:
        """The text of --chat-template, if given."""
        if self.chat_template is None:
            return None
        return read_text(self.chat_template, "--chat-template")

