//! Tenants: who a request comes from, by its API key, and what that tenant may send. Keys come
//! from the keys file (`--api-keys-file`, [`file`]), re-read when it changes, and from
//! `--api-key` (one tenant, `default`). A key is found by a keyed hash (SipHash with a key of
//! the process's own) and compared in constant time; keys are never logged or shown.
//!
//! A [`Tenant`]'s limits ([`file::Limits`]) are token buckets ([`bucket`]): requests per second
//! (bursts of a second's worth), prompt and output tokens per minute (charged at arrival, as
//! OpenAI's limits do: the prompt's estimated tokens, and its `max_tokens`), and the requests
//! it has in flight. A request over one is refused with 429 and told when to come back. The
//! tenant is also the request's fair-share id in the admission queue.

pub mod bucket;
pub mod charge;
pub mod file;
pub mod metrics;
mod tenant;

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant, SystemTime};

use http::HeaderMap;
use pd_service::BearerToken;
use subtle::ConstantTimeEq;

pub use self::file::{KeysFileError, Limits, TenantEntry};
pub use self::tenant::{InFlight, LimitKind, Limited, RateStatus, Standing, Tenant};

/// The tenant of `--api-key`.
pub const FLAG_TENANT: &str = "default";

/// How often the keys file is checked for a change.
pub const RELOAD_EVERY: Duration = Duration::from_secs(2);

/// What a request's key says.
#[derive(Debug, Clone)]
pub enum Authentication {
    /// The key of this tenant.
    Tenant(Arc<Tenant>),
    /// No key.
    Missing,
    /// A key nobody has.
    Unknown,
}

/// A key and its tenant.
type KeyOf = (Box<[u8]>, Arc<Tenant>);

/// The keys, each found by its keyed hash.
#[derive(Debug, Default)]
struct Directory {
    hasher: RandomState,
    keys: HashMap<u64, Vec<KeyOf>>,
    tenants: Vec<Arc<Tenant>>,
}

impl Directory {
    /// The directory of `entries`, keeping the tenants of `old` (their buckets and their
    /// requests in flight, whether their limits changed or not).
    fn build(entries: &[TenantEntry], old: Option<&Directory>, now: Instant) -> Self {
        let mut directory = Directory::default();
        for entry in entries {
            let before = old.and_then(|old| old.tenants.iter().find(|t| **t.name() == *entry.name));
            let tenant = match before {
                Some(same) if *same.limits() == entry.limits => same.clone(),
                Some(changed) => Arc::new(Tenant::after(changed, entry.limits, now)),
                None => Arc::new(Tenant::new(&entry.name, entry.limits, now)),
            };
            for key in &entry.keys {
                let hash = directory.hasher.hash_one(key.as_bytes());
                let found = directory.keys.entry(hash).or_default();
                found.push((Box::from(key.as_bytes()), tenant.clone()));
            }
            directory.tenants.push(tenant);
        }
        directory
    }

    fn find(&self, presented: &[u8]) -> Option<&Arc<Tenant>> {
        let candidates = self.keys.get(&self.hasher.hash_one(presented))?;
        (candidates.iter())
            .find(|(key, _)| bool::from(key.as_ref().ct_eq(presented)))
            .map(|(_, tenant)| tenant)
    }
}

/// Every tenant and its keys.
#[derive(Debug)]
pub struct Tenants {
    directory: RwLock<Arc<Directory>>,
    /// The keys file, re-read when it changes.
    file: Option<PathBuf>,
    /// `--api-key`, the `default` tenant's key.
    flag_key: Option<String>,
}

impl Tenants {
    /// The tenants of the keys file `file` and of `--api-key` (`flag_key`); none when neither
    /// is given. A file that cannot be used is an error naming it.
    pub fn load(
        file: Option<&Path>,
        flag_key: Option<&str>,
    ) -> Result<Option<Arc<Tenants>>, KeysFileError> {
        if file.is_none() && flag_key.is_none() {
            return Ok(None);
        }
        let tenants = Tenants {
            directory: RwLock::default(),
            file: file.map(Path::to_path_buf),
            flag_key: flag_key.map(str::to_owned),
        };
        let entries = tenants.entries()?;
        *tenants.directory.write().unwrap_or_else(|e| e.into_inner()) =
            Arc::new(Directory::build(&entries, None, Instant::now()));
        Ok(Some(Arc::new(tenants)))
    }

