//! LoRA adapters as vLLM's API server keeps them (`vllm/entrypoints/openai/models/serving.py`,
//! vLLM 0.32): `--lora-modules` loaded at start, `POST /v1/load_lora_adapter` and
//! `/v1/unload_lora_adapter` when `VLLM_ALLOW_RUNTIME_LORA_UPDATING` allows them, each adapter
//! numbered by one counter from 1 (its `lora_int_id`, the `lora_id` of its KV events), loads and
//! unloads of one name one at a time. vLLM's dialect only: the simulated SGLang serves no
//! adapters.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::StatusCode;
use serde::Deserialize;

use super::failure::Failure;

/// The environment variable that adds the load and unload routes.
pub const RUNTIME_UPDATING_ENV: &str = "VLLM_ALLOW_RUNTIME_LORA_UPDATING";

/// Whether a value of [`RUNTIME_UPDATING_ENV`] allows runtime updates, as vLLM's `envs.py` reads
/// it: `1` or `true`, any case, spaces around ignored; unset is `0`.
pub fn runtime_updating_allowed(value: Option<&str>) -> bool {
    let value = value.unwrap_or("0").trim().to_lowercase();
    value == "1" || value == "true"
}

/// One `--lora-modules` value: `name=path`, or vLLM's JSON
/// `{"name", "path", "base_model_name", "is_3d_lora_weight"}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraModule {
    /// The adapter's name, the `model` requests ask for.
    pub name: String,
    /// Where its weights are (never read: the model is simulated).
    pub path: String,
}

/// vLLM's JSON form. `base_model_name` may only name the served model (vLLM ignores another), so
/// an adapter's parent is always the served model; the weights' layout does not matter here.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonModule {
    name: String,
    path: String,
    #[serde(default, rename = "base_model_name")]
    _base_model_name: Option<String>,
    #[serde(default, rename = "is_3d_lora_weight")]
    _is_3d_lora_weight: bool,
}

impl LoraModule {
    /// Reads a value as vLLM's `LoRAParserAction` does: `name=path` when it has a `=` and no
    /// `,`, else JSON.
    pub fn parse(value: &str) -> Result<Self, String> {
        if let Some((name, path)) = value.split_once('=').filter(|_| !value.contains(',')) {
            return Ok(LoraModule {
                name: name.to_owned(),
                path: path.to_owned(),
            });
        }
        let module: JsonModule = serde_json::from_str(value)
            .map_err(|err| format!("invalid --lora-modules value {value}: {err}"))?;
        Ok(LoraModule {
            name: module.name,
            path: module.path,
        })
    }
}

/// A loaded adapter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adapter {
    /// Its name.
    pub name: String,
    /// Its path (vLLM hashes it into the adapter's KV blocks: another path, other blocks).
    pub path: String,
    /// vLLM's `lora_int_id`.
    pub id: i64,
}

/// `POST /v1/load_lora_adapter`'s fields once validated.
#[derive(Debug, Clone)]
pub struct LoadRequest {
    /// `lora_name`.
    pub name: String,
    /// `lora_path`.
    pub path: String,
    /// `load_inplace`: replace an adapter of that name instead of refusing.
    pub in_place: bool,
}

/// The adapters one engine serves beside its base model.
pub struct Adapters {
    base: String,
    /// In load order, as vLLM's dict lists them.
    loaded: Mutex<Vec<Arc<Adapter>>>,
    /// The last id given.
    last_id: AtomicI64,
    /// One lock per name: a load, an unload or a runtime resolution of one name at a time.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// vLLM's `InvalidUserInput` answer (400).
fn invalid(message: String) -> Failure {
    Failure::vllm(StatusCode::BAD_REQUEST, "InvalidUserInput", message, None)
}

impl Adapters {
    /// The adapters of `modules` loaded beside `base`, in order; a name that is the base's or
    /// repeats one fails, as vLLM fails to start.
    pub fn new(base: &str, modules: &[LoraModule]) -> Result<Self, String> {
        let adapters = Adapters {
            base: base.to_owned(),
            loaded: Mutex::new(Vec::new()),
            last_id: AtomicI64::new(0),
            locks: Mutex::new(HashMap::new()),
        };
        for module in modules {
            let request = LoadRequest {
                name: module.name.clone(),
                path: module.path.clone(),
                in_place: false,
            };
            adapters
                .check_load(&request)
                .map_err(|failure| failure.message().to_owned())?;
            adapters.add(request);
        }
        Ok(adapters)
    }

