"""Speculative decoding: proposers (n-gram lookup, draft model, EAGLE head) behind one small
interface, the adaptive rule that decides who drafts, and the acceptance metrics. Final tokens
are chosen by kvserve.sample.rejection_sampler."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

    from kvserve.config import KVServeConfig
    from kvserve.spec_decode.adaptive import SpecDecodeController
    from kvserve.spec_decode.base import Proposer
    from kvserve.spec_decode.config import SpeculativeConfig
    from kvserve.spec_decode.runner import SpecDecodeRunner


def make_spec_decode_controller(
        spec: Optional["SpeculativeConfig"]) -> Optional["SpecDecodeController"]:
    """The scheduler-side adaptive rule (None without speculation)."""
    if spec is None:
        return None
    from kvserve.spec_decode.adaptive import SpecDecodeController
    return SpecDecodeController(spec.num_speculative_tokens, spec.disable_by_batch_size,
                                spec.min_acceptance_rate, spec.probe_interval)


def make_spec_decode_runner(config: "KVServeConfig",
                            device: "torch.device") -> Optional["SpecDecodeRunner"]:
    """The runner-side speculative decoding for `config` (None without speculation)."""
    spec = config.speculative_config
    if spec is None:
        return None
    from kvserve.spec_decode.runner import SpecDecodeRunner
    proposer: "Proposer"
    if spec.method == "ngram":
        from kvserve.spec_decode.ngram import NgramProposer
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max,
                                 spec.num_speculative_tokens)
    elif spec.method == "eagle":
        from kvserve.spec_decode.eagle import EagleProposer
        proposer = EagleProposer(config, device)
    else:
        from kvserve.spec_decode.draft_model import DraftModelProposer
        proposer = DraftModelProposer(config, device)
    return SpecDecodeRunner(spec, config.model_config.max_model_len, device, proposer)
