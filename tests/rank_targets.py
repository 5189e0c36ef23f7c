"""Rank entry points for launcher tests (importable by spawned processes)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from braid.config import ParallelConfig

TIMEOUT_S = ParallelConfig().comm_timeout_s  # the engine's default: how long a peer is awaited


def raise_on_rank_1(rank, world_size, conn):
    conn.send(("ok", "ready"))
    conn.recv()
    if rank == 1:
        raise RuntimeError("injected failure on rank 1")
    dist.all_reduce(torch.ones(4))  # rank 0 blocks here forever: its peer is gone
    conn.send(("ok", "unreachable"))


def echo(rank, world_size, conn):
    conn.send(("ok", "ready"))
    while True:
        kind, value = conn.recv()
        if kind == "stop":
            return
        total = torch.tensor([float(value)])
        dist.all_reduce(total)
        conn.send(("ok", (rank, total.item())))


def report_environment(rank, world_size, conn, names):
    conn.send(("ok", {name: os.environ.get(name) for name in names}))


def shm_against_gloo(rank, world_size, conn, segment):
    """Every dtype and size through shm and gloo; answers the list of mismatches."""
    from braid.distributed.comm import TorchCommunicator
    from braid.distributed.shm import ShmCommunicator

    shm = ShmCommunicator(rank, segment, TIMEOUT_S)
    slot_elems = segment.slot_bytes // 4
    mismatches = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for numel in (1, 3, 100, slot_elems - 1, slot_elems, 2 * slot_elems + 5, 5 * slot_elems):
            gen = torch.Generator().manual_seed(1000 * rank + numel)
            # Small integers: every sum is exact in every dtype, so results must be equal.
            x = torch.randint(-8, 8, (numel,), generator=gen).to(dtype)
            expected = x.clone()
            dist.all_reduce(expected)
            if not torch.equal(shm.all_reduce(x.clone()), expected):
                mismatches.append(("all_reduce", str(dtype), numel))
            rows = [numel // 7 + r for r in range(world_size)]  # unequal rows per rank
            part = torch.randint(-8, 8, (rows[rank], 7), generator=gen).to(dtype)
            # gloo gathers equal sizes only: TorchCommunicator pads around it.
            expected = TorchCommunicator(rank, world_size).all_gather(part, rows)
            if not torch.equal(shm.all_gather(part, rows), expected):
                mismatches.append(("all_gather", str(dtype), numel))
            rooted = shm.gather_to_first(part, rows)
            if (rank == 0 and not torch.equal(rooted, expected)) or (rank and rooted is not None):
                mismatches.append(("gather_to_first", str(dtype), numel))
            rooted = TorchCommunicator(rank, world_size).gather_to_first(part, rows)
            if (rank == 0 and not torch.equal(rooted, expected)) or (rank and rooted is not None):
                mismatches.append(("torch gather_to_first", str(dtype), numel))
    shm.close()
    conn.send(("ok", mismatches))
    conn.recv()


def shm_reduce_into_against_gloo(rank, world_size, conn, segment):
    """`all_reduce_async` + `wait_sum` with a residual (the block sum) against gloo's sum plus
    the residual, for shapes up to and larger than a slot; every rank's result must have the
    same bits. Answers the mismatches."""
    from braid.distributed.shm import ShmCommunicator

    shm = ShmCommunicator(rank, segment, TIMEOUT_S)
    slot_rows = segment.slot_bytes // (4 * 6)
    mismatches = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 5, slot_rows, 3 * slot_rows):
            gen = torch.Generator().manual_seed(100 * rank + rows)
            x = torch.randint(-8, 8, (rows, 6), generator=gen).to(dtype)
            residual = torch.arange(rows * 6, dtype=dtype).view(rows, 6) % 5
            expected = x.clone()
            dist.all_reduce(expected)
            expected += residual
            got = shm.wait_sum(shm.all_reduce_async(x), residual)
            everyone = [torch.empty_like(got) for _ in range(world_size)]
            dist.all_gather(everyone, got)
            if not (torch.equal(got, expected) and all(torch.equal(got, o) for o in everyone)):
                mismatches.append((str(dtype), rows))
    shm.close()
    conn.send(("ok", mismatches))
    conn.recv()


def shm_block_sum_rounds_once(rank, world_size, conn, segment):
    """`wait_sum` with a residual on random data: the ranks' partials and the residual summed
    in fp32 in rank order and rounded once (16-bit), the same bits on every rank, at row counts
    with vector tails and beyond a slot. Answers the mismatches."""
    from braid.distributed.shm import ShmCommunicator

    shm = ShmCommunicator(rank, segment, TIMEOUT_S)
    mismatches = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for shape in ((1, 576), (32, 576), (3, 100), (1500, 576)):
            parts = [torch.randn(*shape, generator=torch.Generator().manual_seed(10 * r + 1))
                     .to(dtype) for r in range(world_size)]
            residual = torch.randn(*shape, generator=torch.Generator().manual_seed(99)).to(dtype)
            got = shm.wait_sum(shm.all_reduce_async(parts[rank]), residual)
            once = parts[0].float()
            for term in [*parts[1:], residual]:
                once = once + term.float()
            everyone = [torch.empty_like(got) for _ in range(world_size)]
            dist.all_gather(everyone, got)
            if not (torch.equal(got, once.to(dtype)) and all(torch.equal(got, o)
                                                            for o in everyone)):
                mismatches.append((str(dtype), shape))
    shm.close()
    conn.send(("ok", mismatches))
    conn.recv()


def shm_outstanding(rank, world_size, conn, segment):
    """Four collectives in flight at once (posted, then waited in order)."""
    from braid.distributed.shm import ShmCommunicator

    shm = ShmCommunicator(rank, segment, TIMEOUT_S)
    inputs = [torch.full((50 * (i + 1),), float(rank + 1) * (i + 1)) for i in range(4)]
    pending = [shm.all_reduce_async(x) for x in inputs[:3]]
    gathering = shm.all_gather_async(inputs[3])
    results = [shm.wait_sum(p) for p in pending] + [shm.wait_gather(gathering)]
    total = sum(range(1, world_size + 1))
    ok = all(torch.all(results[i] == total * (i + 1)) for i in range(3))
    ok &= torch.equal(results[3], torch.cat([torch.full((200,), 4.0 * (r + 1))
                                            for r in range(world_size)]))
    conn.send(("ok", bool(ok)))
    conn.recv()


def shm_rank_1_absent(rank, world_size, conn, segment):
    """Rank 1 never joins the collective; rank 0 answers the timeout error it gets."""
    from braid.distributed.shm import ShmCommunicator

    shm = ShmCommunicator(rank, segment, timeout_s=1.0)
    if rank == 0:
        try:
            shm.all_reduce(torch.ones(4))
            conn.send(("ok", "no error"))
        except RuntimeError as e:
            conn.send(("ok", str(e)))
    else:
        conn.send(("ok", "absent"))
    conn.recv()


def shm_then_raise(rank, world_size, conn, segment):
    from braid.distributed.shm import ShmCommunicator

    shm = ShmCommunicator(rank, segment, TIMEOUT_S)
    shm.all_reduce(torch.ones(4))
    conn.send(("ok", "ready"))
    conn.recv()
    if rank == 1:
        raise RuntimeError("injected failure on rank 1")
    conn.recv()


def shm_chunked_beside_outstanding(rank, world_size, conn, segment):
    """A collective chunked into more pieces than there are slots, run while another one is
    posted and not yet waited (two-batch overlap's order): must finish, not wait for itself."""
    from braid.distributed.shm import ShmCommunicator

    shm = ShmCommunicator(rank, segment, timeout_s=5.0)
    held = shm.all_reduce_async(torch.full((8,), float(rank + 1)))
    part = torch.full((3 * segment.num_slots * segment.slot_bytes // 4,), float(rank))
    gathered = shm.all_gather(part)
    reduced = shm.wait_sum(held)
    ok = torch.equal(gathered, torch.cat([torch.full_like(part, r) for r in range(world_size)]))
    ok &= bool((reduced == sum(range(1, world_size + 1))).all())
    shm.close()
    conn.send(("ok", bool(ok)))
    conn.recv()


def hold_segment_unmapped(rank, world_size, conn, segment):
    """A rank still starting up (loading its model): the segment is not mapped yet."""
    conn.send(("ok", "ready"))
    conn.recv()


def show_a_progress_bar(rank, world_size, conn):
    """What inductor does while it compiles (and transformers while it loads)."""
    from tqdm import tqdm

    for _ in tqdm(range(2), disable=False):
        pass
    conn.send(("ok", "shown"))


def compressed_sums(rank, world_size, conn, kind):
    """Each rank's seeded partial sums reduced compressed over gloo, plain and overlapped (two
    reduces in flight); answers the results and the inputs."""
    from braid.distributed.comm import SwitchableCommunicator, TorchCommunicator

    comm = SwitchableCommunicator(TorchCommunicator(rank, world_size))
    comm.compression = kind
    partials = [torch.randn(37, 576, generator=torch.Generator().manual_seed(10 * r + 1),
                            dtype=dtype) * 3 for r in range(world_size)
                for dtype in (torch.float32, torch.bfloat16)]
    mine = partials[rank * 2: rank * 2 + 2]
    residual = torch.ones(37, 576)
    pending = [comm.all_reduce_async(x) for x in mine]
    sums = [comm.wait_sum(pending[1]), comm.wait_sum(pending[0], residual)]
    conn.send(("ok", (sums, partials)))
    conn.recv()  # "stop": a rank that returns early reads as a dead one


def gathers_in_flight(rank, port, seconds, in_flight):
    """Two-batch overlap's gathers, stressed, in a process of its own (not a braid rank: those
    are pinned to their cores, where a group's worker threads rarely run at the same moment):
    for `seconds` (rank 0's clock: its part's first element says whether to go on), each round
    keeps `in_flight` small gathers in flight through braid's communicator (as compressed sums
    and DP linear do) on a gloo group with `in_flight` worker threads (the default two make the
    race of docs/gloo-race.md rarer, not impossible). Exits 0 if every gathered tensor was
    exact, 1 if one was not; the race kills it with a signal."""
    import time

    from torch.distributed import ProcessGroupGloo

    from braid.distributed.comm import TorchCommunicator

    options = ProcessGroupGloo._Options()
    options._threads = in_flight
    options._devices = [ProcessGroupGloo.create_default_device()]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, pg_options=options)
    comm = TorchCommunicator(rank, 2)
    part = torch.full((64,), rank + 1, dtype=torch.int8)
    deadline, exact, going = time.monotonic() + seconds, True, True
    while going:
        part[0] = int(time.monotonic() < deadline)  # read from rank 0's part only
        pending = [comm.all_gather_async(part) for _ in range(in_flight)]
        for gathered in map(comm.wait_gather, pending):
            exact &= bool((gathered[1:64] == 1).all() and (gathered[65:] == 2).all())
            going = bool(gathered[0])
    os._exit(0 if exact else 1)  # (tearing down a group made with pg_options can hang)
