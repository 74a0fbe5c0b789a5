//! Mamba state slot pool (in progress).
