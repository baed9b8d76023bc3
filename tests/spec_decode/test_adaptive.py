"""The adaptive rule (spec_decode/adaptive.py) on given step times: the break-even acceptance
rate comes from the measured costs, probes back off, t0 is measured by a step without drafts."""
from __future__ import annotations

from kvserve.spec_decode.adaptive import SpecDecodeController


def _warm(ctl: SpecDecodeController, ids: list[str], t0: float, per_token: float,
          k: int = 4) -> None:
    """Three steps without drafts (t0), then one with k drafts per request (t0 + cost)."""
    for _ in range(3):
        assert ctl.draft_req_ids(ids) == set()       # t0 not yet known: nobody drafts
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
    # failed probe doubles the interval); step 24 (the bucket's 65th) measures t0 instead.
    assert bad == [0, 8, 25, 57], bad
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


def _simulate(ctl: SpecDecodeController, ids: list[str], steps: int, *, t0: float, c: float,
              p: float, catch_up: float, rate: float, k: int = 3,
              missed0: int = 0, slow_step: int = -1) -> tuple[float, list[int]]:
    """The engine loop on a synthetic cost model, fed to the controller as the scheduler does.
    A step verifies the drafts proposed after the previous one (t0 + c per draft) and then
    proposes for the requests the rule picked: p per draft token, plus `catch_up` per token a
    request missed since it last proposed (a draft model's KV catch-up; `missed0` tokens at
    the start: the prompt). Every draft is accepted at `rate`; step `slow_step` (a load spike)
    takes 3x as long. Returns (tokens per second, the steps in which drafts were verified)."""
    verify: set[str] = set()
    missed = dict.fromkeys(ids, missed0)
    clock = tokens = 0.0
    verified_steps = []
    for step in range(steps):
        drafters = ctl.draft_req_ids(ids)
        target = (3 if step == slow_step else 1) * t0 + c * k * len(verify)
        propose = sum(k * p + catch_up * missed[r] for r in drafters)
        ctl.observe_step(len(ids), k * len(verify), k * len(drafters), target + propose, propose,
                         num_resumed=len(drafters - verify))
        accepted = round(rate * k)
        for rid in ids:
            produced = 1 + (accepted if rid in verify else 0)
            tokens += produced
            missed[rid] = 0 if rid in drafters else missed[rid] + produced
        for rid in verify:
            ctl.record(rid, k, accepted)
        if verify:
            verified_steps.append(step)
        clock += target + propose
        verify = drafters
    return tokens / clock, verified_steps


def test_draft_as_costly_as_target_stops_for_good() -> None:
    # The target as its own draft (every draft accepted): a draft token costs a target step
    # (p = t0), so even full acceptance loses and the request must stop drafting at once and
    # not probe: each probe would re-read every token it missed (5 ms each, 12% of a step),
    # which made the old rule 11% slower than plain. A new request in the bucket never drafts.
    costs = dict(t0=0.040, c=0.002, p=0.042, catch_up=0.005, rate=1.0)
    ctl = SpecDecodeController(3, 4, min_acceptance_rate=0.25, probe_interval=16)
    _, warm_up = _simulate(ctl, ["warm"], 8, missed0=32, **costs)
    assert warm_up, "a request with no history drafts: that is how the costs are learned"
    tok_s, verified = _simulate(ctl, ["timed"], 256, missed0=32, **costs)
    assert verified == [], verified
    assert tok_s >= 0.97 / costs["t0"], tok_s * costs["t0"]


def test_draft_that_pays_keeps_drafting_despite_catch_up() -> None:
    # A draft model a fifth of the target: 80% acceptance pays ~1.7x. The first drafts must
    # catch the draft's KV up over a 512-token prompt (0.5 s): a one-off, not the price of a
    # draft token, so drafting must go on in every step but those that measure t0 (the first
    # 3, then one per 64) and the first drafts'.
    costs = dict(t0=0.040, c=0.002, p=0.008, catch_up=0.001, rate=0.8)
    ctl = SpecDecodeController(3, 4, min_acceptance_rate=0.25, probe_interval=16)
    tok_s, verified = _simulate(ctl, ["r"], 256, missed0=512, **costs)
    assert len(verified) >= 256 - 3 - 1 - 256 // 64, len(verified)
    assert tok_s >= 1.5 / costs["t0"], tok_s * costs["t0"]


def test_one_slow_step_does_not_bring_drafting_back() -> None:
    # Out of reach as above; then one step without drafts takes 3x as long (a load spike).
    # That must not make t0 look large enough for drafting to pay (an EMA of t0 did: the new
    # request drafted, and kept drafting, since t0 is then only measured every 64 steps).
    costs = dict(t0=0.040, c=0.002, p=0.042, catch_up=0.005, rate=1.0)
    ctl = SpecDecodeController(3, 4, min_acceptance_rate=0.25, probe_interval=16)
    _simulate(ctl, ["warm"], 8, missed0=32, **costs)
    ctl.observe_step(1, 0, 0, 3 * costs["t0"], 0.0)
    _, verified = _simulate(ctl, ["timed"], 128, missed0=32, **costs)
    assert verified == [], verified
    # The same spike as a new bucket's first sample: t0 is not taken from one step.
    ctl = SpecDecodeController(3, 4, min_acceptance_rate=0.25, probe_interval=16)
    _simulate(ctl, ["warm"], 8, missed0=32, slow_step=0, **costs)
    _, verified = _simulate(ctl, ["timed"], 128, missed0=32, **costs)
    assert verified == [], verified


