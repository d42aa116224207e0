//! Drain marks: an operator takes an engine out of routing (routers follow the mark through
//! the watch) and puts it back.

use std::sync::Arc;

use super::validate::validate_id;
use super::{Registry, RegistryError};

impl Registry {
    /// Marks every worker of `engine_id` draining (routers send it no new requests) or lifts
    /// the mark; returns how many workers the engine has. Its workers keep the mark when they
    /// renew, re-register or restart under the same engine id.
    pub async fn drain(
        self: &Arc<Self>,
        engine_id: &str,
        draining: bool,
    ) -> Result<usize, RegistryError> {
        validate_id("engine_id", engine_id)?;
        let engine = engine_id.to_owned();
        let workers = self
            .write(move |table, _| {
                table
                    .plan_drain(&engine, draining)
                    .ok_or_else(|| RegistryError::UnknownEngine(engine.clone()))
            })
            .await?;
        tracing::info!(engine_id, draining, workers, "engine drain mark set");
        Ok(workers)
    }
}
