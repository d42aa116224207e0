//! Leases: keepalives, revocation, and the clean-up of leases a slot moved away from.

use pd_protocol::LeaseId;

use super::writer::APPLY_WAIT;
use super::{Registry, RegistryError};
use crate::registry::model::Lease;
use crate::store::StoreError;

impl Registry {
    /// Revokes, in the background, a lease that a registration moved its slot away from, once no
    /// worker lives by it any more (each registration grants a new lease, so the old one would
    /// otherwise linger until its ttl).
    pub(super) fn revoke_if_unused(&self, lease: Option<Lease>) {
        let Some(lease) = lease else { return };
        if self.read_workers().table.has_lease(lease.id) {
            return;
        }
        let store = self.store.clone();
        tokio::spawn(async move {
            if let Err(err) = store.revoke_lease(lease.id).await {
                tracing::debug!(lease = lease.id, error = %err, "could not revoke a superseded lease");
            }
        });
    }

    /// `POST /leases/{lease_id}/keepalive`: renews a lease; its time to live in seconds.
    pub async fn keep_alive(&self, lease: LeaseId) -> Result<u32, RegistryError> {
        self.store
            .keep_alive(lease)
            .await?
            .ok_or(RegistryError::UnknownLease(lease))
    }

    /// `DELETE /leases/{lease_id}`: ends a lease and removes its workers; false when it was not
    /// live. Returns once this replica no longer shows those workers.
    pub async fn revoke(&self, lease: LeaseId) -> Result<bool, RegistryError> {
        let revoked = self.store.revoke_lease(lease).await?;
        let mut applied = self.applied.subscribe();
        let gone = applied.wait_for(|_| !self.read_workers().table.has_lease(lease));
        if tokio::time::timeout(APPLY_WAIT, gone).await.is_err() {
            return Err(RegistryError::Store(StoreError::Backend(format!(
                "lease {lease} was revoked but its workers have not left this replica's view yet"
            ))));
        }
        if revoked {
            tracing::info!(lease, "lease revoked");
        }
        Ok(revoked)
    }
}
