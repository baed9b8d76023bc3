"""When a Llama-family decoder stack runs a step through one C++ call (ops.decode_layers):
steps of at most the small-batch linear's rows (ops.linear.small_batch_max_rows: 16 for
float32 activations, 8 for bfloat16) -- decodes, speculative decoding's verification of 1 + k
tokens, short prefill chunks, or a mix -- and, where every projection keeps a prepacked oneDNN
copy (which the op runs past onednn_above rows, as the layer path does), steps of any size.

FusedDecodeStack.build(layers) says once, after loading, whether the stack qualifies and keeps
the flat list of per-layer tensors the op takes; `applies(...)` is the per-step test. Both are
conservative: anything the op does not do exactly as the layer-by-layer path (tensor
parallelism's all-reduces, a KV connector's per-layer hooks, the TORCH_SDPA backend, a weight
kept only prepacked, CUDA, more rows than the stack takes) keeps
the Python path, whose output the op matches bit for bit.

Multi-LoRA steps take it too (`takes_lora`): the op adds each projection's adapter delta with
the C++ LoRA kernel, as LoRALinear.apply does on the layer path for steps of this size. The
LoRA stacks are collected on the first step with adapter tokens (the LoRA manager wraps the
layers after loading).

Mixture-of-experts layers (Mixtral, Qwen2/3-MoE, MoE and dense layers mixed) take it too: the
op runs the router's linear, select_experts' routing and the C++ fused_moe kernel in place of
the dense MLP -- what FusedMoE does for steps of this size -- where that kernel takes the
experts (dtypes, top_k * 8 pairs) and is switched on (else the step runs layer by layer).
GGUF experts kept packed take moe.cpp's fused_moe_packed instead (one gate|up stack: gate and
up of two types run layer by layer). LoRA steps of MoE models run layer by layer.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence, Union

import torch

from kvserve.attention.backends.cpu import AttentionMetadata, CpuAttentionBackend
from kvserve.distributed.parallel_state import get_tp_world_size
from kvserve.model.layers.rotary import RotaryEmbedding
from kvserve.ops import moe as moe_ops
from kvserve.ops.build import KERNEL_DTYPES
from kvserve.ops.cpu_weight import PackedWeight
from kvserve.ops.decode_layers import (FLOAT_PART, LORA_PROJECTIONS, NO_PART, PREPACKED_SLOTS,
                                       QUANT_PARTS, SLOTS, decode_layers_op)
from kvserve.ops.lora import CPU_KERNEL_MAX_TOKENS as LORA_KERNEL_MAX_TOKENS
from kvserve.ops.lora import kernel_enabled as lora_kernel_enabled
from kvserve.ops.lora import stacks_take
from kvserve.ops.linear import (SMALL_BATCH_MAX_ROWS, kernel_takes,
                                onednn_above_rows, small_batch_max_rows)
from kvserve.ops.quant import kernel as quant_kernel
from kvserve.ops.quant.weight import (INT8_DECODE_MAX_ROWS, INT8_MAX_ROWS, PackedQuantWeight,
                                      int8_max_rows)

logger = logging.getLogger(__name__)


def _packed_ok(weight: PackedWeight) -> bool:
    """The op runs a packed GGUF weight as PackedWeight.matmul does (a layer's, not the LM
    head's `precise` one): up to QUANT_PARTS parts, packed ones with the int8 kernel built."""
    return (not weight.precise and 0 < len(weight.parts) <= QUANT_PARTS
            and quant_kernel.ops() is not None
            and all(p.packed.device.type == "cpu" if isinstance(p, PackedQuantWeight)
                    else isinstance(p, torch.Tensor) and p.device.type == "cpu"
                    for p in weight.parts))


def _linear_ok(linear: Any, act_dtype: torch.dtype) -> bool:
    """The small-batch kernel can take the weight this layer streams (and its bias) for
    act_dtype, or the weight is packed GGUF blocks the op runs; a weight kept only prepacked
    streams none, a path the op does not have."""
    if isinstance(linear.linear_weight, PackedWeight):
        return _packed_ok(linear.linear_weight)
    return _streams(linear, act_dtype)


def _streams(linear: Any, act_dtype: torch.dtype) -> bool:
    """A float weight the small-batch kernel streams (a MoE router's and shared expert's must
    be: the op calls that kernel on them)."""
    w = linear.linear_weight.streamed()
    return w is not None and w.device.type == "cpu" and kernel_takes(act_dtype, w, linear.bias)


def _moe_why_not(mlp: Any, act: torch.dtype) -> Optional[str]:
    """Why this MoE block (MixtralMoE / QwenMoE) cannot run in the op (None: it can)."""
    experts = mlp.experts
    if experts.ep_size != 1:
        return "expert parallelism"
    if not _streams(mlp.gate, act) or mlp.gate.bias is not None:
        return "a router weight the small-batch kernel cannot stream"
    w13, w2 = experts.w13_weight, experts.w2_weight
    if experts.packed:       # GGUF blocks: the packed op (moe.cpp fused_moe_packed)
        if len(experts.w13_packed or ()) != 1 or experts.w2_packed is None:
            return "packed GGUF experts with gate and up of two types or float stacks beside"
        if moe_ops.packed_kernel() is None:
            return "the C++ packed MoE op is disabled or not built"
    elif not moe_ops.kernel_takes(torch.empty(0, dtype=act), w13, w2,
                                  experts.top_k * SMALL_BATCH_MAX_ROWS):
        return "experts the C++ MoE kernel does not take (dtype, top_k x 8 rows)"
    elif not moe_ops.kernel_built():
        return "the C++ MoE kernel is disabled or not built"
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None and not all(_streams(m, act) for m in (
            shared.gate_up_proj, shared.down_proj, mlp.shared_expert_gate)):
        return "a shared-expert weight the small-batch kernel cannot stream"
    return None


def _quant_args(linears: Sequence[Optional[Any]]) -> tuple[list[Optional[torch.Tensor]], list[int]]:
    """One layer's projections as the op's quant_parts / quant_meta (decode_layers.py)."""
    parts: list[Optional[torch.Tensor]] = []
    meta: list[int] = []
    for linear in linears:       # None: a MoE block's place (its weights are float slots)
        weight = None if linear is None else linear.linear_weight
        pieces = weight.parts if isinstance(weight, PackedWeight) else []
        for p in pieces:
            if isinstance(p, PackedQuantWeight):
                parts.append(p.packed)
                meta += [p.fmt.ggml_type, p.out_features]
            else:
                parts.append(p)
                meta += [FLOAT_PART, p.shape[0]]
        parts += [None] * (QUANT_PARTS - len(pieces))
        meta += [NO_PART, 0] * (QUANT_PARTS - len(pieces))
    return parts, meta


def _why_not(layers: Sequence[Any]) -> Optional[str]:
    """Why this stack cannot use the op (None: it can)."""
    if not layers:
        return "no local layers"
    if get_tp_world_size() != 1:
        return "tensor parallel (all-reduces between the layers)"
    first = layers[0]
    act = first.input_layernorm.weight.dtype
    if act not in KERNEL_DTYPES or first.input_layernorm.weight.device.type != "cpu":
        return f"activations {act} / not on CPU"
    for layer in layers:
        attn = layer.self_attn
        backend = attn.attn.backend     # None: the Attention layer's default, CPU_ATTN
        if (backend is not None and type(backend) is not CpuAttentionBackend) \
                or attn.attn.kv_connector is not None:
            return "not the CPU_ATTN backend, or a KV connector's per-layer hooks"
        if type(attn.rotary_emb) is not RotaryEmbedding:
            return "another rotary embedding"
        moe = hasattr(layer.mlp, "experts")
        mlp_why = _moe_why_not(layer.mlp, act) if moe else None
        if mlp_why is not None:
            return mlp_why
        mods = (attn.qkv_proj, attn.o_proj) + (
            () if moe else (layer.mlp.gate_up_proj, layer.mlp.down_proj))
        if not all(_linear_ok(m, act) for m in mods):
            return ("a linear weight the small-batch kernel cannot stream (prepacked only), or "
                    "packed GGUF parts the op does not run")
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [attn.q_norm, attn.k_norm] if attn.qk_norm else []
        if any(n.weight.dtype != act or n.eps != first.input_layernorm.eps for n in norms):
            return "norm weights of another dtype or eps"
        if attn.attn.scale != first.self_attn.attn.scale:
            return "layers with different attention scales"
    return None


class FusedDecodeStack:
    """The op and its arguments that do not change between steps."""

    def __init__(self, op: Any, layers: Sequence[Any]) -> None:
        self.op = op
        self.layers = list(layers)
        self.act_dtype = layers[0].input_layernorm.weight.dtype
        # The layer path's linears run the kernel up to this many rows; more run oneDNN there
        # (F.linear without a prepacked copy), so the op would not match it bit for bit,
        # unless every projection has a prepacked copy (below).
        self.max_rows = small_batch_max_rows(self.act_dtype)
        # Above this many rows a projection with a prepacked copy runs oneDNN on it, on both
        # paths (CpuLinearWeight.matmul).
        self.onednn_above = onednn_above_rows(self.act_dtype)
        # LoRA: the stacks per layer (LORA_SLOTS), [] until the first adapter step; False
        # where a layer has no LoRALinear or stacks the kernel does not take.
        self._lora_tensors: Union[list[torch.Tensor], bool] = []
        self.lora_steps = 0     # steps with adapter tokens it ran (tests check it is used)
        self.steps = 0          # steps it ran (tests check MoE models use it)
        self.has_moe = any(hasattr(layer.mlp, "experts") for layer in layers)
        first = layers[0].self_attn
        self.num_heads = first.attn.num_heads
        self.num_kv_heads = first.attn.num_kv_heads
        self.head_dim = first.head_dim
        self.scale = float(first.attn.scale)
        self.eps = float(layers[0].input_layernorm.eps)
        self.cos_cache = first.rotary_emb.cos_cache
        self.sin_cache = first.rotary_emb.sin_cache
        self.layer_tensors: list[Optional[torch.Tensor]] = []
        # Packed GGUF projections (empty lists: none) and the rows the int8 kernel takes.
        self.quant_parts: list[Optional[torch.Tensor]] = []
        self.quant_meta: list[int] = []
        prepacked = True        # every projection of every layer has a prepacked copy
        # Every projection of every layer packed (takes, below); a MoE block's are not.
        self.all_packed = not self.has_moe
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            moe = hasattr(mlp, "experts")
            linears = (attn.qkv_proj, attn.o_proj) + (
                (None, None) if moe else (mlp.gate_up_proj, mlp.down_proj))
            parts, meta = _quant_args(linears)
            self.all_packed = self.all_packed and all(
                isinstance(linear.linear_weight, PackedWeight) for linear in linears)
            self.quant_parts += parts
            self.quant_meta += meta
            slot = self._moe_slots(mlp) if moe else {
                "gate_up_w": mlp.gate_up_proj.linear_weight.streamed(),
                "gate_up_b": mlp.gate_up_proj.bias,
                "down_w": mlp.down_proj.linear_weight.streamed(), "down_b": mlp.down_proj.bias,
                "gate_up_p": mlp.gate_up_proj.linear_weight.small_step_packed(),
                "down_p": mlp.down_proj.linear_weight.small_step_packed()}
            slot |= {"input_norm": layer.input_layernorm.weight,
                    "post_norm": layer.post_attention_layernorm.weight,
                    "qkv_w": attn.qkv_proj.linear_weight.streamed(), "qkv_b": attn.qkv_proj.bias,
                    "o_w": attn.o_proj.linear_weight.streamed(), "o_b": attn.o_proj.bias,
                    "qkv_p": attn.qkv_proj.linear_weight.small_step_packed(),
                    "o_p": attn.o_proj.linear_weight.small_step_packed(),
                    "q_norm": attn.q_norm.weight if attn.qk_norm else None,
                    "k_norm": attn.k_norm.weight if attn.qk_norm else None}
            self.layer_tensors += [None if slot.get(s) is None else slot[s].detach()
                                   for s in SLOTS]
            prepacked = prepacked and all(slot.get(s) is not None for s in PREPACKED_SLOTS)
        if all(p is None for p in self.quant_parts):
            self.quant_parts, self.quant_meta = [], []
        # Past onednn_above rows every projection then runs its prepacked copy, as on the layer
        # path, so the op takes steps of any size whatever the dtype (up to the LoRA kernel's
        # limit, which the op always calls): those skip the layer path's Python, ~0.17 ms a
        # layer (110M Llama, Zen 5: bf16 9 rows took 10.3-12.0 ms a step against 7.5-10.5 for
        # 8 in the op; float32 17 rows 19.7 against 17-18 for 16).
        if prepacked and not self.has_moe:
            self.max_rows = max(self.max_rows, LORA_KERNEL_MAX_TOKENS)
        # A packed weight's int8 kernel serves up to int8_max_rows() (more rows take
        # PackedQuantWeight's float path, which the op does not have); the MoE kernel's decode
        # pairs are sized for top_k x SMALL_BATCH_MAX_ROWS (_moe_why_not). Where every
        # projection is packed, no small-batch kernel limits the op: it takes what the int8
        # kernel takes in the step (takes: more rows in decode-only steps).
        if self.quant_parts and INT8_MAX_ROWS is not None:
            self.max_rows = min(self.max_rows, INT8_MAX_ROWS)
        if self.has_moe:
            # The op's MoE block runs its router and shared expert on the kernel only: steps
            # where the layer path would hand them to oneDNN stay on that path.
            self.max_rows = min(self.max_rows, SMALL_BATCH_MAX_ROWS, self.onednn_above)

    @staticmethod
    def _moe_slots(mlp: Any) -> dict[str, Optional[torch.Tensor]]:
        """A MoE block's slots: router, expert stacks, [top_k, renormalise], shared expert."""
        experts, shared = mlp.experts, getattr(mlp, "shared_expert", None)
        slot = {"router_w": mlp.gate.linear_weight.streamed(),
                "w13": experts.w13_weight, "w2": experts.w2_weight,
                "moe_cfg": torch.tensor([experts.top_k, int(experts.renormalize)])}
        if experts.packed:       # one gate|up stack (_moe_why_not), types and rows in cfg
            w13, w2 = experts.w13_packed[0], experts.w2_packed
            slot |= {"w13": w13.packed, "w2": w2.packed, "moe_cfg": torch.tensor(
                [experts.top_k, int(experts.renormalize), w13.fmt.ggml_type, w2.fmt.ggml_type,
                 w2.shape[1]])}
        if shared is not None:
            slot |= {"shared_gate_up_w": shared.gate_up_proj.linear_weight.streamed(),
                     "shared_down_w": shared.down_proj.linear_weight.streamed(),
                     "shared_gate_w": mlp.shared_expert_gate.linear_weight.streamed()}
        return slot

    @classmethod
    def build(cls, layers: Sequence[Any]) -> Optional["FusedDecodeStack"]:
        """The stack's fused path, or None (logged once per model) where it cannot run."""
        why = _why_not(layers)
        op = decode_layers_op() if why is None else None
        if why is None and op is None:
            why = "its kernels are disabled or not built"
        if why is not None:
            logger.info("Small steps run layer by layer: %s.", why)
            return None
        stack = cls(op, layers)
        packed = ""
        if stack.quant_parts:
            more = f"; decode-only steps up to {INT8_DECODE_MAX_ROWS}" if stack.all_packed else ""
            packed = f" (packed GGUF weights included{more})"
        logger.info("Steps of up to %d tokens run all %d layers in one C++ call%s.",
                    stack.max_rows, len(layers), packed)
        return stack

    @staticmethod
    def applies(num_tokens: int, meta: Any) -> bool:
        """A step the op may run (any size: with prepacked weights it takes every step),
        with CPU_ATTN's metadata; `takes(num_tokens)` is the built stack's exact limit."""
        return 0 < num_tokens and type(meta) is AttentionMetadata

    def takes(self, num_tokens: int) -> bool:
        """Few enough tokens for this stack: the small-batch kernel's rows with this stack's
        activations, or any step where every projection has a prepacked copy, or the int8
        kernel's rows in this step where every projection is packed (quant.int8_max_rows)."""
        if self.all_packed:
            limit = int8_max_rows()
            return limit is None or num_tokens <= limit
        return num_tokens <= self.max_rows

    def _collect_lora(self) -> Union[list[torch.Tensor], bool]:
        """Every layer's LoRA stacks in LORA_SLOTS order, or False (logged) where the op
        cannot add them."""
        tensors: list[torch.Tensor] = []
        if self.has_moe:
            logger.info("LoRA steps run layer by layer: a mixture-of-experts model.")
            return False
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                lora = proj.lora
                if lora is None or not stacks_take(self.act_dtype, lora.a_stack, lora.b_stack):
                    logger.info("LoRA steps run layer by layer: a projection without LoRA "
                                "stacks the C++ kernel takes.")
                    return False
                tensors += [lora.a_stack, lora.b_stack, lora.has_mask]
        assert len(tensors) == len(self.layers) * 3 * len(LORA_PROJECTIONS)
        return tensors

    def takes_lora(self, mapping: Any) -> bool:
        """Whether this step's adapter tokens (a LoRAMapping with groups) can run in the op:
        the LoRA kernel on, stacks it takes, the mapping of this step's tokens."""
        if self._lora_tensors is False or not lora_kernel_enabled():
            return False
        if not self._lora_tensors:
            self._lora_tensors = self._collect_lora()
        return self._lora_tensors is not False

    def __call__(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                 residual: Optional[torch.Tensor], kv_caches: list[torch.Tensor],
                 meta: AttentionMetadata, lora_mapping: Optional[Any] = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.has_moe and moe_ops.cpu_kernel() is None:
            # The MoE kernel switched off (benchmarks' torch path): FusedMoE's grouped GEMMs.
            for layer, kv_cache in zip(self.layers, kv_caches):
                hidden_states, residual = layer(positions, hidden_states, residual, kv_cache,
                                                meta)
            return hidden_states, residual
        self.steps += 1
        lora: list[torch.Tensor] = []
        lora_slots = None
        if lora_mapping is not None and lora_mapping.groups:
            # The caller checked takes_lora; the op groups the tokens by slot itself.
            lora, lora_slots = self._lora_tensors, lora_mapping.groups.token_slots
            self.lora_steps += 1
        return self.op(hidden_states.contiguous(), residual, positions, self.layer_tensors,
                       kv_caches, meta.slot_mapping, meta.num_decode_tokens,
                       meta.decode_block_tables, meta.decode_seq_lens, meta.prefill_query_starts,
                       meta.prefill_query_lens, meta.prefill_context_lens,
                       meta.prefill_block_tables, self.cos_cache, self.sin_cache,
                       self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.eps,
                       lora, lora_slots, self.quant_parts, self.quant_meta, self.onednn_above)
