//! The only PyO3 code of the crate: the `hybridserve._core` module.

use pyo3::prelude::*;

mod errors;
mod policy;
mod scheduler;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    policy::register(m)?;
    scheduler::register(m)?;
    Ok(())
}
