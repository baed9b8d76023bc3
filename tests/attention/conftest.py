"""Triton kernels run natively where a GPU is, and under Triton's CPU interpreter elsewhere.

TRITON_INTERPRET must be set before the kernels are defined (kvserve.attention.ops is imported
lazily, by the tests and by the TRITON_ATTN backend), so it is set when this conftest loads.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@pytest.fixture(scope="session")
def device() -> torch.device:
    pytest.importorskip("triton")
    return DEVICE
