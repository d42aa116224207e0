//! Where an engine publishes its KV cache events: vLLM answers `GET /kv_event_sources` with its
//! publisher config per data-parallel rank (`{"0": {"endpoint": "tcp://*:5557",
//! "replay_endpoint": null, "topic": "kv", ...}}`); an engine that does not (SGLang) is found at
//! `--kv-events-port`, offset by the dp rank as vLLM and SGLang offset it. A wildcard host
//! (`*`, `0.0.0.0`, `::`) means the engine's own host.

use std::collections::BTreeMap;
use std::time::Duration;

use pd_protocol::Rank;
use reqwest::Url;
use serde::Deserialize;

/// One dp rank's publisher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// The data-parallel rank.
    pub dp_rank: Rank,
    /// The PUB socket, e.g. `tcp://10.0.0.5:5557`.
    pub endpoint: String,
    /// The ROUTER socket answering replay requests, if the engine has one.
    pub replay: Option<String>,
    /// The topic the engine publishes under.
    pub topic: String,
}

#[derive(Deserialize)]
struct Published {
    #[serde(default)]
    enable_kv_cache_events: bool,
    #[serde(default)]
    publisher: Option<String>,
    endpoint: Option<String>,
    replay_endpoint: Option<String>,
    #[serde(default)]
    topic: Option<String>,
}

/// The sources of the engine at `base` (its API URL): from its `GET /kv_event_sources`, else
/// `fallback_port` (dp rank 0 only). `None` when neither says where.
pub async fn find(
    client: &reqwest::Client,
    base: &Url,
    fallback_port: Option<u16>,
    timeout: Duration,
) -> Option<Vec<Source>> {
    let host = base.host_str()?;
    let asked = client
        .get(base.join("kv_event_sources").ok()?)
        .timeout(timeout)
        .send()
        .await;
    if let Ok(answer) = asked {
        if answer.status().is_success() {
            let published: BTreeMap<String, Published> = answer.json().await.ok()?;
            let sources = from_published(host, published);
            if !sources.is_empty() {
                return Some(sources);
            }
        }
    }
    let port = fallback_port?;
    Some(vec![Source {
        dp_rank: 0,
        endpoint: format!("tcp://{}:{port}", bracketed(host)),
        replay: None,
        topic: String::new(),
    }])
}

fn from_published(host: &str, published: BTreeMap<String, Published>) -> Vec<Source> {
    published
        .into_iter()
        .filter_map(|(rank, config)| {
            let zmq = config.publisher.as_deref().is_none_or(|p| p == "zmq");
            if !config.enable_kv_cache_events || !zmq {
                return None;
            }
            Some(Source {
                dp_rank: rank.parse().ok()?,
                endpoint: on_host(&config.endpoint?, host)?,
                replay: config.replay_endpoint.and_then(|e| on_host(&e, host)),
                topic: config.topic.unwrap_or_default(),
            })
        })
        .collect()
}

/// `tcp://*:5557` as reached from here: the wildcard replaced by the engine's host. Other
/// transports (`ipc://`, `inproc://`) cannot be reached from another process: `None`.
fn on_host(endpoint: &str, host: &str) -> Option<String> {
    let address = endpoint.strip_prefix("tcp://")?;
    let (bind, port) = address.rsplit_once(':')?;
    let bind = bind.trim_start_matches('[').trim_end_matches(']');
    let reached = match bind {
        "*" | "0.0.0.0" | "::" | "" => bracketed(host),
        other => bracketed(other),
    };
    Some(format!("tcp://{reached}:{port}"))
}

fn bracketed(host: &str) -> String {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if bare.contains(':') {
        format!("[{bare}]")
    } else {
        bare.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllms_answer_becomes_reachable_endpoints() {
        let answer = serde_json::json!({
            "0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
                  "replay_endpoint": "tcp://*:5600", "topic": "kv", "buffer_steps": 10000},
            "1": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5558",
                  "replay_endpoint": null, "topic": "kv"},
            "2": {"enable_kv_cache_events": false, "publisher": "null", "endpoint": "tcp://*:5559"},
            "3": {"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/kv"}
        });
        let published = serde_json::from_value(answer).unwrap();
        let sources = from_published("10.0.0.5", published);
        assert_eq!(
            sources,
            vec![
                Source {
                    dp_rank: 0,
                    endpoint: "tcp://10.0.0.5:5557".into(),
                    replay: Some("tcp://10.0.0.5:5600".into()),
                    topic: "kv".into()
                },
                Source {
                    dp_rank: 1,
                    endpoint: "tcp://10.0.0.5:5558".into(),
                    replay: None,
                    topic: "kv".into()
                },
            ]
        );
    }

    #[test]
    fn wildcards_become_the_engines_host() {
        assert_eq!(
            on_host("tcp://0.0.0.0:1", "h").as_deref(),
            Some("tcp://h:1")
        );
        assert_eq!(
            on_host("tcp://[::]:1", "::1").as_deref(),
            Some("tcp://[::1]:1")
        );
        assert_eq!(
            on_host("tcp://10.1.1.1:1", "h").as_deref(),
            Some("tcp://10.1.1.1:1")
        );
        assert_eq!(on_host("inproc://cache", "h"), None);
    }
}
