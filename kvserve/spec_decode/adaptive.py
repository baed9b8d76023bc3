"""The "never slower" rule: which requests propose drafts after the next step.

It runs in the scheduler (engine core), so every worker rank gets the same decision (a draft
model sharded with TP must run on all ranks alike), in `SchedulerOutput.spec_decode_draft_req_ids`.

Cost model, per batch-size bucket b (1, 2, 3-4, 5-8, ...: the requests in the step), learned
from all-decode steps (steps with a prefill chunk are not measured). A step's time is the
engine loop's period from the previous step's update to this one's: everything drafting adds
(the grammar bitmask of the draft positions, the longer output handling) is in it.

    step time = t0[b] * (1 + c[b] * (draft tokens verified)) + (proposer time)
    t0[b]  median of the last 5 (step time - proposer time) of steps that verified no drafts
           (a median: one slow step, say a load spike, must not move the bar for long)
    c[b]   EMA of (step time - proposer time - t0[b]) / t0[b] / drafts verified, over steps
           with drafts
    p[b]   EMA of proposer time / t0[b] / drafts proposed, over steady steps: every request
           that proposes had its drafts verified in this step. A request that resumes drafting
           (its first drafts, or a probe) makes a draft model catch its KV up over every token
           it missed; that one-off cost is not a draft token's price and would inflate p.
c and p are fractions of the t0 measured beside them: when the host as a whole slows down or
speeds up (a shared host's speed swings by 25% within minutes), t0 follows at once (every step
without drafts measures it) while c and p are only measured while drafting; in seconds, a stale
p against a slower t0 made the target as its own draft look worth drafting again.

A request drafting k tokens whose drafts are accepted at rate a (EMA, weight 0.3, of
accepted / drafted over its drafting steps) adds a*k tokens to a step of B requests and
k*(c + p)*t0 to its time, so it raises the batch's token rate B / t0 exactly when

    a > break_even[b] = B * (c[b] + p[b]).

The rule, per request and step (bar = max(min_acceptance_rate, 1.1 * break_even): drafting
must beat the break-even rate by 10%, a draft that only breaks even is not worth the noise):
1. Batch size: nobody drafts in a step of more than `disable_by_batch_size` requests.
2. Out of reach: when bar > 1, even drafts that are always accepted lose (a proposer as costly
   as the target), so nobody in the step drafts: no first drafts, no probes. A probe would
   make a draft model catch up over every token its request missed, for nothing: with the
   target as its own draft, probes made a 256-token run 11% slower than plain. c and p are
   fractions of t0, so a bucket out of reach stays out while nothing drafts in it: the
   proposer's cost relative to the target's is a property of the two models on this host,
   which a host-wide slow-down or speed-up does not change.
3. A request drafts while its rate a >= bar. A new request starts from the rate of the
   requests before it (an EMA over every verification, weight 0.3): below the bar it waits
   for its first probe, else it drafts; the engine's first request drafts (that is how a is
   learned; so is c while unknown). Without this prior, each request of a proposer that never
   pays (a random draft model) paid one full drafting step to find out again.
4. Probes: a request that stopped drafting drafts once every `probe_interval` of its steps;
   each probe that does not bring a back above the bar doubles its interval (up to 8x), one
   that does resets it. A step whose drafters are all probing drafts one token each (k' = 1):
   one position says whether drafts are accepted again, at a fraction of k positions' cost.
5. t0 is learned from a bucket's first 3 steps (nobody drafts in them: one sample would be one
   step's noise), and refreshed after 64 steps of its bucket by one step in which nobody
   drafts (at most one such step per 64: it gives up one step's drafts in 64).
`min_acceptance_rate` = 0 turns rules 2-5 off: every request drafts whenever it can.

How many tokens the drafting requests propose (num_draft_tokens, one k' <= k per step): the
cost of verifying n draft tokens is not linear in n (probes aside, see rule 4). On a 2-core AVX2 EPYC the step's linears
are memory-bound at 1-2 rows and compute-bound above (tiled bf16 weights: 10.4 / 11.7 / 24.1 ms
at 1 / 2 / 5 rows), so 4 drafts can cost 2.3x a plain step's linears where 1 costs 1.1x. Per bucket the rule keeps
extra[n] (EMA of (step time - proposer time - t0) / t0 over steps that verified n drafts) and,
with each drafting request's per-position acceptance q (EMA of accepted / positions tried: a
draft is tried when every draft before it was accepted), picks the k' maximising

    (B + sum over drafters of q + q^2 + ... + q^k') / (1 + extra(D * k') + p * D * k')

(D drafting requests; extra of an unmeasured n interpolated linearly between measured points
and 0, extrapolated with the last slope). Until every drafter has a q and extra has a point,
k' = k (that is how both are learned); k' < k is then measured and kept only while it wins.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

_RATE_EMA = 0.3       # weight of the newest acceptance-rate sample
_TIME_EMA = 0.2       # weight of the newest step-time sample
_MAX_BACKOFF = 8      # probe interval grows up to this many times probe_interval
_T0_REFRESH = 64      # steps of a bucket after which t0 is measured again
_T0_SAMPLES = 5       # t0 is the median of this many latest samples
_T0_FIRST = 3         # samples a bucket takes before anyone drafts in it
_MARGIN = 1.1         # drafting must beat the break-even rate by this factor


def _ema(old: Optional[float], new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class _ReqState:
    rate: Optional[float] = None      # EMA of accepted / drafted (None: never drafted)
    prior: Optional[float] = None     # until then: the requests before it (rule 3)
    steps_since_draft: int = 0
    interval: int = 0                 # current probe interval (probe_interval * 2^failures)
    probing: bool = False
    accepted: Optional[float] = None  # EMA of drafts accepted per verification
    tried: Optional[float] = None     # EMA of draft positions tried per verification

    @property
    def q(self) -> Optional[float]:
        """Per-position acceptance: P(draft i accepted | drafts before it accepted)."""
        return None if not self.tried else self.accepted / self.tried


@dataclass
class _Bucket:
    t0: Optional[float] = None        # seconds per step without drafts
    t0_samples: list[float] = field(default_factory=list)   # the latest, oldest first
    c: Optional[float] = None         # per verified draft token, in units of t0
    p: Optional[float] = None         # per proposed draft token, in units of t0
    steps_since_t0: int = 0
    last_t0_probe: int = -_T0_REFRESH
    extra: dict[int, float] = field(default_factory=dict)   # n verified drafts -> units of t0

    def extra_time(self, n: int) -> float:
        """Step time over t0 of verifying n drafts, in units of t0: measured, else interpolated linearly
        between measured points (and 0 at n = 0), else extrapolated with the last slope."""
        if n in self.extra:
            return self.extra[n]
        points = sorted([(0, 0.0), *self.extra.items()])
        for (n0, e0), (n1, e1) in zip(points, points[1:]):
            if n0 < n < n1:
                return e0 + (e1 - e0) * (n - n0) / (n1 - n0)
        (n0, e0), (n1, e1) = points[-2], points[-1]
        return e1 + (e1 - e0) / (n1 - n0) * (n - n1)

    def break_even(self, batch_size: int) -> Optional[float]:
        if self.t0 is None or self.c is None:
            return None
        return batch_size * (self.c + (self.p or 0.0))


def _bucket_of(batch_size: int) -> int:
    return 1 << max(batch_size - 1, 0).bit_length()


class SpecDecodeController:
    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: Optional[int],
                 min_acceptance_rate: float, probe_interval: int) -> None:
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.min_acceptance_rate = min_acceptance_rate
        self.probe_interval = probe_interval
        self.adaptive = min_acceptance_rate > 0
        self._state: dict[str, _ReqState] = {}
        self._buckets: dict[int, _Bucket] = {}
        self._step = 0
        self._bar = min_acceptance_rate   # the last step's acceptance bar (for probe results)
        self._recent_rate: Optional[float] = None   # EMA of accepted / drafted, all requests

    # ------------------------------------------------------------------ decide
    def draft_req_ids(self, req_ids: list[str]) -> set[str]:
        """Which of a step's requests propose drafts after it (to verify in the next)."""
        self._step += 1
        batch_size = len(req_ids)
        if self.disable_by_batch_size is not None and batch_size > self.disable_by_batch_size:
            return set()
        if not self.adaptive:
            return set(req_ids)
        bucket = self._buckets.setdefault(_bucket_of(batch_size), _Bucket())
        bucket.steps_since_t0 += 1
        if len(bucket.t0_samples) < _T0_FIRST or (
                bucket.steps_since_t0 > _T0_REFRESH
                and self._step - bucket.last_t0_probe >= _T0_REFRESH):
            bucket.last_t0_probe = self._step   # the next step verifies nothing: it measures t0
            return set()
        even = bucket.break_even(batch_size)
        self._bar = max(self.min_acceptance_rate, _MARGIN * even if even is not None else 0.0)
        if self._bar > 1.0:
            return set()   # out of reach: not even full acceptance pays (rule 2)
        out = set()
        for rid in req_ids:
            st = self._state.get(rid)
            if st is None:   # starts from the requests before it (rule 3)
                st = self._state[rid] = _ReqState(prior=self._recent_rate,
                                                  interval=self.probe_interval)
            st.steps_since_draft += 1
            rate = st.rate if st.rate is not None else st.prior
            if rate is None or rate >= self._bar:
                st.probing = False
            elif st.steps_since_draft >= st.interval:
                st.probing = True
            else:
                continue
            st.steps_since_draft = 0
            out.add(rid)
        return out

    def num_draft_tokens(self, batch_size: int, drafters: set[str]) -> int:
        """How many tokens each request in `drafters` proposes after this step (see the
        module docstring); k while the costs or a drafter's acceptance are not known yet."""
        if not self.adaptive or not drafters or self.k == 1:
            return self.k
        if all(r in self._state and self._state[r].probing for r in drafters):
            return 1   # probes only (rule 4)
        bucket = self._buckets.get(_bucket_of(batch_size))
        qs = [self._state[r].q if r in self._state else None for r in drafters]
        if bucket is None or bucket.t0 is None or not bucket.extra or None in qs:
            return self.k
        d, p = len(drafters), bucket.p or 0.0
        best_k, best_rate, gain = self.k, -1.0, 0.0
        for k in range(1, self.k + 1):
            gain += sum(q ** k for q in qs)
            cost = 1.0 + max(bucket.extra_time(d * k), 0.0) + p * d * k
            rate = (batch_size + gain) / cost
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    # ------------------------------------------------------------------ learn
    def record(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        """A request's drafts were verified: update its acceptance rate (and probe interval)."""
        if num_drafted <= 0:
            return
        st = self._state.setdefault(req_id, _ReqState(interval=self.probe_interval))
        st.rate = _ema(st.rate, num_accepted / num_drafted, _RATE_EMA)
        self._recent_rate = _ema(self._recent_rate, num_accepted / num_drafted, _RATE_EMA)
        st.accepted = _ema(st.accepted, num_accepted, _RATE_EMA)
        st.tried = _ema(st.tried, num_accepted + (num_accepted < num_drafted), _RATE_EMA)
        if st.rate >= self._bar:
            st.interval = self.probe_interval
        elif st.probing:
            st.interval = min(2 * st.interval, _MAX_BACKOFF * self.probe_interval)
        st.probing = False

    def observe_step(self, batch_size: int, num_verified: int, num_proposed: int,
                     step_time: float, propose_time: float, num_resumed: int = 0) -> None:
        """The wall time of an all-decode step and the worker's proposer time in it;
        `num_resumed`: requests that proposed without having drafts verified in the step
        (their proposer caught up over the tokens they missed)."""
        if not self.adaptive or batch_size == 0:
            return
        bucket = self._buckets.setdefault(_bucket_of(batch_size), _Bucket())
        target_time = max(step_time - propose_time, 0.0)
        if num_verified == 0:
            bucket.t0_samples = bucket.t0_samples[1 - _T0_SAMPLES:] + [target_time]
            bucket.t0 = sorted(bucket.t0_samples)[(len(bucket.t0_samples) - 1) // 2]
            bucket.steps_since_t0 = 0
        elif bucket.t0:   # (a t0 of 0 has no fractions)
            extra = max(target_time - bucket.t0, 0.0) / bucket.t0
            bucket.c = _ema(bucket.c, extra / num_verified, _TIME_EMA)
            bucket.extra[num_verified] = _ema(bucket.extra.get(num_verified), extra, _TIME_EMA)
        if num_proposed > 0 and num_resumed == 0 and bucket.t0:
            bucket.p = _ema(bucket.p, propose_time / bucket.t0 / num_proposed, _TIME_EMA)

    def drop(self, req_id: str) -> None:
        self._state.pop(req_id, None)
