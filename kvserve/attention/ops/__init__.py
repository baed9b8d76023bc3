"""Triton kernels of the TRITON_ATTN backend (GPU; CPU tensors under TRITON_INTERPRET=1).

Every kernel reads the paged KV cache in place: [2, num_blocks, block_size, num_kv_heads,
head_dim], K = cache[0], V = cache[1]. Import this package only where Triton is wanted: the
interpreter is chosen when the kernels are defined (TRITON_INTERPRET at import time).
"""
