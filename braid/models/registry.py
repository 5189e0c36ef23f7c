"""The model families braid serves, and their architectures looked up by Hugging Face name, GGUF
architecture and `make-random-model` name.

Each module listed in `FAMILY_MODULES` ends with `FAMILY`, the `Architecture`s it serves
(braid.models.spec): adding a family is its module and one line here (docs/adding-a-model.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable

from torch import nn

from braid.errors import UserError
from braid.loader.model_config import ModelConfig
from braid.models.config_fields import check_config_fields
from braid.models.spec import Architecture

# The family modules under braid.models, one line each; their order is the order in which
# messages list the supported GGUF architectures.
FAMILY_MODULES = (
    "llama",
    "mistral",
    "qwen",
    "gemma3",
    "phi3",
    "deepseek_v2",
)


def _load() -> tuple[Architecture, ...]:
    """Every family module's `FAMILY`, in order."""
    return tuple(arch for module in FAMILY_MODULES
                 for arch in importlib.import_module(f"braid.models.{module}").FAMILY)


def _index(archs: Iterable[Architecture], key: Callable[[Architecture], str],
           what: str) -> dict[str, Architecture]:
    """`archs` by `key`, which two families must not share."""
    found: dict[str, Architecture] = {}
    for arch in archs:
        if key(arch) in found:
            raise ValueError(f"{arch.name} and {found[key(arch)].name} have the same {what} "
                             f"{key(arch)!r}")
        found[key(arch)] = arch
    return found


def _by_gguf(archs: Iterable[Architecture]) -> dict[str, tuple[Architecture, ...]]:
    """`archs` by GGUF architecture; two may share one if one reads the files with experts
    and the other those without (`GGUFMapping.experts`)."""
    found: dict[str, tuple[Architecture, ...]] = {}
    for arch in archs:
        if arch.gguf is not None:
            found[arch.gguf.arch] = (*found.get(arch.gguf.arch, ()), arch)
    for name, shared in found.items():
        if len(shared) > 1 and [a.gguf.experts for a in shared] not in ([False, True],
                                                                        [True, False]):
            raise ValueError(f"{', '.join(a.name for a in shared)} share the GGUF architecture "
                             f"{name!r}: one must read files with experts, one those without")
    return found


_ALL = _load()
# By Hugging Face architecture name (`architectures[0]`).
ARCHITECTURES = _index(_ALL, lambda a: a.name, "name")
# By `make-random-model --arch` name.
RANDOM_MODELS = _index((a for a in _ALL if a.random), lambda a: a.random.name, "random name")
# By GGUF `general.architecture`, in the order of `FAMILY_MODULES`.
GGUF_ARCHITECTURES = _by_gguf(_ALL)


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The class for `config.architecture`, or a `UserError` listing what is supported or
    naming a config field whose value braid does not compute (`check_config_fields`)."""
    try:
        cls = ARCHITECTURES[config.architecture].model
    except KeyError:
        raise UserError(f"architecture {config.architecture!r} is not supported "
                        f"(supported: {', '.join(sorted(ARCHITECTURES))})") from None
    check_config_fields(config.architecture, config.extra)
    return cls
