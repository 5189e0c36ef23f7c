"""`--speculative mtp`: DeepSeek-V3's multi-token-prediction layer as the draft, run in the
ranks. Its proposals are exactly what the layer computes (checked on a checkpoint whose MTP
layer copies its one decoder layer, so the proposals are known from the plain model), and
outputs are plain decoding's at tp 1, 2 and 3 with overlap on."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import slow
from engine_utils import RunnerExecutor, run_requests

from braid import LLM, SamplingParams
from braid.config import EngineConfig
from braid.distributed.comm import SkipCommunicator
from braid.engine.core import EngineCore
from braid.engine.speculation import LayerProposals
from braid.errors import UserError
from braid.loader.model_config import load_model_config
from braid.random_model import make_random_model
from braid.worker.model_runner import ModelRunner

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_folders(tmp_path_factory, tokenizer) -> dict[str, str]:
    """A tiny random V3 with its MTP layer, and one whose MTP layer copies its decoder layer."""
    root = tmp_path_factory.mktemp("mtp")
    return {name: str(make_random_model("deepseek_v3", "tiny", str(root / name),
                                        tokenizer=tokenizer, mtp_copy=name == "copy"))
            for name in ("random", "copy")}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 49152, n).tolist() for n in (5, 17, 40)]


def in_process_core(folder: str, speculative: str) -> EngineCore:
    config = EngineConfig.create(model=folder, dtype="fp32", speculative=speculative)
    model_config = load_model_config(folder)
    runner = ModelRunner(config, model_config, SkipCommunicator(0, 1))
    return EngineCore(config, model_config, RunnerExecutor(runner))


def test_mtp_proposes_what_its_layer_computes(mtp_folders, prompts, monkeypatch):
    """With the MTP layer a copy of the model's one layer, the proposal after a sequence's
    tokens is the plain model's greedy token after the same tokens less the first."""
    seen = []  # (the sequence's tokens, the proposal to follow them)
    receive = LayerProposals.receive

    def recording(self, batch, layout, proposals):
        receive(self, batch, layout, proposals)
        # A finished sequence may have stopped inside a draft its proposal followed further
        seen.extend((seq.token_slice(0, seq.num_tokens), self._next[seq.seq_id][1])
                    for seq in batch if seq.seq_id in self._next and not seq.finished)

    monkeypatch.setattr(LayerProposals, "receive", recording)
    core = in_process_core(mtp_folders["copy"], "mtp")
    outputs = run_requests(core, prompts, GREEDY)
    plain = in_process_core(mtp_folders["copy"], "off")
    assert outputs == run_requests(plain, prompts, GREEDY)
    expected = run_requests(plain, [tokens[1:] for tokens, _ in seen],
                            SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True))
    assert [token for _, token in seen] == [tokens[0] for tokens in expected]
    scheduler = core.scheduler
    assert scheduler.num_accepted_tokens > 0.5 * scheduler.num_draft_tokens > 0


@pytest.mark.parametrize("tp", [2, slow(3)])
def test_mtp_decodes_as_without_speculation(mtp_folders, prompts, tp):
    """A random MTP layer (nearly every proposal rejected) and the copy (most accepted), with
    two-batch overlap and DP linear on: the outputs of plain decoding."""
    for name in ("random", "copy"):
        outputs = {}
        for speculative in ("off", "mtp"):
            with LLM(mtp_folders[name], tp=tp, dtype="fp32", overlap="on", dp_linear="on",
                     overlap_min_tokens=1, speculative=speculative) as llm:
                outputs[speculative] = [out.token_ids for out in llm.generate(prompts, GREEDY)]
                drafted = llm.core.scheduler.num_draft_tokens
        assert outputs["mtp"] == outputs["off"]
        assert drafted > 0


def test_mtp_needs_a_checkpoint_with_mtp_layers(tiny_llama):
    with pytest.raises(UserError, match="--speculative mtp needs a checkpoint with multi-token"):
        LLM(tiny_llama, speculative="mtp")
