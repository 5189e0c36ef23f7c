"""braid's C++ operators (`braid/csrc/*.cpp`), built into one library for this host and loaded
into `torch.ops.braid`:

- the shared-memory collectives (`shm_ring.cpp`: `braid.distributed.shm`), which compiled graphs
  call from inductor's C++ wrapper like any other operator;
- decode and prefill attention over the paged KV cache, the one-row GEMV, RMSNorm and the
  oneDNN linear over packed weights (`braid.layers.decode_kernel`, `braid.layers.quant`,
  `braid.layers.fused`);
- linear layers and embedding lookups over a GGUF file's quantized blocks (`ggml_blocks.cpp`:
  `braid.layers.ggml_weight`);
- grammar bitmasks applied to logits (`token_bitmask.cpp`: `braid.worker.sampler`);
- partial sums packed as int8 blocks and summed back (`int8_blocks.cpp`:
  `braid.distributed.compression`).

The library is compiled with the host's compiler for the host's vector ISA (as inductor builds
its kernels), on first use, with a progress line: about a minute on 2 cores. It is kept under
braid's cache (`$XDG_CACHE_HOME/braid/native/`, or `$TORCH_EXTENSIONS_DIR` where the user set
it), in a folder named by torch's version, the ISA and a hash of the sources, so a warm start
only loads it and a changed source or torch is built anew. Every operator has a fake (meta)
implementation here, so `torch.compile` traces through it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
# torch's vector ISA (what at::vec compiles to) -> the macro that selects it
_CAPABILITY_MACROS = {"AVX512": ["-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"],
                      "AVX2": ["-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]}
_NAME = "braid_native"


def build_dir() -> Path:
    """Where the library for this torch, ISA and these sources is built and kept."""
    from braid.cache import cache_root
    from braid.platform import isa_flags

    capability = torch.backends.cpu.get_cpu_capability()
    digest = hashlib.sha256()
    for name in sorted(os.listdir(CSRC)):
        digest.update(name.encode() + (CSRC / name).read_bytes())
    digest.update(" ".join([*_cflags(), *isa_flags()]).encode())
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or str(cache_root() / "native")
    return Path(base) / f"torch-{torch.__version__}-{capability}-{digest.hexdigest()[:16]}"


def _cflags() -> list[str]:
    capability = torch.backends.cpu.get_cpu_capability()
    return ["-O3", "-march=native", "-fopenmp", *_CAPABILITY_MACROS.get(capability, [])]


_loaded: bool | None = None  # whether the library is loaded, once it has been tried


def load(announce: bool = False) -> bool:
    """Build (once per torch, ISA and source) or load the library, on the first call of the
    process (`announce`: say so on stderr when it must be built); False, with a warning, where
    that fails (no compiler): callers then take their ATen or traced paths, and collectives
    over shared memory are refused."""
    global _loaded
    if _loaded is None:
        try:
            _build(announce)
            _register_fakes()
            _loaded = True
        except Exception as e:  # noqa: BLE001 - no compiler, no ninja: the callers' fallbacks
            warnings.warn(f"braid's C++ operators not built ({type(e).__name__}: "
                          f"{str(e)[:300]}); steps run without them", stacklevel=2)
            _loaded = False
    return _loaded


def _build(announce: bool) -> None:
    from torch.utils.cpp_extension import load as load_extension

    if shutil.which("ninja") is None:  # the venv's ninja, when the venv is not activated
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    folder = build_dir()
    library = folder / f"{_NAME}.so"
    if library.exists():
        # The folder's name keys torch, the ISA, the sources and the flags, so a library there
        # is this one: loaded without asking ninja, which rebuilt a whole warm library (two
        # minutes) for some processes of a test session.
        try:
            torch.ops.load_library(str(library))
            return
        except OSError:  # a build cut short: build it again
            pass
    fresh = not library.exists()
    if fresh and announce:
        print(f"braid: building the C++ operators for this CPU into {folder} (once; about a "
              "minute on 2 cores)", file=sys.stderr, flush=True)
    start = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    sources = [str(path) for path in sorted(CSRC.glob("*.cpp"))]
    load_extension(_NAME, sources, extra_cflags=_cflags(),
                   extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)],
                   build_directory=str(folder), is_python_module=False)
    if fresh and announce:
        print(f"braid: C++ operators built in {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)


def _register_fakes() -> None:
    """Output shapes of every operator, for tracing (`torch.compile`)."""
    fake = torch.library.register_fake

    @fake("braid::paged_decode_attention")
    def _(q, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, scale,
          kv_parts=None, row_tokens=None):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @fake("braid::few_rows_linear")
    def _(x, weight):
        return x.new_empty(x.shape[0], weight.shape[0])

    @fake("braid::linear_by_rows")
    def _(x, weight, packed, few_rows, packed_rows, swiglu):
        return x.new_empty(x.shape[0], weight.shape[0] // 2 if swiglu else weight.shape[0])

    from braid.layers.ggml_weight import weight_rows as ggml_weight_rows

    @fake("braid::ggml_dequantize")
    def _(blocks, type, columns, dtype):
        return blocks.new_empty(ggml_weight_rows(blocks, type), columns, dtype=dtype)

    @fake("braid::ggml_linear")
    def _(x, blocks, type, few_rows, int8_rows):
        return x.new_empty(x.shape[0], ggml_weight_rows(blocks, type))

    @fake("braid::causal_prefill_attention")
    def _(q, k, v, scale):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @fake("braid::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @fake("braid::packed_linear")  # (the weight is a number: see csrc/packed_linear.cpp)
    def _(x, weight, out_features, bias, activation, other):
        return x.new_empty(x.shape[0], out_features)

    @fake("braid::quantize_blocks")
    def _(x):
        return x.new_empty(x.numel() + x.numel() // 64 * 4, dtype=torch.int8)

    @fake("braid::dequantize_sum")
    def _(gathered, ranks, like, residual):
        return torch.empty_like(like, memory_format=torch.contiguous_format)

    @fake("braid::shm_post")
    def _(x, sequence, ring):
        return x.new_empty(1, dtype=torch.int64)

    @fake("braid::shm_all_reduce")
    def _(ticket, x, residual, sequence, ring):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @fake("braid::shm_all_gather")
    def _(ticket, x, rows, collect, sequence, ring):
        return x.new_empty(sum(rows) if collect else 0, *x.shape[1:])
