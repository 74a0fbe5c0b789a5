//! hybridserve core: the cache-mode policy, the KV block pool, the Mamba state cache and the
//! scheduler. Everything here is plain Rust; the PyO3 bindings live in `py/` behind the `python`
//! feature so that `cargo test` needs no Python.

pub mod block_hash;
pub mod block_pool;
pub mod cache;
pub mod config;
pub mod error;
pub mod kv_events;
pub mod mamba_pool;
pub mod output;
pub mod policy;
pub mod prefix_tree;
pub mod request;
pub mod scheduler;

#[cfg(feature = "python")]
mod py;
