"""Settings declared once: a dataclass field made with `setting(...)` carries its default, its
command-line flag, help and choices, and the bounds every value must keep.

`braid.cli` builds its flags from the fields (`add_arguments`) and the settings from the parsed
flags (`from_arguments`); `check` enforces the declared choices and bounds wherever a setting is
made (a flag, `LLM(...)`, a test), with a message that names the flag. A field whose type is
another settings dataclass is a group: its fields are flags of the same command.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any

from braid.errors import UserError


@dataclass(frozen=True)
class Flag:
    """How a setting appears on the command line."""

    help: str
    name: str | None = None  # the flag; default: `--` and the field's name with dashes
    choices: Sequence | None = None
    metavar: str | None = None
    at_least: float | None = None  # the smallest value allowed (None: any)
    # For a setting that is on by default: the flag that turns it off (e.g. --no-cache)
    off_flag: str | None = None
    # The name `from_arguments` and `keys` know it by (default: the field's name)
    key: str | None = None


def setting(default: Any = MISSING, help: str = "", *, flag: str | None = None,
            choices: Sequence | None = None, metavar: str | None = None,
            at_least: float | None = None, off_flag: str | None = None,
            key: str | None = None, default_factory: Any = MISSING) -> Any:
    """A dataclass field with its command-line flag (see the module docstring)."""
    meta = {"flag": Flag(help, flag, tuple(choices) if choices else None, metavar, at_least,
                         off_flag, key)}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_of(field: dataclasses.Field) -> Flag | None:
    return field.metadata.get("flag")


def key_of(field: dataclasses.Field) -> str:
    """The name a setting is known by outside its group (`keys`, `from_arguments`)."""
    flag = flag_of(field)
    return (flag.key if flag is not None and flag.key else None) or field.name


def flag_name(field: dataclasses.Field) -> str:
    """The flag that sets a field (`--` and its name with dashes, unless it declares one)."""
    flag = flag_of(field)
    if flag is not None and flag.name:
        return flag.name
    return "--" + field.name.replace("_", "-")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def groups(cls: type) -> Iterator[tuple[dataclasses.Field, type]]:
    """The fields of `cls` that are settings groups themselves, with their classes."""
    hints = _hints(cls)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if dataclasses.is_dataclass(kind) and flag_of(field) is None:
            yield field, kind


def _value_type(kind: Any) -> type | None:
    """The type argparse converts a flag's text to: int, float or str (None for bool)."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    if kind is bool:
        return None
    return kind if kind in (int, float) else str


def _default(field: dataclasses.Field) -> Any:
    if field.default is not MISSING:
        return field.default
    if field.default_factory is not MISSING:
        return field.default_factory()
    return None


def add_arguments(parser: argparse.ArgumentParser, cls: type,
                  only: Sequence[str] | None = None) -> None:
    """A flag for every setting of `cls`, or for the keys in `only`; a group's settings under
    a heading of their own in `--help`."""
    _add(parser, parser, cls, only)


def _add(parser: argparse.ArgumentParser, section, cls: type,
         only: Sequence[str] | None) -> None:
    hints = _hints(cls)
    group_names = {f.name for f, _ in groups(cls)}
    for field in dataclasses.fields(cls):
        if field.name in group_names:
            group = hints[field.name]
            summary = re.split(r"(?<=\.)\s", " ".join((group.__doc__ or "").split()))[0]
            _add(parser, parser.add_argument_group(field.name.replace("_", " "), summary),
                 group, only)
        elif flag_of(field) is not None and (only is None or key_of(field) in only):
            _add_flag(section, field, hints[field.name])


def _add_flag(section, field: dataclasses.Field, kind: Any) -> None:
    key, flag, default = key_of(field), flag_of(field), _default(field)
    help_text = flag.help
    if flag.off_flag is not None:
        section.add_argument(flag.off_flag, dest=key, action="store_false", help=help_text)
        return
    value_type = _value_type(kind)
    if value_type is None:
        section.add_argument(flag_name(field), dest=key, action="store_true", help=help_text)
        return
    if default is not None and not flag.choices:
        help_text = f"{help_text} (default {default})" if help_text else f"default {default}"
    required = field.default is MISSING and field.default_factory is MISSING
    section.add_argument(flag_name(field), dest=key, type=value_type, default=default,
                         choices=flag.choices, metavar=flag.metavar, help=help_text,
                         required=required)


def from_arguments(cls: type, args: argparse.Namespace | dict, **given: Any) -> Any:
    """An instance of `cls` from parsed flags (its settings with a flag only: a command's
    other flags may share a name with a field that has none), or from a dict of keys (any
    field); `given` fields (by key, any field) take precedence."""
    if isinstance(args, argparse.Namespace):
        return _build(cls, vars(args), given, flagged_only=True)
    return _build(cls, dict(args), given, flagged_only=False)


def _build(cls: type, values: dict[str, Any], given: dict[str, Any], flagged_only: bool) -> Any:
    kwargs = {}
    group_names = {f.name: kind for f, kind in groups(cls)}
    for field in dataclasses.fields(cls):
        key = key_of(field)
        if field.name in group_names:
            kwargs[field.name] = _build(group_names[field.name], values, given, flagged_only)
        elif key in given:
            kwargs[field.name] = given[key]
        elif key in values and (flag_of(field) is not None or not flagged_only):
            kwargs[field.name] = values[key]
    return cls(**kwargs)


def keys(cls: type) -> set[str]:
    """Every key `from_arguments(cls, ...)` reads."""
    found = set()
    group_names = {f.name: kind for f, kind in groups(cls)}
    for field in dataclasses.fields(cls):
        if field.name in group_names:
            found |= keys(group_names[field.name])
        else:
            found.add(key_of(field))
    return found


def flatten(instance: Any) -> dict[str, Any]:
    """Every setting of `instance` and its groups by key (what `from_arguments` takes)."""
    values = {}
    group_names = {f.name for f, _ in groups(type(instance))}
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        if field.name in group_names:
            values.update(flatten(value))
        else:
            values[key_of(field)] = value
    return values


def read_text(path: str, flag: str) -> str:
    """A file a flag names, as text (`UserError` naming the flag if it cannot be read)."""
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag}: {e}") from None


def check(instance: Any) -> None:
    """`UserError` for a setting of `instance` (not its groups: each checks itself) outside
    its declared choices or bounds."""
    for field in dataclasses.fields(instance):
        flag = flag_of(field)
        value = getattr(instance, field.name)
        if flag is None or value is None:
            continue
        name = flag.off_flag or flag_name(field)
        if flag.choices and value not in flag.choices:
            raise UserError(f"{name} must be one of {', '.join(map(str, flag.choices))}, "
                            f"got {value!r}")
        if flag.at_least is not None and not value >= flag.at_least:
            raise UserError(f"{name} must be at least {flag.at_least:g}, got {value!r}")
