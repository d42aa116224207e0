//! Further registries served by one process (`--instance NAME=PORT`).
//!
//! With vLLM's external or hybrid data-parallel load balancing every vLLM instance registers as
//! dp_rank 0 (vLLM issue #51531), so instances sharing one registry would take each other's
//! slot. An instance is a registry of its own (its own store, table, leases, metrics and
//! pruner) on a port of its own, which is all a stock vLLM prefill can name
//! (`bootstrap_server_address` is `host:port`); it is also served under `/instances/NAME` on
//! the main port, for clients that take a URL (a decode's `remote_bootstrap_addr`, pd-proxy's
//! `--prefill URL BOOTSTRAP_URL`, the worker client).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use crate::store::EtcdConfig;

/// The longest instance name.
pub const MAX_NAME_LEN: usize = 63;

/// One further registry: its name and the port it is served on (0: any free one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceConfig {
    /// `[a-z0-9]` then up to 62 of `[a-z0-9_-]`: its path segment and store name.
    pub name: String,
    /// Its own listener's port, on the main listener's address.
    pub port: u16,
}

impl InstanceConfig {
    /// Parses `NAME=PORT`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let (name, port) = text
            .trim()
            .split_once('=')
            .ok_or_else(|| format!("{text:?} must be NAME=PORT"))?;
        check_name(name)?;
        let port = port
            .trim()
            .parse()
            .map_err(|_| format!("the port in {text:?} is not a port number"))?;
        Ok(InstanceConfig {
            name: name.to_owned(),
            port,
        })
    }

    /// The path it is served under on the main port: `/instances/NAME`.
    pub fn path(&self) -> String {
        format!("/instances/{}", self.name)
    }

    /// Its sled folder inside the main one's: `DATA_DIR/instances/NAME`.
    pub fn data_dir(&self, main: &Path) -> PathBuf {
        main.join("instances").join(&self.name)
    }

    /// Its etcd settings: the main ones with the cluster `CLUSTER@NAME`, so its keys live beside
    /// the main cluster's (`/pd-bootstrap/CLUSTER@NAME/`), never under them (`@` is not allowed in
    /// a cluster name, so no deployment's own cluster can be one of these).
    pub fn etcd(&self, main: &EtcdConfig) -> EtcdConfig {
        EtcdConfig {
            cluster: format!("{}@{}", main.cluster, self.name),
            ..main.clone()
        }
    }
}

fn check_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let valid = name.len() <= MAX_NAME_LEN
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '_' | '-'));
    if valid {
        Ok(())
    } else {
        Err(format!(
            "the instance name {name:?} must be a lowercase letter or digit, then up to {} of \
             lowercase letters, digits, '_' or '-'",
            MAX_NAME_LEN - 1
        ))
    }
}

/// Checks that names are unique and that no two listeners ask for the same fixed port (port 0,
/// any free one, may repeat).
pub fn check_all(instances: &[InstanceConfig], main_port: u16) -> Result<(), String> {
    let mut names = HashSet::new();
    let mut ports = HashSet::from([main_port]);
    for instance in instances {
        check_name(&instance.name)?;
        if !names.insert(instance.name.as_str()) {
            return Err(format!("the instance {:?} is given twice", instance.name));
        }
        if instance.port != 0 && !ports.insert(instance.port) {
            return Err(format!(
                "the instance {:?} asks for port {}, which another listener has",
                instance.name, instance.port
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_ports_are_checked() {
        let b = InstanceConfig::parse("b=8999").unwrap();
        assert_eq!((b.name.as_str(), b.port), ("b", 8999));
        assert_eq!(b.path(), "/instances/b");
        for bad in [
            "b", "=1", "B=1", "-b=1", "b/c=1", "b=http", "b=70000", "b c=1",
        ] {
            assert!(InstanceConfig::parse(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(InstanceConfig::parse(&format!("{}=1", "a".repeat(64))).is_err());
        assert!(InstanceConfig::parse(&format!("{}=1", "a".repeat(63))).is_ok());
        let c = InstanceConfig::parse("c=9000").unwrap();
        assert!(check_all(&[b.clone(), c.clone()], 8998).is_ok());
        assert!(
            check_all(&[b.clone(), b.clone()], 8998).is_err(),
            "a name twice"
        );
        assert!(
            check_all(std::slice::from_ref(&b), 8999).is_err(),
            "the main port"
        );
        let same_port = InstanceConfig {
            name: "d".into(),
            port: 8999,
        };
        assert!(check_all(&[b, same_port], 8998).is_err());
        let any = |name: &str| InstanceConfig {
            name: name.into(),
            port: 0,
        };
        assert!(
            check_all(&[any("x"), any("y")], 0).is_ok(),
            "port 0 repeats"
        );
    }

    #[test]
    fn each_instance_has_a_store_of_its_own() {
        let b = InstanceConfig::parse("b=0").unwrap();
        assert_eq!(b.data_dir(Path::new("data")), Path::new("data/instances/b"));
        let main = EtcdConfig {
            endpoints: vec!["127.0.0.1:2379".into()],
            cluster: "prod".into(),
            op_timeout: std::time::Duration::from_secs(3),
        };
        assert_eq!(b.etcd(&main).cluster, "prod@b");
        assert_eq!(b.etcd(&main).endpoints, main.endpoints);
    }
}
