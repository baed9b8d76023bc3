"""GGUF-quantized experts kept packed (issue 29's blocks for issue 30's MoE layers).

A GGUF MoE file stores each layer's experts stacked per projection (ffn_gate_exps /
ffn_up_exps [E, I, H], ffn_down_exps [E, H, I]), each stack in one block type. Where that type
is one ops.quant packs, the loader hands FusedMoE each expert's raw blocks (QuantizedRows) and
FusedMoE keeps them as one PackedExperts per projection: every local expert's rows in the
kernels' interleaved layout, stacked [E, ceil(N/8), K / block, group_block_bytes] uint8, so that
expert e is `packed[e]`, a contiguous PackedQuantWeight-shaped view. Gate and up of one type
are fused (each expert's gate rows, then its up rows: one int8 call per expert); of two types
they stay two stacks.

fused_experts_packed runs them as fused_experts_torch runs float stacks: the (token, expert)
pairs grouped by expert, one pass per expert that has tokens (a loop over experts, never
tokens), weighted rows summed back. Per step size, as PackedQuantWeight.matmul decides for a
dense layer:
  - up to INT8_MAX_ROWS tokens (decode, speculative verification): the int8 kernel
    (kvserve::quant_linear) on the expert's packed blocks, its x rows quantized per block --
    only the routed experts' bytes are read;
  - larger steps (prefill): each used expert's weight dequantized CHUNK_ELEMS floats at a time
    (gguf-exact) into float32 GEMMs over its tokens -- the dequantized float model's math; with
    bfloat16 hidden states (a packed file's dtype "auto" on a CPU with bf16 math) the chunks
    are rounded to bf16 for bf16 GEMMs, as PackedQuantWeight.matmul does for a dense layer.
Decode-sized steps of packed stacks run as one C++ op per layer (csrc/moe.cpp
fused_moe_packed: the same kernel calls in the same order, bit-identical to the torch-op loop
here for top-2) because the loop's op calls cost more than the kernel at batch 1: one small
Mixtral layer (8 experts of 512 x 512, top-2, Q8_0, 2 threads, loaded Zen 3), 0.15 ms in C++,
0.43 ms as the loop, 0.31 ms for only its 4 quant_linear calls from Python (benchmarks/moe.py
--kernel-sweep --gguf Q8_0 Q4_K; Q4_K 0.10 / 0.24 / 0.15 ms). The fused all-layers decode op
calls the same op (decode_layers.cpp moe_mlp) where gate|up is one stack. The loop stays for
prefill, expert parallelism (ids -1), float stacks beside packed ones, builds without the op.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from kvserve.model.layers.fused_moe.torch_moe import group_by_expert, widened
from kvserve.ops import moe as moe_ops
from kvserve.ops.fused import silu_and_mul
from kvserve.ops.linear import mm_t
from kvserve.ops.quant import kernel as quant_kernel
from kvserve.ops.quant import weight as quant_weight
from kvserve.ops.quant.formats import BlockFormat, block_format
from kvserve.ops.quant.weight import PackedQuantWeight, QuantizedRows


@dataclass
class PackedExperts:
    """One projection of E experts, each an [N, K] weight in GGUF blocks of `fmt`:
    packed [E, ceil(N/8), K / block_size, fmt.group_block_bytes] uint8 (formats.py's layout)."""
    fmt: BlockFormat
    shape: tuple[int, int]          # one expert's (N, K)
    packed: torch.Tensor

    @classmethod
    def stack(cls, experts: Sequence[Sequence[QuantizedRows]]) -> "PackedExperts":
        """From each expert's row-wise parts (all of one type and K): expert e's weight is its
        parts' rows concatenated (gate | up), packed once, into one preallocated stack."""
        first = experts[0][0]
        fmt = block_format(first.qtype)
        n, k = sum(p.shape[0] for p in experts[0]), first.shape[1]
        out: Optional[torch.Tensor] = None
        for e, parts in enumerate(experts):
            if any(p.qtype != first.qtype or p.shape[1] != k for p in parts) \
                    or sum(p.shape[0] for p in parts) != n:
                raise ValueError(f"packed experts: expert {e}'s parts "
                                 f"{[(p.qtype, p.shape) for p in parts]} differ from expert 0's "
                                 f"({first.qtype}, [{n}, {k}])")
            one = QuantizedRows.pack(list(parts)).packed
            if out is None:
                out = torch.empty((len(experts), *one.shape), dtype=torch.uint8)
            out[e].copy_(one)
        return cls(fmt, (n, k), out)

    @property
    def num_experts(self) -> int:
        return self.packed.shape[0]

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def expert(self, e: int) -> PackedQuantWeight:
        """Expert e as a PackedQuantWeight over the stack's bytes (a view, no copy)."""
        return PackedQuantWeight(self.fmt, self.shape, self.packed[e])

    def __repr__(self) -> str:
        return (f"PackedExperts({self.fmt.name}, {self.num_experts} x {list(self.shape)}, "
                f"{self.nbytes / 2**20:.2f} MiB)")


# One projection's experts: packed, or float [E, N, K] (a stack of another type).
ExpertStack = Union[PackedExperts, torch.Tensor]


def expert_matmul(w: ExpertStack, e: int, x: torch.Tensor, int8_ops: Optional[object]
                  ) -> torch.Tensor:
    """x [n, K] float32 (or bfloat16, a bf16 model's prefill) @ expert e's W^T -> [n, N]
    float32: the int8 kernel on its packed blocks (`int8_ops`: kernel.ops(), a decode-sized
    step), else a dense layer's prompt arithmetic (PackedQuantWeight.matmul: on a K-quant the
    int8 GEMM where the build has one, otherwise the dequantized GEMM in x's dtype); a float
    stack widened per expert."""
    if isinstance(w, torch.Tensor):
        return mm_t(x.float(), widened(w[e], torch.float32))
    if int8_ops is not None:
        return int8_ops.linear(x.float(), w.packed[e], w.fmt.ggml_type, w.shape[0])
    gemm = quant_weight.prompt_gemm_ops(w.fmt, x)
    if gemm is not None:
        return gemm.gemm(x.contiguous(), w.packed[e], w.fmt.ggml_type, w.shape[0]).float()
    return w.expert(e).dequantized_matmul(x).float()


def int8_step(x: torch.Tensor) -> Optional[object]:
    """The int8 kernel's ops where this step takes them (CPU, built, within int8_max_rows()
    tokens: the threshold PackedQuantWeight.matmul applies to a dense layer's step), else None."""
    limit = quant_weight.int8_max_rows()
    if x.device.type != "cpu" or (limit is not None and x.shape[0] > limit):
        return None
    return quant_kernel.ops()


def fused_experts_packed(hidden_states: torch.Tensor, w13: Sequence[ExpertStack],
                         w2: ExpertStack, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         num_experts: int, ids_in_range: bool = True) -> torch.Tensor:
    """hidden_states [T, H]; w13: [gate|up] fused, or [gate, up]; w2 the down projections;
    topk_weights / topk_ids [T, k] (ids -1: another expert-parallel rank's, left out; then
    ids_in_range must be False) -> [T, H] in hidden_states' dtype = sum over k of
    weight * down(silu(gate x) * up x). Decode-sized steps of packed stacks go to the C++ op
    (ops/moe.py fused_moe_packed_cpu: the same calls, bit-identical for top_k <= 2)."""
    ops = int8_step(hidden_states)
    stacks = [*w13, w2]
    if (ops is not None and ids_in_range and moe_ops.packed_kernel() is not None
            and all(isinstance(w, PackedExperts) for w in stacks)):
        inter = w2.shape[1]
        return moe_ops.fused_moe_packed_cpu(
            hidden_states, [w.packed for w in w13], [w.fmt.ggml_type for w in w13], w2.packed,
            w2.fmt.ggml_type, inter, topk_weights, topk_ids).to(hidden_states.dtype)
    return _experts_loop(hidden_states, w13, w2, topk_weights, topk_ids, num_experts, ops)


def _experts_loop(hidden_states: torch.Tensor, w13: Sequence[ExpertStack], w2: ExpertStack,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                  ops: Optional[object]) -> torch.Tensor:
    """fused_experts_packed in torch ops: a loop over the experts that have tokens."""
    num_tokens, hidden = hidden_states.shape
    order, token_of, counts = group_by_expert(topk_ids, num_experts)
    # bf16 prefill: bf16 GEMMs on packed experts (expert_matmul); else float32 math.
    bf16 = (hidden_states.dtype == torch.bfloat16 and ops is None
            and hidden_states.device.type == "cpu")
    x = (hidden_states if bf16 else hidden_states.float()).index_select(0, token_of)
    # Each pair's row in pair order (token * k + slot; another rank's pairs stay 0), then the
    # k rows of a token weighted and summed: small serial ops. index_add_ (fused_experts_torch)
    # is a parallel region even for one row, whose join can wait milliseconds for a core on
    # a shared host.
    rows = torch.zeros(topk_ids.numel(), hidden, dtype=torch.float32, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        xe = x[start:start + n]
        parts = [expert_matmul(w, expert, xe, ops) for w in w13]
        gate_up = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        act = silu_and_mul(gate_up)
        rows.index_copy_(0, order[start:start + n],
                         expert_matmul(w2, expert, act.to(x.dtype) if bf16 else act, ops))
        start += n
    rows.mul_(topk_weights.reshape(-1, 1).float())
    return rows.view(num_tokens, -1, hidden).sum(dim=1).to(hidden_states.dtype)
