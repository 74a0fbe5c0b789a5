"""Architectures: one module per model family, registered by name."""