    fn loaded(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Adapter>>> {
        self.loaded.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_of(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
        locks.entry(name.to_owned()).or_default().clone()
    }

    fn next_id(&self) -> i64 {
        self.last_id.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The adapter named `name`, if loaded.
    pub fn get(&self, name: &str) -> Option<Arc<Adapter>> {
        self.loaded().iter().find(|a| a.name == name).cloned()
    }

    /// Every loaded adapter, in load order.
    pub fn list(&self) -> Vec<Arc<Adapter>> {
        self.loaded().clone()
    }

    /// With runtime updates allowed, a request for a model that is not loaded asks vLLM's LoRA
    /// resolvers for it: after any load of that name in progress, the adapter if it is loaded
    /// now; else none (the simulator has no resolvers), an id spent as vLLM spends one.
    pub async fn resolve(&self, name: &str) -> Option<Arc<Adapter>> {
        let lock = self.lock_of(name);
        let _turn = lock.lock().await;
        let found = self.get(name);
        if found.is_none() {
            self.next_id();
        }
        found
    }

    /// Loads an adapter after `delay` (the time loading takes): vLLM's answer text, or its
    /// error.
    pub async fn load(&self, request: LoadRequest, delay: Duration) -> Result<String, Failure> {
        let lock = self.lock_of(&request.name);
        let _turn = lock.lock().await;
        self.check_load(&request)?;
        tokio::time::sleep(delay).await;
        Ok(self.add(request))
    }

    /// vLLM's `_check_load_lora_adapter_request`.
    fn check_load(&self, request: &LoadRequest) -> Result<(), Failure> {
        if request.name.is_empty() || request.path.is_empty() {
            return Err(invalid(
                "Both 'lora_name' and 'lora_path' must be provided.".into(),
            ));
        }
        if request.name == self.base {
            return Err(invalid(format!(
                "The lora adapter '{}' conflicts with a served base model.",
                request.name
            )));
        }
        if !request.in_place && self.get(&request.name).is_some() {
            return Err(invalid(format!(
                "The lora adapter '{}' has already been loaded. If you want to load the adapter \
                 in place, set 'load_inplace' to True.",
                request.name
            )));
        }
        Ok(())
    }

    /// Adds a checked adapter (in place of one of its name, keeping its id and place): vLLM's
    /// answer text.
    fn add(&self, request: LoadRequest) -> String {
        let mut loaded = self.loaded();
        let existing = loaded.iter().position(|a| a.name == request.name);
        let id = existing.map_or_else(|| self.next_id(), |i| loaded[i].id);
        let adapter = Arc::new(Adapter {
            name: request.name,
            path: request.path,
            id,
        });
        let answer = format!(
            "Success: LoRA adapter '{}' added successfully.",
            adapter.name
        );
        tracing::info!(name = %adapter.name, path = %adapter.path, id, "LoRA adapter loaded");
        match existing {
            Some(i) => loaded[i] = adapter,
            None => loaded.push(adapter),
        }
        answer
    }

    /// Unloads the adapter `name`: vLLM's answer text, or its error.
    pub async fn unload(&self, name: &str) -> Result<String, Failure> {
        let lock = self.lock_of(name);
        let _turn = lock.lock().await;
        if name.is_empty() {
            return Err(invalid(
                "'lora_name' needs to be provided to unload a LoRA adapter.".into(),
            ));
        }
        let mut loaded = self.loaded();
        let Some(i) = loaded.iter().position(|a| a.name == name) else {
            let message = format!("The lora adapter '{name}' cannot be found.");
            return Err(Failure::vllm(
                StatusCode::NOT_FOUND,
                "NotFoundError",
                message,
                None,
            ));
        };
        loaded.remove(i);
        tracing::info!(%name, "LoRA adapter unloaded");
        Ok(format!(
            "Success: LoRA adapter '{name}' removed successfully."
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module(name: &str, path: &str) -> LoraModule {
        LoraModule {
            name: name.into(),
            path: path.into(),
        }
    }

    #[test]
    fn the_flag_reads_both_of_vllm_s_forms() {
        assert_eq!(LoraModule::parse("a=/x=y"), Ok(module("a", "/x=y")));
        let json = r#"{"name": "b", "path": "/p", "base_model_name": "m"}"#;
        assert_eq!(LoraModule::parse(json), Ok(module("b", "/p")));
        assert!(LoraModule::parse(r#"{"name": "b"}"#)
            .unwrap_err()
            .contains("path"));
        assert!(LoraModule::parse(r#"{"name": "b", "path": "/p", "rank": 8}"#).is_err());
        assert!(LoraModule::parse("no-equals").is_err());
    }

    #[test]
    fn the_env_var_is_read_as_vllm_reads_it() {
        for (value, allowed) in [
            (None, false),
            (Some("1"), true),
            (Some(" TRUE "), true),
            (Some("True"), true),
            (Some("yes"), false),
            (Some("0"), false),
            (Some(""), false),
        ] {
            assert_eq!(runtime_updating_allowed(value), allowed, "{value:?}");
        }
    }

    #[tokio::test]
    async fn ids_count_from_one_and_a_reload_in_place_keeps_its_id() {
        let adapters = Adapters::new("m", &[module("a", "/a"), module("b", "/b")]).unwrap();
        let ids = |a: &Adapters| a.list().iter().map(|x| (x.name.clone(), x.id)).collect();
        let listed: Vec<(String, i64)> = ids(&adapters);
        assert_eq!(listed, [("a".into(), 1), ("b".into(), 2)]);
        let load = |name: &str, in_place| LoadRequest {
            name: name.into(),
            path: "/new".into(),
            in_place,
        };
        let again = adapters.load(load("a", false), Duration::ZERO).await;
        assert_eq!(again.unwrap_err().status(), StatusCode::BAD_REQUEST);
        adapters
            .load(load("a", true), Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(adapters.get("a").unwrap().id, 1);
        assert_eq!(adapters.get("a").unwrap().path, "/new");
        // A failed resolution spends an id, as vLLM's does.
        assert!(adapters.resolve("nobody").await.is_none());
        adapters
            .load(load("c", false), Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(adapters.get("c").unwrap().id, 4);
        adapters.unload("a").await.unwrap();
        let names: Vec<String> = adapters.list().iter().map(|a| a.name.clone()).collect();
        assert_eq!(names, ["b", "c"]);
        assert_eq!(
            adapters.unload("a").await.unwrap_err().status(),
            StatusCode::NOT_FOUND
        );
        assert!(Adapters::new("m", &[module("m", "/m")]).is_err());
        assert!(Adapters::new("m", &[module("a", "/1"), module("a", "/2")]).is_err());
    }
}
