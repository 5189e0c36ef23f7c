"""The settings of every graph braid compiles in a process (`torch.compile`), applied when the
process first compiles or loads one: importing torch's compiler (dynamo and inductor) takes
over a second and a half of a rank's start, which an eager launch does not need."""

from __future__ import annotations

import os

from braid.cache import cache_root

# assert_indirect_indexing off: no bounds check per indexed load (token ids are checked when a
# request is added; slots and block tables are the engine's own), a tenth of decode attention.
_INDUCTOR = {"assert_indirect_indexing": False}
# Floats a step reads (the norms' epsilon) are constants of the graph, not inputs made into
# tensors on every call. Nothing a step varies is a float: sampling runs outside the graph.
# A piece kind keeps a graph per row-count class, and a state that differs between layers'
# pieces (the first layer's, the last's) adds one: more than dynamo's default of 8.
_DYNAMO = {"specialize_float": True, "recompile_limit": 32, "accumulated_recompile_limit": 512}

_ranks = 1  # of the launch this process is a rank of
_configured = False


def set_compiler_ranks(world_size: int) -> None:
    """This process is one of `world_size` ranks (see `configure_compiler`)."""
    global _ranks
    _ranks = world_size


def configure_compiler() -> None:
    """Apply braid's compiler settings, once per process. Inductor's compiled kernels are kept
    under braid's cache (beside the saved graphs that name them) unless the user chose a
    folder. With several ranks each compiles with one thread: inductor's pool of compile
    workers (one per core by default) held a third of a GiB across a tp 2 launch, while the
    ranks, one per core, compile side by side anyway."""
    global _configured
    if _configured:
        return
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    import torch._inductor.config

    for key, value in _INDUCTOR.items():
        setattr(torch._inductor.config, key, value)
    if _ranks > 1:
        torch._inductor.config.compile_threads = 1
    for key, value in _DYNAMO.items():
        setattr(torch._dynamo.config, key, value)
    _configured = True
