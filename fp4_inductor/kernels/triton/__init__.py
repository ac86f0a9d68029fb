"""Triton kernels (imported lazily: Triton is only needed on a GPU)."""
