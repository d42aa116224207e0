//! [`ModelCard`]: one entry of an engine's `GET /v1/models`, read at its health checks.

use std::time::Duration;

use reqwest::Url;
use serde::Deserialize;
use serde_json::Value;

/// The largest `/v1/models` answer read (a few thousand adapters' cards).
const MAX_MODELS_BYTES: usize = 1 << 20;

/// One model an engine serves, as its `/v1/models` lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelCard {
    /// The name requests use (`model`).
    pub id: String,
    /// For a LoRA adapter (vLLM), the base model it runs on.
    pub parent: Option<String>,
    /// vLLM: the base model's path, or an adapter's path (what loading it again needs).
    pub root: Option<String>,
    /// The card as the engine sent it, relayed in the proxy's own list.
    pub raw: Value,
}

impl ModelCard {
    /// The card of a served object, if it has a string `id`.
    pub fn from_json(raw: Value) -> Option<Self> {
        let text = |key: &str| raw.get(key).and_then(Value::as_str).map(str::to_owned);
        Some(ModelCard {
            id: text("id")?,
            parent: text("parent"),
            root: text("root"),
            raw,
        })
    }

    /// A card the proxy makes for a model it knows only by name (a registration, or an
    /// adapter it just loaded).
    pub fn named(id: &str, parent: Option<&str>, root: Option<&str>) -> Self {
        let raw = serde_json::json!({
            "id": id, "object": "model", "created": 0, "owned_by": "pd-proxy",
            "root": root.unwrap_or(id), "parent": parent,
        });
        ModelCard {
            id: id.to_owned(),
            parent: parent.map(str::to_owned),
            root: root.map(str::to_owned),
            raw,
        }
    }

    /// Whether it is a LoRA adapter (it names a base model).
    pub fn is_adapter(&self) -> bool {
        self.parent.is_some()
    }
}

/// The context length (`max_model_len`) `cards` give `model` (an adapter: its base model's;
/// no model: the first card's), if they give one.
pub fn context_length(cards: &[ModelCard], model: Option<&str>) -> Option<u64> {
    let card = match model {
        Some(model) => cards.iter().find(|card| card.id == model)?,
        None => cards.first()?,
    };
    let base = (card.parent.as_deref())
        .and_then(|parent| cards.iter().find(|card| card.id == parent))
        .unwrap_or(card);
    base.raw.get("max_model_len")?.as_u64()
}

/// The cards `url` (a `/v1/models`) lists, or `None` when it does not answer them in time,
/// within [`MAX_MODELS_BYTES`], in OpenAI's list shape.
pub async fn read_cards(
    client: &reqwest::Client,
    url: &Url,
    timeout: Duration,
) -> Option<Vec<ModelCard>> {
    #[derive(Deserialize)]
    struct List {
        data: Vec<Value>,
    }
    let read = async {
        let mut response = client.get(url.clone()).send().await.ok()?;
        if !response.status().is_success()
            || response.content_length().unwrap_or(0) > MAX_MODELS_BYTES as u64
        {
            return None;
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.ok()? {
            if body.len() + chunk.len() > MAX_MODELS_BYTES {
                return None;
            }
            body.extend_from_slice(&chunk);
        }
        Some(body)
    };
    let body = tokio::time::timeout(timeout, read).await.ok()??;
    let list: List = serde_json::from_slice(&body).ok()?;
    Some(
        list.data
            .into_iter()
            .filter_map(ModelCard::from_json)
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cards_keep_what_engines_send() {
        let raw = serde_json::json!({"id": "ad", "object": "model", "root": "/a", "parent": "base",
            "max_model_len": null, "permission": []});
        let card = ModelCard::from_json(raw.clone()).unwrap();
        assert_eq!(card.id, "ad");
        assert_eq!(card.parent.as_deref(), Some("base"));
        assert_eq!(card.root.as_deref(), Some("/a"));
        assert!(card.is_adapter());
        assert_eq!(card.raw, raw);
        assert!(ModelCard::from_json(serde_json::json!({"id": 3})).is_none());
        let named = ModelCard::named("m", None, None);
        assert!(!named.is_adapter());
        assert_eq!(named.raw["root"], "m");
    }
}
