"""Custom operators: compiled CPU kernels with pure-torch fallbacks."""
from kvserve.ops.paged_attention import (cpu_kernel, cpu_kernel_isa, paged_decode_attention,
                                         paged_decode_attention_torch)


def load_cpu_kernels() -> None:
    """Build (first run, ~10 s each) or load every CPU kernel now, so that the work happens at
    engine start-up rather than inside the first steps. Failures fall back as usual."""
    import torch

    from kvserve.ops import fused, linear, prefill_attention
    for get in (cpu_kernel, fused.cpu_kernel, prefill_attention.cpu_kernel):
        get()
    if not torch.backends.mkldnn.is_available():
        linear.cpu_kernel()     # only used where oneDNN cannot prepack the weights


__all__ = ["cpu_kernel", "cpu_kernel_isa", "load_cpu_kernels", "paged_decode_attention",
           "paged_decode_attention_torch"]
