"""Kernels: pure-torch reference ops (CPU path, test oracle) and the CUDA extension."""
