"""RMSNorm, computed in float32 like Hugging Face's LlamaRMSNorm and cast back.

The arithmetic is kvserve.ops.fused's (a C++ kernel on CPU, else torch ops)."""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from kvserve.ops.fused import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Normalise `x` over its last dim.

        With `residual`, first add it (in the model dtype, as HF does) and return
        (normed, new_residual), so a decoder layer threads the residual stream through norms.
        The kernel then works in place: `x` and `residual` are overwritten (with normed and
        new_residual); use the returned tensors, not the inputs.
        """
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
