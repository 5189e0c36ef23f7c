"""The loop each rank runs: build the model shard, then execute step plans until told to stop."""

from __future__ import annotations

from multiprocessing.connection import Connection

from braid.compiler import set_compiler_ranks
from braid.config import EngineConfig
from braid.distributed.comm import SwitchableCommunicator, TorchCommunicator
from braid.distributed.shm import ShmCommunicator, ShmSegment
from braid.loader.model_config import ModelConfig
from braid.trace import enable_tracing
from braid.worker.model_runner import ModelRunner


def make_communicator(engine: EngineConfig, rank: int, world_size: int,
                      segment: ShmSegment | None) -> SwitchableCommunicator:
    """The backend chosen by `--comm`, switchable to no-ops per step (`--skip-comm`)."""
    if segment is not None:
        real = ShmCommunicator(rank, segment, engine.parallel.comm_timeout_s)
    elif engine.parallel.device.startswith("cuda") and world_size > 1:
        import torch.distributed as dist

        # The default group is gloo (control, CPU tensors); GPU activations go through NCCL.
        real = TorchCommunicator(rank, world_size, dist.new_group(backend="nccl"))
    else:
        real = TorchCommunicator(rank, world_size)
    return SwitchableCommunicator(real, engine.switches.skip_comm)


def worker_main(rank: int, world_size: int, conn: Connection, engine: EngineConfig,
                config: ModelConfig, segment: ShmSegment | None = None) -> None:
    """Rank entry point (`braid.distributed.ranks` runs it): every rank answers "ready" with its
    `RankReady`; rank 0 answers steps and "compile" (`ModelRunner.prepare_compiled`), which
    every rank runs at the same point."""
    set_compiler_ranks(world_size)
    comm = make_communicator(engine, rank, world_size, segment)
    runner = ModelRunner(engine, config, comm)
    trace = enable_tracing(rank) if engine.trace else None
    conn.send(("ok", runner.ready()))
    try:
        while True:
            kind, payload = conn.recv()
            if kind == "stop":
                return
            if kind == "compile":
                result = runner.prepare_compiled()
            else:  # only rank 0 samples, so only it is sent a grammar mask
                result = runner.step(payload, receive_mask=lambda: _expect(conn, "mask"))
            if rank == 0:
                conn.send(("ok", result))
    finally:
        comm.close()
        if trace is not None:
            trace.save(engine.trace)


def _expect(conn: Connection, kind: str) -> object:
    """The payload of the next message, which must be of `kind`."""
    got, payload = conn.recv()
    if got != kind:
        raise RuntimeError(f"expected a {kind!r} message from the driver, got {got!r}")
    return payload
