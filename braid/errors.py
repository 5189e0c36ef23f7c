"""The errors braid explains to its users, and how a failure that belongs to one request is
told to its client."""

from __future__ import annotations

import sys
import traceback


class UserError(Exception):
    """A problem with what the user asked for; the CLI prints it on one line and exits with 2,
    the server answers 400. `param` names the request field at fault, where there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def request_failure(what: str, error: BaseException) -> str:
    """For a failure one request explains (it fails alone): the traceback goes to this
    process's stderr, which is the server's log; the client's message says what failed and
    the exception's type only."""
    traceback.print_exception(error, file=sys.stderr)
    return f"{what} failed ({type(error).__name__}; see the server's log)"
