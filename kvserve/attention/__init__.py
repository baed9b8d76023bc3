"""Attention backends: one interface (backends/base.py), chosen once at start (selector.py)."""
from kvserve.attention.backends.base import AttentionBackend, CommonAttentionMetadata
from kvserve.attention.selector import (BACKEND_NAMES, default_backend_name, get_attn_backend,
                                        resolve_backend_name)

__all__ = ["AttentionBackend", "BACKEND_NAMES", "CommonAttentionMetadata",
           "default_backend_name", "get_attn_backend", "resolve_backend_name"]
