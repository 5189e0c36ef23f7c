"""Shared fixtures: the embedded model, its Hugging Face reference, and a safetensors copy."""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch

from braid.cache import cache_root
from braid.config import default_model_path
from braid.loader.model_config import load_model_config

# braid's cache of derived checkpoint files lives in a folder of this test session (never the
# user's ~/.cache): the first launch converts, later ones load, as on a user's machine.
# The build of braid's C++ operators (`braid.native`, one to two minutes) is the user's own,
# keyed by the sources, torch and the CPU: the suite reuses what `make run` built, or builds it
# there once, before the first test (whose rank processes would otherwise wait for it within
# their timeouts), for every process of the session, also those a test gives a cache folder of
# its own. A folder set outside is kept.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache_root() / "native"))
_CACHE_HOME = tempfile.mkdtemp(prefix="braid-test-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE_HOME
atexit.register(shutil.rmtree, _CACHE_HOME, ignore_errors=True)

# One thread per test process: rank processes pin their own cores, the reference shares them.
torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // 2))

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a short poem about the sea and the wind, with rhymes.",
    "In 1905, Albert Einstein published four papers that changed physics. The first explained "
    "the photoelectric effect; the second, Brownian motion; the third introduced special "
    "relativity; the fourth derived the most famous equation in science, which says that",
]


def pytest_sessionstart(session) -> None:
    from braid import native

    native.load(announce=True)


def slow(*values):
    """A parametrize case that runs in `make test-all` only (the default suite keeps one case
    of each kind)."""
    return pytest.param(*values, marks=pytest.mark.slow)


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from braid.loader.tokenizer import load_tokenizer

    return load_tokenizer(model_path)


@pytest.fixture(scope="session")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="session")
def runner(model_path):
    """The embedded model (fp32, exact products over its blocks: its tests compare paths
    whose last bits differ, which int8 inputs would round into other tokens now and then) as
    one rank in this process, under engine cores of the tests' own
    (`engine_utils.RunnerExecutor`)."""
    from braid.config import EngineConfig
    from braid.distributed.comm import SkipCommunicator
    from braid.loader.model_config import load_model_config
    from braid.worker.model_runner import ModelRunner

    engine = EngineConfig.create(model=model_path, dtype="fp32", max_total_tokens=4096,
                                 block_inputs="float")
    return ModelRunner(engine, load_model_config(model_path), SkipCommunicator(0, 1))


@pytest.fixture(scope="session")
def hf_model(model_path):
    """Hugging Face transformers' Llama on the same GGUF weights, fp32: the oracle."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    path = Path(model_path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    return model.eval()


def hf_greedy(model, ids: list[int], steps: int) -> list[int]:
    """Plain argmax decoding with the model's KV cache, EOS not special (as ignore_eos)."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(steps):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                    use_cache=True)
    return tokens


@pytest.fixture(scope="session")
def hf_reference(hf_model, prompt_ids):
    """Per prompt: HF logits at every position and 32 greedy tokens (each prompt alone)."""
    logits, greedy = [], []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            logits.append(hf_model(x).logits[0].float())
            greedy.append(hf_greedy(hf_model, ids, 32))
    return logits, greedy


@pytest.fixture(scope="session")
def safetensors_folder(model_path, tokenizer, tmp_path_factory) -> str:
    """The GGUF's weights, dequantized, as a sharded Hugging Face safetensors folder."""
    from safetensors.torch import save_file

    from braid.loader.gguf import iterate_gguf

    config = load_model_config(model_path)
    folder = tmp_path_factory.mktemp("smollm2-safetensors")
    tensors = {name: w.load().contiguous() for name, w in iterate_gguf(model_path, config)}
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(folder / file))
        weight_map.update({n: file for n in shard_names})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "eos_token_id": 2, "bos_token_id": 1,
    }))
    tokenizer.save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer) -> str:
    """A random two-layer Llama with SmolLM2's heads (fp32 safetensors folder): the model of
    the compiled-path tests, which compile in seconds where SmolLM2's 30 layers take minutes."""
    from braid.random_model import make_random_model

    folder = tmp_path_factory.mktemp("tiny-llama") / "model"
    return str(make_random_model("llama", "tiny", str(folder), tokenizer=tokenizer))


API_KEY = "test-key"
# SmolLM2's template plus Hermes tool calls (the same prompts without tools)
CHAT_TEMPLATE_WITH_TOOLS = Path(__file__).parent.parent / "examples" / "chatml_tools.jinja"


@pytest.fixture(scope="session")
def client(server):
    """The official `openai` client of the shared `server`."""
    import openai

    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=300)


@pytest.fixture(scope="session")
def model(client) -> str:
    """The name the shared `server` serves its model under."""
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One `braid serve --tp 2 --api-key API_KEY --chat-template CHAT_TEMPLATE_WITH_TOOLS
    --speculative ngram` for every test of the API (eager steps): every API test also checks
    that speculative decoding changes nothing a client sees.
    Overlap from 1024 tokens (shm's default is above any CPU step), so long prompts run the
    overlapped path through the server. At the end of the session it must stop on SIGTERM
    within 5 s with exit code 0, its engine and ranks gone and no shared memory left."""
    from server_utils import braid_server, shm_segments_of

    with braid_server("--tp", "2", "--api-key", API_KEY, "--overlap-min-tokens", "1024",
                      "--speculative", "ngram",
                      "--chat-template", str(CHAT_TEMPLATE_WITH_TOOLS),
                      log_dir=tmp_path_factory.mktemp("server")) as server:
        yield server
        engine, ranks = server.engine_and_ranks()
        assert len(ranks) == 2
        start = time.monotonic()
        assert server.stop(signal.SIGTERM) == 0, server.output()
        assert time.monotonic() - start < 5, "an idle server took over 5 s to stop"
        assert not shm_segments_of(engine.pid)
        time.sleep(0.5)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                       for p in [engine, *ranks])

