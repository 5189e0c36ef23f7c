"""Settings declared once (`braid.settings`): every engine setting is a flag of the commands
that run the engine and a keyword of `LLM`, under one name; its declared bounds hold however it
is set."""

from __future__ import annotations

import dataclasses

import pytest

from braid import settings
from braid.cli import build_parser
from braid.config import EngineConfig, SpeculativeConfig, StepSwitches
from braid.errors import UserError


def engine_settings() -> list[dataclasses.Field]:
    found = []

    def walk(cls: type) -> None:
        groups = {f.name: kind for f, kind in settings.groups(cls)}
        for field in dataclasses.fields(cls):
            if field.name in groups:
                walk(groups[field.name])
            elif settings.flag_of(field) is not None:
                found.append(field)

    walk(EngineConfig)
    return found


def test_every_engine_setting_is_a_flag_of_the_engine_commands_under_its_key():
    fields = engine_settings()
    names = [settings.key_of(f) for f in fields]
    assert len(names) == len(set(names)), "two groups declare the same setting"
    for command in ("generate", "serve", "bench-one-batch", "bench-offline", "eval-mmlu"):
        subparsers = build_parser(command)._subparsers._group_actions[0].choices
        dests = {action.dest for action in subparsers[command]._actions}
        assert set(names) <= dests, (command, set(names) - dests)


def test_flags_build_the_config_that_create_builds():
    argv = ["generate", "--tp", "2", "--comm-timeout", "7", "--no-prefix-cache",
            "--speculative", "ngram", "--speculative-tokens", "5", "--compile", "off", "Hi"]
    args = build_parser("generate").parse_args(argv)
    from_flags = settings.from_arguments(EngineConfig, args)
    assert from_flags == EngineConfig.create(tp=2, comm_timeout_s=7.0, prefix_caching=False,
                                             speculative="ngram", speculative_tokens=5,
                                             compile="off")
    assert from_flags.speculative == SpeculativeConfig(method="ngram", num_tokens=5)
    assert EngineConfig.create(**from_flags.flat()) == from_flags
    assert from_flags.replace(tp=1).parallel.tp == 1 and from_flags.parallel.tp == 2


def test_bad_settings_are_refused_naming_their_flag():
    with pytest.raises(UserError, match="unknown engine setting: tpp"):
        EngineConfig.create(tpp=2)
    with pytest.raises(UserError, match="--tp must be at least 1, got 0"):
        EngineConfig.create(tp=0)
    with pytest.raises(UserError, match="--overlap must be one of auto, on, off, got 'yes'"):
        StepSwitches(overlap="yes")
    with pytest.raises(UserError, match="--max-skip-age must be at least 0"):
        EngineConfig.create(max_skip_age_s=-1.0)
