"""The rejection sampler alone: greedy acceptance, exactness of the sampled distribution
(first token equals sampling from p, for one-hot and for dense draft distributions), bonus
tokens, per-request seeds, and ragged batches."""
from __future__ import annotations

import torch

from kvserve.sample.metadata import SamplingMetadata
from kvserve.sample.rejection_sampler import RejectionSampler, SpecDecodeMetadata


def _metadata(temps: list[float], **kw) -> SamplingMetadata:
    t = torch.tensor(temps, dtype=torch.float32)
    greedy = t == 0
    return SamplingMetadata(temperature=t, all_greedy=bool(greedy.all()),
                            all_random=bool((~greedy).all()), top_p=kw.get("top_p"),
                            top_k=kw.get("top_k"), min_p=kw.get("min_p"), generators={},
                            max_num_logprobs=kw.get("max_num_logprobs"))


def test_greedy_accepts_prefix_and_adds_bonus() -> None:
    V = 10
    # Request 0: 3 drafts, target argmax 4,5,6 then bonus 7; drafts 4,5,9 -> accept 2, recover 6.
    # Request 1: 2 drafts, all accepted -> bonus. Request 2: no drafts -> plain argmax.
    argmax = [4, 5, 6, 7, 1, 2, 3, 8]
    logits = torch.full((len(argmax), V), -5.0)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    spec = SpecDecodeMetadata.make([3, 2, 0], [4, 5, 9, 1, 2], torch.device("cpu"))
    out = RejectionSampler()(logits, _metadata([0.0] * 8), spec, {})
    assert out.output_token_ids.tolist() == [[4, 5, 6, -1], [1, 2, 3, -1], [8, -1, -1, -1]]
    assert out.num_sampled.tolist() == [3, 3, 1]


def _first_token_counts(p: torch.Tensor, q_draft: torch.Tensor, n: int, dense: bool) -> torch.Tensor:
    """Sample n requests (one draft each) whose draft comes from q; count first tokens."""
    V = p.shape[0]
    gen = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q_draft, n, replacement=True, generator=gen)
    logits = p.log().repeat(2 * n, 1)                    # 2 rows per request: draft + bonus
    spec = SpecDecodeMetadata.make([1] * n, drafts.tolist(), torch.device("cpu"))
    draft_probs = q_draft.repeat(n, 1) if dense else None
    torch.manual_seed(1)
    out = RejectionSampler()(logits, _metadata([1.0] * 2 * n), spec, {}, draft_probs)
    return torch.bincount(out.output_token_ids[:, 0], minlength=V).float()


def _chi2_ok(counts: torch.Tensor, p: torch.Tensor) -> bool:
    expected = p * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    return stat < 30.0     # V=6 -> 5 dof; P(chi2_5 > 30) ~ 1.5e-5


def test_sampled_distribution_is_target_distribution() -> None:
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    q = torch.tensor([0.05, 0.05, 0.1, 0.2, 0.3, 0.3])   # a poor draft
    n = 20000
    assert _chi2_ok(_first_token_counts(p, q, n, dense=True), p)
    # One-hot drafts (n-gram): q is the point mass on each drawn draft.
    assert _chi2_ok(_first_token_counts(p, q, n, dense=False), p)
    # A sampler that took the draft's distribution instead would fail this check.
    assert not _chi2_ok(_first_token_counts(q, q, n, dense=True), p)


def test_seeded_requests_do_not_depend_on_batch() -> None:
    V = 50
    torch.manual_seed(0)
    logits = torch.randn(6, V)
    spec = SpecDecodeMetadata.make([2, 2], [3, 4, 5, 6], torch.device("cpu"))

    def run(seed_b1: int) -> list[int]:
        g0 = torch.Generator().manual_seed(123)
        g1 = torch.Generator().manual_seed(seed_b1)
        out = RejectionSampler()(logits, _metadata([1.0] * 6), spec, {0: g0, 1: g1})
        return out.output_token_ids[0].tolist()

    assert run(1) == run(2) == run(3)


def test_logprobs_per_output_row() -> None:
    V = 8
    logits = torch.randn(3, V)
    greedy = logits.argmax(-1)
    spec = SpecDecodeMetadata.make([2], [int(greedy[0]), int(greedy[1])], torch.device("cpu"))
    out = RejectionSampler()(logits, _metadata([0.0] * 3, max_num_logprobs=2), spec, {})
    assert out.num_sampled.tolist() == [3]
    ref = logits.log_softmax(-1)
    assert out.logprob_token_ids[:, 0].tolist() == greedy.tolist()
    torch.testing.assert_close(out.logprobs[:, 0], ref.gather(1, greedy[:, None])[:, 0])
    assert out.sampled_token_ranks.tolist() == [1, 1, 1]
