//! KV block pool (in progress).
