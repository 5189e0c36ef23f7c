"""ASGI middleware that answers before a request body is read or parsed: the API key (from
the headers alone) and the body's size. Both answer in OpenAI's error shape, or Anthropic's on
its routes."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from braid.server import anthropic
from braid.server.protocol import error_body


def _error(scope: Scope, status: int, message: str, type_: str, code: str,
           headers: dict[str, str]) -> JSONResponse:
    if scope["path"].startswith(anthropic.PATH_PREFIX):
        body = anthropic.error_body(status, message)
    else:
        body = error_body(message, type_, code=code)
    return JSONResponse(body, status_code=status, headers=headers)


class RequireAPIKey:
    """401 for a request to any path outside `open_paths` without `Authorization: Bearer KEY`
    or `x-api-key: KEY` (Anthropic's header), compared in constant time, before anything else
    of the request is looked at."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str],
                 on_reject: Callable[[str], None]) -> None:
        self.app, self.open_paths, self.on_reject = app, open_paths, on_reject
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            headers = dict(scope["headers"])
            scheme, _, supplied = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer":
                supplied = headers.get(b"x-api-key", b"")
            if not secrets.compare_digest(supplied.strip(), self._key):
                self.on_reject("unauthorized")
                response = _error(scope, 401, "invalid API key: pass it as 'Authorization: "
                                  "Bearer KEY' or 'x-api-key: KEY'", "authentication_error",
                                  "invalid_api_key", {"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class LimitBody:
    """413 for a request body over `max_bytes`, declared (Content-Length) or streamed. The
    body is read here, at most `max_bytes` of it, and handed on whole."""

    def __init__(self, app: ASGIApp, max_bytes: int,
                 on_reject: Callable[[str], None]) -> None:
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        too_large = declared is not None and declared.isdigit() and int(declared) > self.max_bytes
        chunks: list[bytes] = []
        size = 0
        more = not too_large
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            too_large = size > self.max_bytes
            if too_large:
                break
        if too_large:
            self.on_reject("body_too_large")
            response = _error(scope, 413, f"the request body exceeds {self.max_bytes} bytes "
                              "(--max-request-bytes)", "invalid_request_error",
                              "request_too_large", {"Connection": "close"})
            await response(scope, receive, send)
            return
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if delivered:
                return await receive()  # what follows the body: a disconnect
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
