"""Batched LoRA for a mixed batch, punica's shrink-then-expand, grouped by slot.

Each step the runner gives every token a slot (`token_slots`, -1 = the base model, no delta).
`LoRAMapping` turns that into groups: per active slot, the tokens that use it — a slice when
they are contiguous (a request's tokens are; so are a batch's of one adapter), else an index
tensor — and keeps the slots themselves as a tensor for the kernels. A layer's delta is

    shrink:  s = x[g] @ A[slot]^T        [Tg, n*R]   (n = fused slices, R = max rank)
    expand:  y[g] += s @ B[slot]^T       [Tg, out]   (B block-diagonal over the slices,
                                                      the LoRA scaling folded in)

computed by one of (add_lora picks; never a loop over requests):
- CUDA: the Triton kernels (kvserve/ops/triton/lora.py), one shrink and one expand launch
  for all adapters: static shapes, no host syncs, so a CUDA graph can capture them (the
  slots live in a buffer that set() refills in place between replays);
- CPU, up to ops.lora.CPU_KERNEL_MAX_TOKENS tokens (decode and prefill steps): the C++ kernel
  (csrc/lora.cpp), one call;
- otherwise (steps over that on CPU, other dtypes, no kernels: KVSERVE_DISABLE_CPU_KERNELS
  or a failed build, no Triton): two torch matmuls per group (at most --max-loras of them).
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from kvserve.ops import lora as cpu_lora

Group = tuple[int, Union[slice, torch.Tensor]]


class SlotGroup(tuple):
    """One Group, (slot, slice | index tensor), that also knows the step's LoRAGroups: a
    layer may pass add_lora a filtered plain list of them (the slots whose adapter targets
    it) and the kernels still find the step's token -> slot tensor."""
    owner: "Optional[weakref.ref[LoRAGroups]]" = None


class LoRAGroups(list):
    """A step's groups (a list of Group, as before) that also carry the token -> slot tensor
    the kernels read (token_slots [T] int64 on the model's device), and what is derived from
    it once per step (the slots of a subset of the groups, the Triton grouping)."""

    def __init__(self, groups: list[Group], token_slots: torch.Tensor) -> None:
        items = []
        for group in groups:
            item = SlotGroup(group)
            item.owner = weakref.ref(self)
            items.append(item)
        super().__init__(items)
        self.token_slots = token_slots
        # Static (CUDA-graph) mode: the groups are every slot, and nothing is derived from the
        # slot values on the host; the kernels read token_slots, a view of a buffer that is
        # refilled in place before each replay (StaticLoRASlots).
        self.static = False
        self._subsets: dict[tuple[int, ...], torch.Tensor] = {}
        self._meta: dict[tuple[int, int], Any] = {}
        self._captured: set[tuple[int, int]] = set()

    def slots_for(self, groups: list[Group]) -> torch.Tensor:
        """token_slots with the slots outside `groups` (a subset of this step's) set to -1.
        On CUDA the full tensor: a slot a layer's adapter does not target has zero A and B
        there, so its delta is an exact 0, and nothing is derived on the host mid-forward."""
        if len(groups) == len(self) or self.token_slots.is_cuda or self.static:
            return self.token_slots
        key = tuple(sorted(int(g[0]) for g in groups))
        slots = self._subsets.get(key)
        if slots is None:
            host = self.token_slots.numpy()
            slots = torch.from_numpy(np.where(np.isin(host, key), host, -1))
            self._subsets[key] = slots
        return slots

    def triton_meta(self, token_slots: torch.Tensor, num_slots: int) -> Any:
        key = (token_slots.data_ptr(), num_slots)
        meta = self._meta.get(key)
        # A CUDA graph being captured must compute the grouping itself (from the slots buffer a
        # replay reads), once, not reuse tensors computed before the capture (a warm-up's).
        capturing = token_slots.is_cuda and torch.cuda.is_current_stream_capturing()
        if meta is None or (capturing and key not in self._captured):
            meta = self._meta[key] = _triton().lora_meta(token_slots, num_slots)
            if capturing:
                self._captured.add(key)
        return meta