    /// [`Tenants::load`], every tenant's metric series made, and the keys file watched (on the
    /// current runtime): what a front door starts with.
    pub fn start(
        file: Option<&Path>,
        flag_key: Option<&str>,
        metrics: &metrics::TenantMetrics,
    ) -> Result<Option<Arc<Tenants>>, KeysFileError> {
        let tenants = Tenants::load(file, flag_key)?;
        if let Some(tenants) = &tenants {
            tenants.names().iter().for_each(|name| metrics.known(name));
            tenants.watch(RELOAD_EVERY);
        }
        Ok(tenants)
    }

    /// The file's tenants and the flag's.
    fn entries(&self) -> Result<Vec<TenantEntry>, KeysFileError> {
        let mut entries = match &self.file {
            Some(path) => file::read(path)?,
            None => Vec::new(),
        };
        if let Some(key) = &self.flag_key {
            if entries.iter().any(|e| e.keys.contains(key)) {
                let path = self.file.clone().unwrap_or_default();
                let message = "--api-key is also a key of the file: give each key once".to_owned();
                return Err(KeysFileError { path, message });
            }
            match entries.iter_mut().find(|e| e.name == FLAG_TENANT) {
                Some(entry) => entry.keys.push(key.clone()),
                None => entries.push(TenantEntry {
                    name: FLAG_TENANT.to_owned(),
                    keys: vec![key.clone()],
                    limits: Limits::default(),
                }),
            }
        }
        Ok(entries)
    }

    /// Who `headers` say the request comes from.
    pub fn authenticate(&self, headers: &HeaderMap) -> Authentication {
        let Some(presented) = BearerToken::presented(headers) else {
            return Authentication::Missing;
        };
        let directory = self.directory.read().unwrap_or_else(|e| e.into_inner());
        match directory.find(presented) {
            Some(tenant) => Authentication::Tenant(tenant.clone()),
            None => Authentication::Unknown,
        }
    }

    /// Every tenant's name.
    pub fn names(&self) -> Vec<Arc<str>> {
        let directory = self.directory.read().unwrap_or_else(|e| e.into_inner());
        directory.tenants.iter().map(|t| t.name().clone()).collect()
    }

    /// Re-reads the keys file; a file that cannot be used leaves the tenants as they are.
    pub fn reload(&self) {
        let entries = match self.entries() {
            Ok(entries) => entries,
            Err(err) => {
                return tracing::warn!(error = %err, "the API keys file changed but cannot be used; the keys stay as they were")
            }
        };
        let old = self
            .directory
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let directory = Arc::new(Directory::build(&entries, Some(&old), Instant::now()));
        let count = directory.tenants.len();
        *self.directory.write().unwrap_or_else(|e| e.into_inner()) = directory;
        tracing::info!(tenants = count, "API keys file reloaded");
    }

    /// Starts checking the keys file for changes every `every` (on the current runtime; the
    /// watch ends when the tenants are dropped).
    pub fn watch(self: &Arc<Self>, every: Duration) {
        let Some(path) = self.file.clone() else {
            return;
        };
        let this: Weak<Tenants> = Arc::downgrade(self);
        let stamp = move || {
            let meta = std::fs::metadata(&path).ok()?;
            Some((meta.modified().ok()?, meta.len()))
        };
        tokio::spawn(async move {
            let mut seen: Option<(SystemTime, u64)> = stamp();
            loop {
                tokio::time::sleep(every).await;
                let Some(tenants) = this.upgrade() else {
                    return;
                };
                let now = stamp();
                if now != seen {
                    seen = now;
                    tenants.reload();
                }
            }
        });
    }
}

#[cfg(test)]
mod tests;
