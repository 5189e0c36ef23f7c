"""What this host is: its CPU's ISA extensions, its memory ordering, the cores this process may
use; and handing the heap's free pages back to it. Decisions built on these facts live with
what they decide (`braid.config` resolves `auto` settings, `braid.worker.kernels` picks a
rank's kernels)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def isa_flags() -> list[str]:
    """The CPU's vector and matrix ISA extensions, sorted: what code compiled with
    `-march=native` (braid's operators, inductor's kernels) may use, so what a build kept on
    disk must match."""
    return sorted(f for f in cpu_flags()
                  if f.startswith(("avx", "amx", "fma", "f16c", "bmi", "sse", "ssse")))


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 GEMMs natively (AVX512-BF16 or AMX); else bf16 is emulated
    and several times slower than fp32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


SHM_NEEDS_TSO = ("--comm shm relies on x86 total store order, which this CPU does not give; "
                 "use --comm torch")


def host_has_total_store_order() -> bool:
    """Whether stores become visible to other cores in program order (x86's TSO): the shm
    backend was written for it and is offered only there."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def usable_cores() -> list[int]:
    """Cores this process may run on (respects an affinity mask set by a container or taskset)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def release_free_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's `malloc_trim`): loading frees
    copies of the checkpoint's slices that the heap would otherwise keep, counted in the rank's
    memory for as long as it runs. Nothing where the C library has no such call."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim(0)


@functools.cache
def process_namespace() -> str:
    """Where this process's id means this process: the host and its PID namespace. A process
    whose namespace equals ours can be looked up in our `/proc` by its id."""
    try:
        pid_namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pid_namespace = 0
    return f"{platform.node()}:{pid_namespace}"


def resident_bytes(pid: int) -> int:
    """A process's resident memory (RSS, from `/proc/PID/statm`: cheap to read at every step,
    unlike PSS); 0 where it cannot be read."""
    try:
        resident_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return resident_pages * os.sysconf("SC_PAGE_SIZE")
