//! The models an engine serves, as vLLM's API server answers for them: `GET /v1/models` (the
//! base model's card, then one per LoRA adapter; SGLang's card for SGLang's dialect), the check
//! of a request's `model` (vLLM's 404 for a model it does not serve), and with
//! `VLLM_ALLOW_RUNTIME_LORA_UPDATING` the adapters' `POST /v1/load_lora_adapter` and
//! `POST /v1/unload_lora_adapter`, their bodies validated as FastAPI validates vLLM's. SGLang's
//! adapters are out of scope: the simulated SGLang serves its one model whatever `model` says.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use super::{Engine, SimError};
use crate::sim::api::Prompt;
use crate::sim::config::{Dialect, SimArgs};
use crate::sim::failure::Failure;
use crate::sim::lora::{self, Adapters, LoadRequest};

/// The longest prompt the simulated model takes, as `/tokenize` and `/v1/models` report it (not
/// enforced).
pub(super) const MAX_MODEL_LEN: usize = 131_072;

/// The adapters `--lora-modules` loads, and whether `VLLM_ALLOW_RUNTIME_LORA_UPDATING` allows
/// loading more (vLLM's dialect only).
pub(super) fn adapters(args: &SimArgs) -> Result<(Adapters, bool), SimError> {
    if args.dialect == Dialect::Sglang && !args.lora_modules.is_empty() {
        return Err(SimError::Flags(
            "--lora-modules is vLLM's: the simulated SGLang serves no adapters",
        ));
    }
    let adapters = Adapters::new(&args.model, &args.lora_modules).map_err(SimError::Setup)?;
    let env = std::env::var(lora::RUNTIME_UPDATING_ENV).ok();
    let runtime = args.dialect == Dialect::Vllm && lora::runtime_updating_allowed(env.as_deref());
    if runtime {
        tracing::warn!("LoRA dynamic loading & unloading is enabled in the API server. This should ONLY be used for local development!");
    }
    Ok((adapters, runtime))
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// vLLM's `ModelCard`: `max_model_len` for the base model only, one default `ModelPermission`.
fn vllm_card(id: &str, root: &str, parent: Option<&str>, max_model_len: Option<usize>) -> Value {
    let created = now();
    let permission = json!({
        "id": format!("modelperm-{:016x}", uuid::Uuid::new_v4().as_u64_pair().0),
        "object": "model_permission", "created": created,
        "allow_create_engine": false, "allow_sampling": true, "allow_logprobs": true,
        "allow_search_indices": false, "allow_view": true, "allow_fine_tuning": false,
        "organization": "*", "group": null, "is_blocking": false,
    });
    json!({"id": id, "object": "model", "created": created, "owned_by": "vllm", "root": root,
           "parent": parent, "max_model_len": max_model_len, "permission": [permission]})
}

/// `GET /v1/models`: vLLM's list (the base model, then each adapter in load order, its parent
/// the base model), or SGLang's card of its served model.
pub(super) async fn list(State(engine): State<Arc<Engine>>) -> Json<Value> {
    let model = engine.args.model.as_str();
    let data: Vec<Value> = match engine.args.dialect {
        Dialect::Vllm => {
            let base = vllm_card(model, model, None, Some(MAX_MODEL_LEN));
            let adapters = engine.adapters.list();
            let adapters = adapters
                .iter()
                .map(|a| vllm_card(&a.name, &a.path, Some(model), None));
            std::iter::once(base).chain(adapters).collect()
        }
        Dialect::Sglang => vec![json!({
            "id": model, "object": "model", "created": now(), "owned_by": "sglang",
            "root": model, "parent": null, "max_model_len": MAX_MODEL_LEN,
        })],
    };
    Json(json!({"object": "list", "data": data}))
}

impl Engine {
    /// vLLM: checks the request's `model` as vLLM's `_check_model` does: none, empty or the
    /// base model is the base model; a loaded adapter's name is that adapter (set on `prompt`);
    /// with runtime updates, a name being loaded waits for its load; else 404.
    pub(super) async fn check_model(&self, prompt: &mut Prompt) -> Result<(), Failure> {
        let base = self.args.model.as_str();
        let Some(name) = prompt
            .model
            .as_deref()
            .filter(|m| !m.is_empty() && *m != base)
        else {
            return Ok(());
        };
        let adapter = match self.adapters.get(name) {
            None if self.runtime_lora => self.adapters.resolve(name).await,
            found => found,
        };
        match adapter {
            Some(adapter) => {
                prompt.lora = Some(adapter);
                Ok(())
            }
            None => Err(Failure::vllm(
                StatusCode::NOT_FOUND,
                "NotFoundError",
                format!("The model `{name}` does not exist. Valid aliases: {base}."),
                Some("model".into()),
            )),
        }
    }
}

/// `POST /v1/load_lora_adapter` (`lora_name`, `lora_path`, `load_inplace`): after
/// `--lora-load-delay-ms`, vLLM's plain-text success, or its error.
pub(super) async fn load(
    State(engine): State<Arc<Engine>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let request = validated(&headers, &body, &["lora_name", "lora_path"]).and_then(|fields| {
        // pydantic's lax booleans (`"yes"`, `1`...) are not taken.
        let in_place = match fields.get("load_inplace") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => {
                let loc = "body.load_inplace";
                let printed =
                    pydantic_error("bool_type", loc, "Input should be a valid boolean", other);
                return Err(invalid_fields(vec![(loc.into(), printed)]));
            }
        };
        let text = |field: &str| fields[field].as_str().unwrap_or_default().to_owned();
        Ok(LoadRequest {
            name: text("lora_name"),
            path: text("lora_path"),
            in_place,
        })
    });
    let delay = Duration::from_millis(engine.args.lora_load_delay_ms);
    match request {
        Ok(request) => text_answer(engine.adapters.load(request, delay).await),
        Err(failure) => failure.into_response(),
    }
}