def _verified(ctl: SpecDecodeController, extra: dict[int, float], t0: float) -> None:
    """One batch-1 step per entry: n drafts verified in t0 + extra[n]."""
    for n, e in extra.items():
        ctl.observe_step(1, n, 0, t0 + e, 0.0)


def test_fewer_drafts_when_verification_is_compute_bound() -> None:
    # bf16 weights on the AVX2 EPYC: a plain step 14 ms, verifying 4 drafts 12 ms more (the
    # linears turn compute-bound above 2 rows), 2 drafts 4.6 ms more. Acceptance 2 of 4 each
    # time: per position q = 2/3. 4 drafts: 2.6 tokens / 26 ms; 2 drafts: 2.1 / 18.6 ms.
    ctl = SpecDecodeController(4, None, min_acceptance_rate=0.01, probe_interval=8)
    _warm(ctl, ["r"], t0=0.014, per_token=0.003)          # extra[4] = 12 ms
    assert ctl.num_draft_tokens(1, {"r"}) == 4            # r's acceptance not known yet
    for _ in range(5):
        ctl.record("r", 4, 2)
    # Only extra[4] measured: 2 drafts, interpolated at 6 ms, already look better.
    assert ctl.num_draft_tokens(1, {"r"}) == 2
    _verified(ctl, {2: 0.0046}, t0=0.014)
    assert ctl.num_draft_tokens(1, {"r"}) == 2            # measured: stays
    # Memory-bound verification (float32 here: ~1.9 ms per draft token, linear): 4 drafts.
    lin = SpecDecodeController(4, None, min_acceptance_rate=0.01, probe_interval=8)
    _warm(lin, ["r"], t0=0.022, per_token=0.0019)
    for _ in range(5):
        lin.record("r", 4, 2)
    assert lin.num_draft_tokens(1, {"r"}) == 4
    _verified(lin, {2: 0.0038}, t0=0.022)
    assert lin.num_draft_tokens(1, {"r"}) == 4
    # Full acceptance pays for all k even at the compute-bound costs; the rule off keeps k.
    for _ in range(20):
        ctl.record("r", 4, 4)
    assert ctl.num_draft_tokens(1, {"r"}) == 4
    off = SpecDecodeController(4, None, min_acceptance_rate=0.0, probe_interval=8)
    assert off.num_draft_tokens(1, {"r"}) == 4


def test_host_slowing_down_does_not_bring_drafting_back() -> None:
    # The target as its own draft, out of reach; then the whole host slows down by 30% (a
    # shared host's neighbours): t0 follows at once, the proposer's cost is only measured
    # while drafting. Kept in seconds, the stale proposer cost against the slower t0 made full
    # acceptance look worth it again; as a fraction of t0 it does not.
    costs = dict(t0=0.040, c=0.002, p=0.042, catch_up=0.005, rate=1.0)
    ctl = SpecDecodeController(3, 4, min_acceptance_rate=0.25, probe_interval=16)
    _simulate(ctl, ["warm"], 8, missed0=32, **costs)
    slower = {k: (1.3 * v if k != "rate" else v) for k, v in costs.items()}
    _, verified = _simulate(ctl, ["timed"], 128, missed0=32, **slower)
    assert verified == [], verified


def test_new_request_starts_from_the_requests_before_it() -> None:
    # Drafts never accepted (a random draft model): the first request learns that with one
    # full drafting step; the requests after it start from that and only probe, one token at
    # a time. A proposer that pays again is taken up by the next request's first probe.
    ctl = SpecDecodeController(4, None, min_acceptance_rate=0.01, probe_interval=8)
    _warm(ctl, ["a"], t0=0.010, per_token=0.001)
    assert ctl.draft_req_ids(["first"]) == {"first"}
    assert ctl.num_draft_tokens(1, {"first"}) == 4
    ctl.record("first", 4, 0)
    ctl.drop("first")
    probes = []
    for step in range(20):
        if ctl.draft_req_ids(["next"]):
            probes.append((step, ctl.num_draft_tokens(1, {"next"})))
            ctl.record("next", 1, 0)
    assert probes == [(7, 1)], probes      # its first probe after probe_interval steps
    ctl.drop("next")
    # A request whose probe is accepted drafts again (k while its per-position rate is new).
    for step in range(8):
        if ctl.draft_req_ids(["back"]):
            assert ctl.num_draft_tokens(1, {"back"}) == 1
            ctl.record("back", 1, 1)
    assert ctl.draft_req_ids(["back"]) == {"back"}
    # After requests that were accepted, a new request drafts from its first step.
    for _ in range(6):
        ctl.record("back", 4, 4)
    assert ctl.draft_req_ids(["new"]) == {"new"}
