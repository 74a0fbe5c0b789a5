//! Python exception classes for `HsError`: HybridServeError and one subclass per variant.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

use crate::error::HsError;

create_exception!(
    hybridserve._core,
    HybridServeError,
    PyException,
    "Base class of every hybridserve error."
);
create_exception!(
    hybridserve._core,
    ConfigError,
    HybridServeError,
    "The engine configuration cannot work."
);
create_exception!(
    hybridserve._core,
    InvalidRequestError,
    HybridServeError,
    "A request is malformed."
);
create_exception!(
    hybridserve._core,
    InternalError,
    HybridServeError,
    "A broken internal invariant."
);

pub fn to_pyerr(err: HsError) -> PyErr {
    match err {
        HsError::Config(m) => ConfigError::new_err(m),
        HsError::InvalidRequest(m) => InvalidRequestError::new_err(m),
        HsError::Internal(m) => InternalError::new_err(m),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("HybridServeError", py.get_type::<HybridServeError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("InvalidRequestError", py.get_type::<InvalidRequestError>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    Ok(())
}
