"""Model layers: norms, Mamba2 mixer, paged attention, MLP / MoE, and the kernel dispatch."""
