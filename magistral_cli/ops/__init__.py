"""Autograd functions and kernels: attention backends, chunked loss, contiguous Linear, split-copy, GC policy."""
