"""Code named by a string, `"package.module:function"`, resolved where it runs.

A process that starts another (the API process its engine, the driver its ranks) names the
other's entry point instead of importing it, so that it never loads the code the other runs:
the API process holds no model code, and the driver none of the ranks'.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def resolve(target: str | Callable) -> Callable:
    """The object `"module:name"` names (imported now), or `target` itself if it is one."""
    if callable(target):
        return target
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def run(target: str, *args: object) -> object:
    """Call the function `target` names: the entry point of a spawned process."""
    return resolve(target)(*args)
