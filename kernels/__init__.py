"""Triton kernels, each beside a torch reference twin with the same signature."""
