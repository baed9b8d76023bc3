"""LoRAModelManager.prepare_step reuses the last step's token -> slot mapping while the step is
the same (a decode loop): these steps change one input each and check the mapping against
one computed from scratch, so a stale reuse fails. Also: the scheduler's per-request hook
calls skip the hooks that do not override them (LoRA's)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvserve import LLM, LoRARequest


@pytest.fixture(scope="module")
def manager(tiny_llama: str):
    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              multiprocessing=False)
    yield llm.llm_engine.engine_core.engine_core.model_executor.worker.model_runner.lora_manager
    llm.shutdown()


def _step(finished=(), new=()) -> SimpleNamespace:
    """A SchedulerOutput as update_requests reads it: new = [(req_id, LoRARequest | None)]."""
    return SimpleNamespace(finished_req_ids=set(finished), preempted_req_ids=set(),
                           scheduled_new_reqs=[SimpleNamespace(req_id=r, lora_request=lora)
                                               for r, lora in new])


def _expected(mgr, req_ids: list[str], qlens: list[int]) -> np.ndarray:
    slot = {lora_id: s for s, lora_id in enumerate(mgr._slots) if lora_id is not None}
    per_req = [slot[mgr._req_lora[r]] if r in mgr._req_lora else -1 for r in req_ids]
    return np.repeat(np.array(per_req, np.int64), qlens)


def _check(mgr, req_ids: list[str], qlens: list[int]) -> None:
    mgr.prepare_step(req_ids, np.array(qlens, np.int64))
    want = _expected(mgr, req_ids, qlens)
    np.testing.assert_array_equal(mgr.mapping.groups.token_slots.cpu().numpy(), want)
    np.testing.assert_array_equal(mgr.logits_rows.token_slots, want)
    covered = np.full(len(want), -1)
    for slot, g in mgr.mapping.groups:
        covered[g.cpu().numpy() if not isinstance(g, slice) else g] = slot
    np.testing.assert_array_equal(covered, want)
    if mgr.sorted_tokens.perm is not None:       # interleaved adapters: slot by slot
        perm = mgr.sorted_tokens.perm.cpu().numpy()
        assert sorted(perm.tolist()) == np.flatnonzero(want >= 0).tolist()
        for slot, g in mgr.sorted_tokens.groups:
            assert (want[perm[g]] == slot).all()


def test_prepare_step_reuses_only_an_unchanged_step(manager, lora_adapters) -> None:
    mgr = manager
    a1 = LoRARequest("all7", 1, lora_adapters["all7"])
    a2 = LoRARequest("qv_down_rs", 2, lora_adapters["qv_down_rs"])
    a3 = LoRARequest("kogu", 3, lora_adapters["kogu"])
    for lora in (a1, a2, a3):
        mgr.add_adapter(lora)
    mgr.update_requests(_step(new=[("a", a1), ("b", None), ("c", a2), ("d", a1)]))
    ids = ["a", "b", "c", "d"]
    _check(mgr, ids, [1, 1, 1, 1])
    groups = mgr.mapping.groups
    _check(mgr, list(ids), [1, 1, 1, 1])             # the same step: reused as it is
    assert mgr.mapping.groups is groups
    _check(mgr, ["c", "a", "b", "d"], [1, 1, 1, 1])   # reordered
    _check(mgr, ["c", "a", "b", "d"], [3, 1, 2, 1])   # other query lengths
    _check(mgr, ["c", "a", "b", "d"], [3, 1, 2, 1])
    # Request "a" finishes and a new request reuses its id with another adapter; "d" needs
    # adapter 3 now: the same ids and lengths, other slots.
    mgr.update_requests(_step(finished=["a", "d"], new=[("a", a2), ("d", a3)]))
    _check(mgr, ["c", "a", "b", "d"], [3, 1, 2, 1])
    # An adapter removed while its requests run: its slot is emptied, the step loads it again.
    mgr.remove_adapter(3)
    _check(mgr, ["c", "a", "b", "d"], [3, 1, 2, 1])
    assert 3 in mgr._slots
    # Something else set the mapping (a CUDA-graph capture, then clear()): rebuilt.
    mgr.mapping.clear()
    _check(mgr, ["c", "a", "b", "d"], [3, 1, 2, 1])
    # Every request finishes: base only.
    mgr.update_requests(_step(finished=["a", "b", "c", "d"]))
    mgr.prepare_step(["e"], np.array([2]))
    assert not mgr.mapping.groups
    np.testing.assert_array_equal(mgr.logits_rows.token_slots, [-1, -1])


def test_scheduler_skips_hooks_without_per_request_work() -> None:
    from kvserve.config import CacheConfig, SchedulerConfig
    from kvserve.core.scheduler import Scheduler
    from kvserve.core.sched_hooks import SchedulerHook
    from kvserve.lora.scheduling import LoRAScheduling

    class Drafts(SchedulerHook):
        def draft_tokens(self, request, num_new_tokens, budget):
            return []

    lora, drafts = LoRAScheduling(2, lambda lora: None), Drafts()
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100,
                                      max_model_len=64),
                      CacheConfig(block_size=4, num_gpu_blocks_override=10, num_blocks=10),
                      hooks=[lora, drafts])
    assert sched._draft_hooks == [drafts] and sched._update_hooks == []
