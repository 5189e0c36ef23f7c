"""braid's cache of derived checkpoint files: equal to deriving afresh, keyed by the source,
atomic, rebuilt when damaged, bypassed by --no-cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PROMPTS

from braid.cache import (
    CacheWarning,
    cache_root,
    cached,
    entry_dir,
    find_entry,
    replace_atomically,
)
from braid.loader.gguf import iterate_gguf
from braid.loader.model_config import load_model_config
from braid.loader.tokenizer import apply_chat_template, load_tokenizer
from braid.loader.weight_cache import WEIGHTS_FILE, cached_gguf_weights, prepare_gguf_weights


@pytest.fixture
def cache_home(tmp_path, monkeypatch) -> Path:
    """A cache of this test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "braid"


def squares(source: Path, calls: list) -> int:
    """A derived value of a small source file through the cache, counting builds."""
    def build(folder: Path) -> None:
        calls.append("build")
        (folder / "value.txt").write_text(str(int(source.read_text()) ** 2))

    return cached(source, "squares", build, lambda f: int((f / "value.txt").read_text()))


def test_the_cache_lives_under_xdg_cache_home(cache_home, monkeypatch):
    assert cache_root() == cache_home
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert cache_root() == Path.home() / ".cache" / "braid"


def test_an_entry_is_built_once_and_rebuilt_when_the_source_changes(cache_home, tmp_path):
    source, calls = tmp_path / "source.txt", []
    source.write_text("3")
    assert squares(source, calls) == 9
    assert squares(source, calls) == 9
    assert calls == ["build"]
    old_entry = entry_dir(source, "squares")
    source.write_text("4")
    os.utime(source, ns=(1, 1))  # same size; a different mtime and header
    assert squares(source, calls) == 16
    assert calls == ["build", "build"]
    assert not old_entry.exists()  # the stale entry of the same source is removed
    assert [p.name for p in cache_home.iterdir()] == [entry_dir(source, "squares").name]


def test_a_truncated_or_corrupt_entry_is_rebuilt_with_a_warning(cache_home, tmp_path):
    source, calls = tmp_path / "source.txt", []
    source.write_text("5")
    squares(source, calls)
    value_file = entry_dir(source, "squares") / "value.txt"
    value_file.write_text("2")  # truncated: 1 byte where the manifest says 2
    assert find_entry(source, "squares") is None
    with pytest.warns(CacheWarning, match="value.txt has 1 bytes, expected 2"):
        assert squares(source, calls) == 25
    value_file.write_text("xx")  # right size, unreadable
    with pytest.warns(CacheWarning, match="unusable"):
        assert squares(source, calls) == 25
    assert calls == ["build"] * 3


def test_a_launch_that_loses_the_race_keeps_the_winners_entry(cache_home, tmp_path):
    source = tmp_path / "source.txt"
    source.write_text("6")

    def build(folder: Path) -> None:
        squares(source, [])  # another launch finishes the same entry meanwhile
        (folder / "value.txt").write_text("loser")

    assert cached(source, "squares", build, lambda f: (f / "value.txt").read_text()) == "36"
    assert [p.name for p in cache_home.iterdir()] == [entry_dir(source, "squares").name]


def test_an_unwritable_cache_falls_back_to_the_source(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    source = tmp_path / "source.txt"
    source.write_text("7")
    with pytest.warns(CacheWarning, match="cannot write the cache"):
        assert squares(source, []) is None


@pytest.mark.slow  # converts the embedded tokenizer again
def test_cached_config_and_tokenizer_equal_the_converted_ones(cache_home, model_path):
    fresh_config = load_model_config(model_path, use_cache=False)
    assert load_model_config(model_path) == fresh_config  # builds
    assert load_model_config(model_path) == fresh_config  # loads
    fresh = load_tokenizer(model_path, use_cache=False)
    load_tokenizer(model_path)
    cached_tokenizer = load_tokenizer(model_path)
    texts = [*PROMPTS, "  spaces\tand\nnewlines ", "émoji 🎉 and 中文", "<|im_start|>user"]
    for text in texts:
        assert cached_tokenizer(text)["input_ids"] == fresh(text)["input_ids"]
        assert apply_chat_template(cached_tokenizer, text) == apply_chat_template(fresh, text)
    ids = fresh(texts[-2])["input_ids"]
    assert cached_tokenizer.decode(ids) == fresh.decode(ids)
    assert cached_tokenizer.eos_token_id == fresh.eos_token_id
    assert sorted(p.name.split("-")[0] for p in cache_home.iterdir()) == ["config", "tokenizer"]


def test_cached_weights_equal_the_dequantised_gguf_and_are_rebuilt_when_truncated(
        cache_home, model_path):
    config = load_model_config(model_path, use_cache=False)
    assert cached_gguf_weights(model_path, torch.bfloat16) is None
    prepare_gguf_weights(model_path, config, torch.bfloat16)
    cached_weights = dict(cached_gguf_weights(model_path, torch.bfloat16))
    source = dict(iterate_gguf(model_path, config))
    assert cached_weights.keys() == source.keys()
    for name, weight in source.items():
        expected = weight.load().to(torch.bfloat16)
        assert torch.equal(cached_weights[name].load(), expected), name
        if name.endswith("q_proj.weight"):  # a head-aligned slice, as a rank reads it
            rows = 2 * config.head_dim
            assert torch.equal(cached_weights[name].narrow(0, rows, rows),
                               weight.narrow(0, rows, rows).to(torch.bfloat16))
    weights_file = entry_dir(model_path, "weights", "bf16") / WEIGHTS_FILE
    size = weights_file.stat().st_size
    os.truncate(weights_file, size // 2)
    assert cached_gguf_weights(model_path, torch.bfloat16) is None  # ranks would use the GGUF
    with pytest.warns(CacheWarning, match="rebuilding"):
        prepare_gguf_weights(model_path, config, torch.bfloat16)
    assert weights_file.stat().st_size == size


@pytest.mark.slow  # two cold starts of the embedded model
def test_no_cache_writes_nothing_and_answers_the_same(tmp_path):
    answers = []
    for flags in (["--no-cache"], []):
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
        proc = subprocess.run(
            [sys.executable, "-m", "braid.cli", "generate", *flags, "--temperature", "0",
             "--max-new-tokens", "8", "--json", "The capital of France is"],
            capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr
        answers.append(proc.stdout)
        if flags:
            assert not (tmp_path / "xdg").exists()
    assert answers[0] == answers[1]
    assert len(list((tmp_path / "xdg" / "braid").iterdir())) == 3  # config, tokenizer, weights


def test_keys_carry_the_installed_version_and_the_deriving_code():
    from braid.cache import braid_version

    release, code = braid_version().split("+")
    assert release != "unknown" and len(code) == 12


def test_a_replaced_file_is_old_or_new_never_half_written(tmp_path):
    """`replace_atomically`: the new content appears whole; a write that fails leaves the old
    file as it was and no temporary beside it."""
    path = tmp_path / "deeper" / "times.json"
    replace_atomically(path, lambda tmp: tmp.write_text("old"))

    def failing(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_atomically(path, failing)
    assert path.read_text() == "old" and [p.name for p in path.parent.iterdir()] == ["times.json"]
