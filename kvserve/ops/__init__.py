"""Custom operators: compiled CPU kernels with pure-torch fallbacks."""
from kvserve.ops.paged_attention import (cpu_kernel, cpu_kernel_isa, paged_decode_attention,
                                         paged_decode_attention_torch)

__all__ = ["cpu_kernel", "cpu_kernel_isa", "paged_decode_attention",
           "paged_decode_attention_torch"]
