"""Rank entry points for launcher tests (importable by spawned processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist


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
