"""Triton kernels of the CUDA path (fused elementwise ops); attention kernels live in
kvserve/attention/ops/."""
