"""The loop each rank runs: build the model shard, then execute step plans until told to stop."""

from __future__ import annotations

from multiprocessing.connection import Connection

from braid.config import EngineConfig, ModelConfig
from braid.distributed.comm import Communicator, SkipCommunicator, TorchCommunicator
from braid.distributed.shm import ShmCommunicator, ShmSegment
from braid.engine.model_runner import ModelRunner


def make_communicator(engine: EngineConfig, rank: int, world_size: int,
                      segment: ShmSegment | None) -> Communicator:
    """The backend chosen by `--comm`, or the no-op one under `--skip-comm`."""
    if engine.skip_comm:
        return SkipCommunicator(rank, world_size)
    if segment is not None:
        return ShmCommunicator(rank, segment, engine.comm_timeout_s)
    return TorchCommunicator(rank, world_size)


def worker_main(rank: int, world_size: int, conn: Connection, engine: EngineConfig,
                config: ModelConfig, segment: ShmSegment | None = None) -> None:
    """Rank entry point (run by `RankGroup`): every rank answers "ready"; rank 0 answers steps."""
    comm = make_communicator(engine, rank, world_size, segment)
    runner = ModelRunner(engine, config, comm)
    conn.send(("ok", "ready"))
    try:
        while True:
            kind, payload = conn.recv()
            if kind == "stop":
                return
            result = runner.step(payload)
            if rank == 0:
                conn.send(("ok", result))
    finally:
        comm.close()
