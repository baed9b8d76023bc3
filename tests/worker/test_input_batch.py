"""InputBatch's seeded generators: each seeded request's generator is seeded from (request
seed, output position), so its draws differ from position to position and are the same in any
batch; unseeded requests get none; speculative decoding's per-position metadata carries none
(its rejection sampler takes seeded_generators per request)."""
from __future__ import annotations

import numpy as np
import torch

from kvserve.core.sched_output import NewRequestData
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import InputBatch, _position_seed


def make_batch() -> InputBatch:
    ib = InputBatch(max_num_reqs=4, max_model_len=64, max_blocks_per_req=4, vocab_size=100,
                    device=torch.device("cpu"))
    for i, seed in enumerate([None, 7, 7]):
        ib.add_request(NewRequestData(
            req_id=f"r{i}", token_ids=list(range(10 + i)), num_prompt_tokens=8,
            sampling_params=SamplingParams(temperature=1.0, seed=seed), block_ids=[i],
            num_computed_tokens=0))
    return ib


def first_draw(gen: torch.Generator) -> float:
    return torch.rand(1, generator=gen).item()


def test_seeded_generators_follow_seed_and_output_position() -> None:
    ib = make_batch()
    gens = ib.seeded_generators(np.array([0, 1, 2]))
    assert sorted(gens) == [1, 2]                                  # r0 has no seed
    # r1 has 3 output tokens, r2 has 4: same seed, other positions, other draws.
    draws = {i: first_draw(g) for i, g in gens.items()}
    for i, n_out in ((1, 3), (2, 4)):
        ref = torch.Generator().manual_seed(_position_seed(7, n_out))
        assert draws[i] == first_draw(ref)
    assert draws[1] != draws[2]
    ib.append_token(1, 5)                                          # the next position
    assert first_draw(ib.seeded_generators(np.array([1]))[0]) == draws[2]


def test_spec_metadata_carries_no_generators() -> None:
    ib = make_batch()
    rows = np.array([1, 1, 2])
    meta = ib.make_sampling_metadata(rows, [[], [3], []])
    assert meta.generators == {}
    assert sorted(ib.make_sampling_metadata(rows).generators) == [0, 1, 2]


def _new(rid: str, **params: object) -> NewRequestData:
    return NewRequestData(req_id=rid, token_ids=list(range(10)), num_prompt_tokens=8,
                          sampling_params=SamplingParams(**params), block_ids=[0],
                          num_computed_tokens=0)


def test_settings_reused_while_batch_unchanged_and_rebuilt_when_it_changes() -> None:
    # The settings part of the metadata is built once per (membership, rows): the same rows
    # twice share it; a request leaving and another taking its row (same rows array) must not
    # get the old request's settings, nor a reordered rows array the old order's.
    ib = InputBatch(max_num_reqs=4, max_model_len=64, max_blocks_per_req=4, vocab_size=100,
                    device=torch.device("cpu"))
    ib.add_request(_new("a", temperature=0.5, top_k=5))
    ib.add_request(_new("b", temperature=0.0))
    rows = np.array([0, 1])
    m1, m2 = ib.make_sampling_metadata(rows), ib.make_sampling_metadata(rows)
    assert m1.temperature is m2.temperature
    assert m1.temperature.tolist() == [0.5, 0.0] and m1.top_k.tolist() == [5, 0]
    assert ib.make_sampling_metadata(np.array([1, 0])).temperature.tolist() == [0.0, 0.5]
    ib.make_sampling_metadata(rows)
    ib.remove_requests({"b"})
    ib.add_request(_new("c", temperature=0.75, presence_penalty=1.0, min_tokens=4,
                        stop_token_ids=[7]))
    m3 = ib.make_sampling_metadata(rows)
    assert m3.temperature.tolist() == [0.5, 0.75]
    assert m3.presence_penalties.tolist() == [0.0, 1.0]
    # What moves with the outputs is built per step: c has 2 outputs of its min_tokens 4.
    assert m3.min_tokens == {1: {7}} and m3.output_token_ids[1] == [8, 9]
    ib.append_token(1, 3)
    ib.append_token(1, 4)
    m4 = ib.make_sampling_metadata(rows)
    assert m4.min_tokens == {} and m4.output_token_ids[1] == [8, 9, 3, 4]
    assert m4.temperature is m3.temperature
