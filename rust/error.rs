//! The error enum of the core. Each variant maps to one Python exception class under
//! `hybridserve.HybridServeError` (see `py/errors.rs`).

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HsError {
    /// The engine configuration cannot work; the message names the flag(s) to change.
    Config(String),
    /// A request is malformed (empty prompt, too long, unknown id, ...). The engine state is unchanged.
    InvalidRequest(String),
    /// A broken internal invariant. Never expected; reported instead of panicking.
    Internal(String),
}

impl fmt::Display for HsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HsError::Config(m) => write!(f, "configuration error: {m}"),
            HsError::InvalidRequest(m) => write!(f, "invalid request: {m}"),
            HsError::Internal(m) => write!(f, "internal error: {m}"),
        }
    }
}

impl std::error::Error for HsError {}

pub type HsResult<T> = Result<T, HsError>;
