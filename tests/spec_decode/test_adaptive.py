"""The adaptive rule (spec_decode/adaptive.py) on given step times: the break-even acceptance
rate comes from the measured costs, probes back off, t0 is measured by a step without drafts."""
from __future__ import annotations

from kvserve.spec_decode.adaptive import SpecDecodeController


def _warm(ctl: SpecDecodeController, ids: list[str], t0: float, per_token: float,
          k: int = 4) -> None:
    """One step without drafts (t0), then one with k drafts per request (t0 + cost)."""
    assert ctl.draft_req_ids(ids) == set()           # t0 unknown: nobody drafts
    ctl.observe_step(len(ids), 0, 0, t0, 0.0)
    ctl.observe_step(len(ids), k * len(ids), 0, t0 + per_token * k * len(ids), 0.0)


def _run(ctl: SpecDecodeController, rid: str, rate: float, steps: int) -> list[int]:
    """Steps at which `rid` drafted; each drafting step accepts `rate` of 4 drafts."""
    drafted = []
    for step in range(steps):
        if rid in ctl.draft_req_ids([rid]):
            drafted.append(step)
            ctl.record(rid, 4, round(4 * rate))
    return drafted


def test_break_even_from_step_costs() -> None:
    # Batch 1: a draft token costs 10% of a step: acceptance 50% pays, 0% does not.
    ctl = SpecDecodeController(4, None, min_acceptance_rate=0.01, probe_interval=8)
    _warm(ctl, ["a"], t0=0.010, per_token=0.001)
    assert len(_run(ctl, "good", 0.5, 40)) == 40
    bad = _run(ctl, "bad", 0.0, 60)
    # Drafts on its first step (no history yet), then probes after 8, 16, 32 steps (each
    # failed probe doubles the interval).
    assert bad == [0, 8, 24, 56], bad
    # The proposer's own time counts too: 60% of a step per draft token beats 50% acceptance.
    ctl2 = SpecDecodeController(4, None, min_acceptance_rate=0.01, probe_interval=8)
    _warm(ctl2, ["a"], t0=0.010, per_token=0.001)
    ctl2.observe_step(1, 4, 4, 0.010 + 0.004 + 0.024, 0.024)
    assert len(_run(ctl2, "good", 0.5, 40)) < 10


def test_large_batch_stops_paying() -> None:
    # 32 requests, compute-bound: one draft token costs what one decode token does (t0 / 32),
    # so even 75% acceptance loses; the same per-token cost at batch 1 pays.
    ids = [f"r{i}" for i in range(32)]
    ctl = SpecDecodeController(4, None, min_acceptance_rate=0.01, probe_interval=8)
    _warm(ctl, ids, t0=0.032, per_token=0.001)
    _warm(ctl, ["x"], t0=0.032, per_token=0.001)
    for rid in ids:
        ctl.record(rid, 4, 3)
    assert ctl.draft_req_ids(ids) == set()
    ctl.record("x", 4, 3)
    assert ctl.draft_req_ids(["x"]) == {"x"}


def test_batch_cap_and_rule_off() -> None:
    ctl = SpecDecodeController(4, 2, min_acceptance_rate=0.0, probe_interval=8)
    assert ctl.draft_req_ids(["a", "b", "c"]) == set()
    ctl.record("a", 4, 0)
    assert ctl.draft_req_ids(["a", "b"]) == {"a", "b"}   # min_acceptance_rate 0: rule off
