"""Custom operators: compiled CPU kernels with pure-torch fallbacks."""
from kvserve.ops.paged_attention import (cpu_kernel, cpu_kernel_isa, paged_decode_attention,
                                         paged_decode_attention_torch)


def load_cpu_kernels() -> None:
    """Build (first run, ~10 s each) or load every CPU kernel now, so that the work happens at
    engine start-up rather than inside the first steps. Failures fall back as usual."""
    from kvserve.ops import cpu_isa, fused, linear, prefill_attention
    from kvserve.ops.quant import kernel as quant_kernel
    cpu_isa.selected_tier()     # a bad cpu_isa is an error at start-up, not a fallback
    # The linear kernel serves 16-bit weights with float32 math and unpacked weights; the
    # quant kernel GGUF weights kept packed.
    for get in (cpu_kernel, fused.cpu_kernel, prefill_attention.cpu_kernel, linear.cpu_kernel,
                quant_kernel.ops):
        get()


__all__ = ["cpu_kernel", "cpu_kernel_isa", "load_cpu_kernels", "paged_decode_attention",
           "paged_decode_attention_torch"]
