"""Executors run step plans on the model: `RankExecutor` drives the tensor-parallel rank
processes (tests drive a `ModelRunner` in their own process: tests/engine_utils.py).

The ranks are launched by the name of their entry point (`WORKER_MAIN`): the driver's process
never imports the code its ranks run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from braid import native
from braid.config import EngineConfig
from braid.distributed.ranks import check_not_bootstrapping, launch_ranks
from braid.distributed.shm import ShmSegment, activation_slot_bytes
from braid.engine.draft import check_draft_model
from braid.errors import UserError
from braid.layers.ggml_weight import keeps_quantized_blocks
from braid.loader.model_config import ModelConfig
from braid.loader.weight_cache import prepare_gguf_weights
from braid.models.registry import model_class
from braid.step import RankReady, StepPlan, StepResult

# A rank's entry point (`braid.worker.worker.worker_main`)
WORKER_MAIN = "braid.worker.worker:worker_main"


class Executor(Protocol):
    """Runs step plans on the model: the rank processes, or a runner in this process."""

    ready: RankReady
    readies: list[RankReady]

    def step(self, plan: StepPlan,
             fill_masks: Callable[[], np.ndarray] | None = None) -> StepResult:
        """Run `plan`; where it has grammar rows, `fill_masks()` gives their bitmask, called
        while the forward step runs where the executor can (`RankExecutor`)."""

    def prepare_compiled(self) -> str:
        """Compile or load the compiled steps on every rank (`ModelRunner.prepare_compiled`);
        what was done, in a line."""

    def check_alive(self) -> None:
        """Raise if the model can no longer run (a rank died while the engine was idle)."""

    def close(self) -> None: ...


class RankExecutor:
    """The model's tensor-parallel ranks as processes: plans out, rank 0's results back.

    Construction starts the ranks and returns at once (the caller may load its tokenizer
    meanwhile); `wait_ready` waits until every rank has loaded its shard.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        check_not_bootstrapping()
        # Refuse an unsupported architecture or split before launching.
        model_cls = model_class(model_config)
        tp = config.parallel.tp
        model_cls.check_config(model_config, tp)
        if config.speculative.method == "mtp" and not model_cls.num_mtp_layers(model_config):
            raise UserError(f"--speculative mtp needs a checkpoint with multi-token-prediction "
                            f"layers (DeepSeek-V3's num_nextn_predict_layers); {config.model} "
                            "has none")
        if config.speculative.method == "draft":
            check_draft_model(config, model_config)
        split = model_cls.describe_split(model_config, tp) if tp > 1 else ""
        if split:
            print(f"tp {tp} split: {split}", file=sys.stderr)
        if config.parallel.device == "cpu":
            native.load(announce=True)  # built once, here, so that no rank waits on the build
        if (config.cache and Path(config.model).is_file()
                and not keeps_quantized_blocks(config, model_config)):
            prepare_gguf_weights(config.model, model_config, config.torch_dtype)
        segment = None
        if config.parallel.comm == "shm" and config.parallel.tp > 1:
            segment = ShmSegment.create(config.parallel.tp, slot_bytes=activation_slot_bytes(
                config.scheduler.max_num_batched_tokens, model_config.widest_activation,
                config.torch_dtype.itemsize))
        try:
            self.ranks = launch_ranks(tp, WORKER_MAIN, (config, model_config, segment),
                                      cleanup=segment.unlink if segment else None,
                                      timeout_s=config.parallel.comm_timeout_s)
        except BaseException:
            if segment is not None:
                segment.unlink()
            raise

    def wait_ready(self) -> None:
        """Wait until every rank has loaded its shard; rank 0's `ready` is kept, and every
        rank's in `readies`."""
        try:
            self.readies = self.ranks.gather()
            self.ready = self.readies[0]
        except BaseException:
            self.ranks.close()
            raise

    def step(self, plan: StepPlan,
             fill_masks: Callable[[], np.ndarray] | None = None) -> StepResult:
        self.ranks.send_all(("step", plan))
        if fill_masks is not None:  # while the ranks compute the logits
            self.ranks.send(0, ("mask", fill_masks()))
        return self.ranks.recv(0)

    def prepare_compiled(self) -> str:
        return self.ranks.request(("compile", None))

    def check_alive(self) -> None:
        self.ranks.check_alive()

    def close(self) -> None:
        self.ranks.close()