def step_groups(groups: list[Group]) -> Optional[LoRAGroups]:
    """The LoRAGroups that `groups` (it, or a list of some of its items) come from; None for
    groups built some other way (then add_lora takes the torch path)."""
    if isinstance(groups, LoRAGroups):
        return groups
    owner = getattr(groups[0], "owner", None) if groups else None
    return owner() if owner is not None else None


@dataclass
class LoRAMapping:
    """This step's token -> slot grouping, shared by every LoRA layer of the model."""
    groups: list[Group] = field(default_factory=list)
    num_tokens: int = 0
    # CUDA: the slots' device buffer, refilled in place each step (a captured graph reads it).
    _slots_buf: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    def set(self, token_slots: np.ndarray, device: torch.device) -> None:
        """token_slots [T] int: the slot of each token of the flattened batch, -1 for base."""
        self.num_tokens = len(token_slots)
        groups: list[Group] = []
        scattered: list[tuple[int, np.ndarray]] = []     # (position in groups, indices)
        for slot in np.unique(token_slots):
            if slot < 0:
                continue
            idx = np.flatnonzero(token_slots == slot)
            if idx[-1] - idx[0] + 1 == len(idx):
                groups.append((int(slot), slice(int(idx[0]), int(idx[-1]) + 1)))
            else:
                scattered.append((len(groups), idx))
                groups.append((int(slot), slice(0, 0)))
        if scattered:      # one host -> device copy for all (on CUDA each is a stream sync)
            flat = torch.from_numpy(np.concatenate([idx for _, idx in scattered])).to(device)
            for (i, idx), part in zip(scattered, flat.split([len(idx) for _, idx in scattered])):
                groups[i] = (groups[i][0], part)
        host = torch.from_numpy(np.array(token_slots, dtype=np.int64))   # a copy: ours
        self.groups = LoRAGroups(groups, self._device_slots(host, torch.device(device)))

    def _device_slots(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return host
        buf = self._slots_buf
        # "cuda" (no index) is the current device: compared as is with the buffer's "cuda:0"
        # it reallocated the buffer every step, and a graph captured over the old one
        # replayed stale slots (test_triton_path_in_a_cuda_graph failed on an H100).
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if buf is None or buf.device != device or buf.shape[0] < host.shape[0]:
            buf = self._slots_buf = torch.full((max(host.shape[0], 256),), -1,
                                               dtype=torch.int64, device=device)
        view = buf[:host.shape[0]]
        view.copy_(host)
        return view

    def set_static(self, token_slots: torch.Tensor, num_slots: int) -> None:
        """Static (CUDA-graph) mode: every slot is a group and token_slots [T] (a view of
        StaticLoRASlots' buffer) is read by the kernels as it is at replay time. Every LoRA
        layer then adds its delta, whatever adapters the slots hold then (an empty slot, or
        one whose adapter does not target the layer, has zero A and B: an exact 0)."""
        self.num_tokens = int(token_slots.shape[0])
        self.groups = LoRAGroups([(slot, slice(0, 0)) for slot in range(num_slots)], token_slots)
        self.groups.static = True

    @property
    def static(self) -> bool:
        return bool(getattr(self.groups, "static", False))

    def clear(self) -> None:
        self.groups, self.num_tokens = [], 0


class StaticLoRASlots:
    """The per-token adapter slots a captured CUDA graph reads: one buffer for the largest
    bucket, allocated once; view(b) is what a bucket's graph is captured with, fill() refills
    it in place before a replay (never reallocated: the graph holds its address). The rows
    past the real batch are -1, no adapter: padding rows get no delta."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.buf = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)

    def view(self, num_tokens: int) -> torch.Tensor:
        return self.buf[:num_tokens]

    def fill(self, token_slots: torch.Tensor, padded: int) -> None:
        """token_slots [n] (the step's, on the buffer's device or the host) into rows [0, n),
        -1 into [n, padded): device-side copies, no host sync."""
        n = int(token_slots.shape[0])
        self.buf[:n].copy_(token_slots, non_blocking=True)
        if padded > n:
            self.buf[n:padded].fill_(-1)


@functools.lru_cache(maxsize=1)
def _triton() -> Any:
    """The Triton kernels (imported on first use: CPU runs never need Triton)."""
    from kvserve.ops.triton import lora
    return lora


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        _triton()
        return True
    except Exception:    # no Triton (or no working backend): the torch path
        return False


def add_lora(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
             groups: list[Group], out_splits: Sequence[int] = ()) -> None:
    """y[T, out] += per group: (x[g] @ a_stack[slot]^T) @ b_stack[slot]^T, in place.

    a_stack [S, n*R, in], b_stack [S, out, n*R]; groups from LoRAMapping. out_splits: the n
    fused slices' output sizes when B is block-diagonal over them (LoRALinear.out_splits; the
    C++ kernel then skips the zero blocks), else ()."""
    if not groups:
        return
    step = step_groups(groups)
    if step is not None and step.static:
        add_lora_static(y, x, a_stack, b_stack, step, out_splits)
        return
    if (step is not None and y.dim() == 2
            and x.shape[0] == step.token_slots.shape[0] == y.shape[0]):
        if y.is_cuda:
            if triton_available():
                add_lora_triton(y, x, a_stack, b_stack, groups)
                return
        elif cpu_lora.fused_delta(y, x, a_stack, b_stack, step.slots_for(groups), out_splits):
            return
    add_lora_torch(y, x, a_stack, b_stack, groups)


def add_lora_static(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor,
                    b_stack: torch.Tensor, step: LoRAGroups,
                    out_splits: Sequence[int] = ()) -> None:
    """add_lora in static (CUDA-graph) mode: what it launches depends on shapes only, never on
    the slot values (step.token_slots is read by device code). CUDA: the Triton kernels; CPU
    (the capture path run eagerly, tests): the C++ kernel where it applies, else one masked
    torch delta per slot (S x the work: a fallback)."""
    slots = step.token_slots
    if y.is_cuda and triton_available():
        ops = _triton()
        meta = step.triton_meta(slots, a_stack.shape[0])
        ops.lora_expand(y, ops.lora_shrink(x, a_stack, meta), b_stack, meta)
        return
    if not y.is_cuda and cpu_lora.fused_delta(y, x, a_stack, b_stack, slots, out_splits):
        return
    for slot in range(a_stack.shape[0]):
        delta = (x @ a_stack[slot].t()) @ b_stack[slot].t()
        y.add_(torch.where((slots == slot)[:, None], delta, torch.zeros((), dtype=delta.dtype,
                                                                         device=delta.device)))


def add_lora_torch(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor,
                   b_stack: torch.Tensor, groups: list[Group]) -> None:
    """add_lora's torch path: two matmuls per group (the fallback everywhere)."""
    for slot, g in groups:
        # Stacks of another dtype (--lora-dtype, 16-bit weights beside float32 x): the
        # matmuls in the stacks' dtype, the delta added in y's.
        shrunk = x[g].to(a_stack.dtype) @ a_stack[slot].t()
        delta = (shrunk @ b_stack[slot].t()).to(y.dtype)
        if isinstance(g, slice):
            y[g] += delta
        else:
            y.index_add_(0, g, delta)


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor,
                    b_stack: torch.Tensor, groups: list[Group]) -> None:
    """add_lora with the Triton kernels (CUDA; on CPU tensors under TRITON_INTERPRET=1 in tests):
    one shrink and one expand launch over every adapter group. `groups` from LoRAMapping (or
    some of its items)."""
    ops = _triton()
    step = step_groups(groups)
    if step is None:
        raise ValueError("add_lora_triton: groups must come from LoRAMapping.set")
    meta = step.triton_meta(step.slots_for(groups), a_stack.shape[0])
    ops.lora_expand(y, ops.lora_shrink(x, a_stack, meta), b_stack, meta)


def add_lora_reference(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor,
                       b_stack: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """The same delta token by token in float64 (tests only): gathers each token's A and B."""
    mask = token_slots >= 0
    slots = token_slots.clamp(min=0)
    a = a_stack.double()[slots]                       # [T, n*R, in]
    b = b_stack.double()[slots]                       # [T, out, n*R]
    s = torch.einsum("ti,tri->tr", x.double(), a)
    d = torch.einsum("tr,tor->to", s, b) * mask[:, None]
    return y.double() + d
