"""Errors as the HTTP API answers them: `APIError` (a status, a message and the field at
fault, in OpenAI's shape, or Anthropic's on its routes), the handlers that turn every exception
a handler raises into one, and the naming of the field at fault in a request's own terms."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from braid.errors import UserError
from braid.server import anthropic
from braid.server.async_engine import EngineDead
from braid.server.metrics import Metrics
from braid.server.protocol import error_body


class APIError(Exception):
    """An error answered in OpenAI's shape (Anthropic's on its routes: the handlers')."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status, message, param, type_, code)
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code),
                            status_code=self.status, headers=self.headers)


@contextmanager
def named_as(names: dict[str, str]) -> Iterator[None]:
    """Errors of a request translated into a chat request name the field as the client's API
    does (`names`: chat's field -> the API's)."""
    try:
        yield
    except APIError as e:
        e.param = names.get(e.param, e.param)
        raise
    except UserError as e:
        raise APIError(400, str(e), names.get(e.param, e.param)) from None


# Parts of a validation error's location that name a union's option, not a field
_UNION_OPTIONS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def invalid_body(errors: list) -> APIError:
    """A 400 naming the field of a body's most specific validation error: of a union's
    options, the one that got furthest into the body, and not one of another type."""
    first = max(errors, key=lambda error: (len(error.get("loc", ())),
                                           not error.get("type", "").endswith("_type")))
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg')}")
    fields = [str(part) for part in first.get("loc", ()) if part != "body" and not (
        isinstance(part, str) and ("[" in part or part in _UNION_OPTIONS))]
    param = fields[0] if fields else None
    where = ".".join(fields) or "body"
    return APIError(400, f"{where}: {first.get('msg')}", param)


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Answer whatever a handler raises as an `APIError` in the route's API shape (a client's
    error counted among the rejections of `metrics`)."""

    def answer(request: Request, e: APIError) -> JSONResponse:
        if e.status < 500 and e.status not in (401, 413, 429):  # those count where raised
            metrics.reject("not_found" if e.status == 404 else "invalid")
        if request.url.path.startswith(anthropic.PATH_PREFIX):
            return JSONResponse(anthropic.error_body(e.status, e.message), status_code=e.status,
                                headers=e.headers)
        return e.response()

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return answer(request, e)

    @app.exception_handler(UserError)
    async def user_error(request: Request, e: UserError) -> JSONResponse:
        return answer(request, APIError(400, str(e), e.param))

    @app.exception_handler(EngineDead)
    async def engine_dead(request: Request, e: EngineDead) -> JSONResponse:
        return answer(request, APIError(503, "the engine is not running",
                                        type_="server_error"))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return answer(request, invalid_body(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return answer(request, APIError(e.status_code, str(e.detail),
                                        type_="not_found_error" if e.status_code == 404 else
                                        "invalid_request_error"))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        # A bug, not the client's doing: its trace goes to the server's log (uvicorn logs
        # what this handler answered), not to the client.
        return answer(request, APIError(500, "internal error (see the server's log)",
                                        type_="server_error"))
