"""The pieces of multi-LoRA on their own: the grouped shrink/expand against a float64
token-by-token reference, the scheduler's adapter limit and load-at-add-time (the hook's
load callable records what it was asked), and the --lora-modules parser."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.lora.punica import LoRAMapping, add_lora, add_lora_reference


def test_grouped_shrink_expand_matches_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    S, R, T, d_in, d_out = 3, 12, 37, 48, 40
    a = torch.randn(S, R, d_in, generator=gen)
    b = torch.randn(S, d_out, R, generator=gen)
    x = torch.randn(T, d_in, generator=gen)
    y = torch.randn(T, d_out, generator=gen)
    # Contiguous runs (a request's tokens), a slot split in two runs, and base tokens.
    slots = np.array([2] * 5 + [-1] * 4 + [0] * 10 + [2] * 3 + [1] * 8 + [-1] * 7)
    mapping = LoRAMapping()
    mapping.set(slots, torch.device("cpu"))
    kinds = {slot: isinstance(g, slice) for slot, g in mapping.groups}
    assert kinds == {0: True, 1: True, 2: False}
    want = add_lora_reference(y, x, a, b, torch.from_numpy(slots))
    got = y.clone()
    add_lora(got, x, a, b, mapping.groups)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[5:9], y[5:9])     # base tokens untouched


def test_torch_path_takes_bf16_stacks_beside_float32_x() -> None:
    """add_lora_torch (kernels off, or past the kernel's token limit) with bfloat16 stacks
    (--lora-dtype bfloat16, or 16-bit weights with float32 math) and float32 x / y: the
    reference on the same bf16 values, y stays float32."""
    from kvserve.lora.punica import add_lora_torch

    gen = torch.Generator().manual_seed(1)
    a = torch.randn(2, 8, 32, generator=gen).bfloat16()
    b = torch.randn(2, 24, 8, generator=gen).bfloat16()
    x, y = torch.randn(11, 32, generator=gen), torch.randn(11, 24, generator=gen)
    slots = np.array([1] * 4 + [-1] * 3 + [0] * 4)
    mapping = LoRAMapping()
    mapping.set(slots, torch.device("cpu"))
    want = add_lora_reference(y, x.bfloat16().float(), a.float(), b.float(),
                              torch.from_numpy(slots))
    got = y.clone()
    add_lora_torch(got, x, a, b, mapping.groups)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=5e-2)


def test_scheduler_admits_at_most_max_loras_adapters() -> None:
    from kvserve.config import CacheConfig, SchedulerConfig
    from kvserve.core.request import Request
    from kvserve.core.scheduler import Scheduler
    from kvserve.lora.request import LoRARequest
    from kvserve.lora.scheduling import LoRAScheduling
    from kvserve.sampling_params import SamplingParams

    loaded: list[int] = []           # what the hook asked the workers to load, in order
    hook = LoRAScheduling(2, lambda lora: loaded.append(lora.lora_int_id))
    sched = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1000,
                                      max_model_len=64),
                      CacheConfig(block_size=4, num_gpu_blocks_override=100, num_blocks=100),
                      hooks=[hook])
    loras = [LoRARequest(f"a{i}", i, f"/x/{i}") for i in (1, 2, 3)]
    order = [loras[0], loras[1], loras[2], None, loras[0]]
    for i, lora in enumerate(order):
        sched.add_request(Request(str(i), [1, 2, 3, 4, 5], SamplingParams(max_tokens=4),
                                  lora_request=lora))
    assert loaded == [1, 2, 3, 1]    # at add time, before any step
    out = sched.schedule()
    # The third adapter waits; the base request and adapter 1's second request behind it run.
    assert set(out.num_scheduled_tokens) == {"0", "1", "3", "4"}
    assert [r.request_id for r in sched.waiting] == ["2"]


def test_failed_adapter_load_fails_only_that_request() -> None:
    from kvserve.config import CacheConfig, SchedulerConfig
    from kvserve.core.request import Request
    from kvserve.core.scheduler import Scheduler
    from kvserve.lora.request import LoRARequest
    from kvserve.lora.scheduling import LoRAScheduling
    from kvserve.sampling_params import SamplingParams

    def load(lora: LoRARequest) -> None:
        raise ValueError("adapter_model.safetensors vanished")

    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100, max_model_len=64),
                      CacheConfig(block_size=4, num_gpu_blocks_override=20, num_blocks=20),
                      hooks=[LoRAScheduling(1, load)])
    sched.add_request(Request("bad", [1, 2, 3], SamplingParams(max_tokens=2),
                              lora_request=LoRARequest("x", 1, "/nope")))
    sched.add_request(Request("ok", [1, 2, 3], SamplingParams(max_tokens=2)))
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"ok"}
    from kvserve.core.sched_output import ModelRunnerOutput
    res = sched.update_from_output(out, ModelRunnerOutput(req_ids=["ok"], sampled_token_ids=[[7]]))
    failed = [o for o in res.outputs if o.request_id == "bad"]
    assert failed and str(failed[0].finish_reason) == "error"


def test_parse_lora_modules() -> None:
    from kvserve.lora.request import LoRAModulePath, parse_lora_modules
    got = parse_lora_modules(["a=/p/a", '{"name": "b", "path": "/p/b", "base_model_name": "m"}'])
    assert got == [LoRAModulePath("a", "/p/a"), LoRAModulePath("b", "/p/b", "m")]
    for bad in (["a"], ["=/p"], ['{"name": "b"}'], ["a=/x", "a=/y"]):
        with pytest.raises(ValueError, match="lora-modules"):
            parse_lora_modules(bad)


def test_embedding_and_lm_head_lora_match_reference() -> None:
    """LoRAEmbedding (A^T as a lookup table, then B) and LoRALogits (on the scored rows only,
    each row's slot from its token index) against a float64 token-by-token reference."""
    from kvserve.lora.layers import LogitsRows, LoRAEmbedding, LoRALogits
    from kvserve.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding

    gen = torch.Generator().manual_seed(1)
    V, H, R, S = 50, 16, 8, 3
    embed, head = VocabParallelEmbedding(V, H), ParallelLMHead(V, H)
    for m in (embed, head):
        m.weight.data.copy_(torch.randn(V, H, generator=gen))
    slots = np.array([1, 1, -1, 0, 0, 0, 2, -1, 1, 1])    # slot 1 in two runs
    mapping, rows = LoRAMapping(), LogitsRows()
    mapping.set(slots, torch.device("cpu"))
    rows.token_slots = slots
    embed.lora = LoRAEmbedding(embed, S, R, mapping, torch.float32)
    head.lora = LoRALogits(head, S, R, rows, torch.float32)
    weights = {}
    for slot, r in ((0, 8), (1, 3), (2, 5)):
        ea, eb = torch.randn(r, V, generator=gen), torch.randn(H, r, generator=gen)
        ha, hb = torch.randn(r, H, generator=gen), torch.randn(V, r, generator=gen)
        embed.lora.set_slot(slot, [(ea, eb)])
        head.lora.set_slot(slot, [(ha, hb)] if slot != 2 else [None])   # 2: no lm_head LoRA
        weights[slot] = (ea.double(), eb.double(), ha.double(), hb.double())
    ids = torch.randint(0, V, (len(slots),), generator=gen)
    got = embed(ids)
    scored = np.array([1, 2, 5, 6, 9])                     # the rows a step samples
    rows.rows = scored
    hidden = torch.randn(len(scored), H, generator=gen)
    logits = head.compute_logits(hidden)
    want_e = embed.weight.double()[ids].clone()
    want_l = hidden.double() @ head.weight.double().t()
    for t, slot in enumerate(slots):
        if slot >= 0:
            want_e[t] += weights[slot][0][:, ids[t]] @ weights[slot][1].t()
    for i, t in enumerate(scored):
        if slots[t] in (0, 1):
            want_l[i] += weights[slots[t]][3] @ (weights[slots[t]][2] @ hidden[i].double())
    torch.testing.assert_close(got.double(), want_e, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(logits.double(), want_l, rtol=1e-5, atol=1e-4)
    assert rows.rows is None        # used up: the next call must set its own rows
