"""`KernelPlan`: which kernels a rank's steps run, decided once when the rank starts
(`braid.worker.kernels.plan_kernels`, from the host, the engine's settings and the model's
shapes) and read by the layers when their weights and KV cache are made
(`braid.layers.quant.make_weight_forms`, `PagedAttention.allocate_cache`). Nothing changes a
kernel choice afterwards; the defaults are the plain path (ATen and SDPA, token-major cache),
which a layer built outside a rank (a unit test) gets.
"""

from __future__ import annotations

from dataclasses import dataclass

from braid.layers import kv_layout


@dataclass(frozen=True)
class KernelPlan:
    """One rank's kernel choices (see the module docstring)."""

    # braid's C++ operators are built and loaded here (CPU)
    operators: bool = False
    # How the KV cache is laid out (`kv_layout`): token-major for SDPA over gathered blocks;
    # tokens innermost (or in pairs) where the decode operator or a compiled step reads it
    kv_layout: str = kv_layout.TOKEN_MAJOR
    # Decode attention: "operator" (`decode_kernel.paged_decode_attention`, eager and in the
    # compiled decode graph), or "gathered" (SDPA over the gathered blocks; traced reductions
    # in a compiled graph)
    decode_attention: str = "gathered"
    # Prefill attention: "operator" (`decode_kernel.causal_prefill_attention`), "blocked"
    # (`attention_ops.blocked_causal_attention`) or "sdpa"
    prefill_attention: str = "sdpa"
    # A GGUF file's quantized weights kept in their blocks (`--quantization auto`,
    # `braid.layers.ggml_weight`)
    gguf_blocks: bool = False
    # GEMMs of a few rows over blocks (GGUF, int4) round their inputs to int8 where a kernel
    # does (`--block-inputs`)
    round_block_inputs: bool = True
    # ... and so do GEMMs of any number of rows over Q4_0, Q4_1, Q8_0 and Q4_K blocks interleaved
    # for the int8 kernel (`ggml_weight.interleave_rows`)
    block_inputs_all_rows: bool = False
    # Linear weights rounded at load into GGML blocks of this many bits (`--quantization int4`
    # or `int8`, `braid.layers.weight_rounding`); 0: none
    rounded_weights: int = 0
    # oneDNN's blocked copy of bf16 linear weights, read by GEMMs of at most
    # `packed_max_rows` rows (None: of any number)
    packed_weights: bool = False
    packed_max_rows: int | None = None
    # GEMMs of at most this many rows through braid's few-row kernel (0: none)
    few_rows: int = 0
    # The elementwise work of eager steps compiled (`braid.layers.fused`): on, auto, off
    fused_elementwise: str = "off"
    # Why steps run eager (None: compiled steps, once `ModelRunner.prepare_compiled` ran)
    not_compiled: str | None = "no kernel plan"

    def _block_inputs(self) -> str:
        if not self.round_block_inputs:
            return "float"
        return "int8 (16-row groups at any rows)" if self.block_inputs_all_rows else "int8"

    def describe(self) -> str:
        """One line: what the rank runs."""
        packed = ("off" if not self.packed_weights else
                  f"up to {self.packed_max_rows} rows" if self.packed_max_rows else "any rows")
        rounded = f"to int{self.rounded_weights}" if self.rounded_weights else "off"
        return (f"decode attention {self.decode_attention}, prefill attention "
                f"{self.prefill_attention}, KV layout {self.kv_layout}, packed weights "
                f"{packed}, GGUF blocks {'kept' if self.gguf_blocks else 'dequantized'}, "
                f"block inputs {self._block_inputs()}, weights "
                f"rounded at load {rounded}, "
                f"few-row GEMMs {f'up to {self.few_rows} rows' if self.few_rows else 'off'}, "
                f"compiled steps {self.not_compiled or 'on'}")
