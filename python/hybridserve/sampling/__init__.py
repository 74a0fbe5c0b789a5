"""Sampling: sampler and rejection sampler."""
