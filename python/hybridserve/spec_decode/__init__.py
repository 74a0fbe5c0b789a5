"""Speculative decoding proposers: n-gram prompt lookup and draft model."""
