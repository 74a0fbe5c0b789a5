"""Model: loader, architectures, layers, KV and state tensors."""