/// `POST /v1/unload_lora_adapter` (`lora_name`): vLLM's plain-text success, or its error.
pub(super) async fn unload(
    State(engine): State<Arc<Engine>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match validated(&headers, &body, &["lora_name"]) {
        Ok(fields) => {
            let name = fields["lora_name"].as_str().unwrap_or_default();
            text_answer(engine.adapters.unload(name).await)
        }
        Err(failure) => failure.into_response(),
    }
}

/// vLLM answers a success as bare text (a `Response` without a content type).
fn text_answer(outcome: Result<String, Failure>) -> Response {
    match outcome {
        Ok(text) => Response::new(Body::from(text)),
        Err(failure) => failure.into_response(),
    }
}

/// One pydantic validation error, as vLLM prints it: its type, `loc`, message and input (a
/// container described, not shown).
fn pydantic_error(kind: &str, loc: &str, message: &str, input: &Value) -> String {
    let input = match input {
        Value::Null => "None".to_owned(),
        Value::Bool(b) => if *b { "True" } else { "False" }.to_owned(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.chars().take(200).collect(),
        Value::Array(items) => format!("<list of {} items>", items.len()),
        Value::Object(map) => format!("<dict of {} items>", map.len()),
    };
    let quoted = match input.contains('\'') && !input.contains('"') {
        true => format!("\"{input}\""),
        false => format!("'{input}'"),
    };
    format!("{{'type': '{kind}', 'loc': '{loc}', 'msg': '{message}', 'input': {quoted}}}")
}

/// A field that is not a string: `(loc, printed error)`.
fn not_a_string(field: &str, value: &Value) -> (String, String) {
    let loc = format!("body.{field}");
    let printed = pydantic_error("string_type", &loc, "Input should be a valid string", value);
    (loc, printed)
}

/// vLLM's answer to a body FastAPI could not validate: 400 `Bad Request`, the first error's
/// `loc` as `param`, the errors listed in the message.
fn invalid_fields(issues: Vec<(String, String)>) -> Failure {
    let count = issues.len();
    let label = if count == 1 { "error" } else { "errors" };
    let listed: String = issues.iter().map(|(_, e)| format!("\n  {e}")).collect();
    let param = issues.into_iter().next().map(|(loc, _)| loc);
    let message = format!("{count} validation {label}:{listed}");
    Failure::vllm(StatusCode::BAD_REQUEST, "Bad Request", message, param)
}

/// The body's fields once FastAPI would take them: a JSON content type (vLLM's
/// `validate_json_request`), a JSON object, each of `required` there and a string.
fn validated(
    headers: &HeaderMap,
    body: &[u8],
    required: &[&str],
) -> Result<Map<String, Value>, Failure> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_lowercase();
    if content_type.split(';').next().map(str::trim) != Some("application/json") {
        let message =
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed";
        return Err(Failure::vllm(
            StatusCode::BAD_REQUEST,
            "Bad Request",
            message,
            None,
        ));
    }
    // FastAPI's `loc` has the error's position and `ctx` Python's message: both left out.
    let value: Value = serde_json::from_slice(body).map_err(|_| {
        let printed =
            "{'type': 'json_invalid', 'loc': 'body', 'msg': 'JSON decode error', 'input': {}}";
        invalid_fields(vec![("body".into(), printed.into())])
    })?;
    let Value::Object(fields) = value else {
        let message = "Input should be a valid dictionary or object to extract fields from";
        let printed = pydantic_error("model_attributes_type", "body", message, &value);
        return Err(invalid_fields(vec![("body".into(), printed)]));
    };
    let issues: Vec<(String, String)> = required
        .iter()
        .filter_map(|&field| match fields.get(field) {
            None => {
                let loc = format!("body.{field}");
                let whole = Value::Object(fields.clone());
                let printed = pydantic_error("missing", &loc, "Field required", &whole);
                Some((loc, printed))
            }
            Some(Value::String(_)) => None,
            Some(other) => Some(not_a_string(field, other)),
        })
        .collect();
    if issues.is_empty() {
        Ok(fields)
    } else {
        Err(invalid_fields(issues))
    }
}
