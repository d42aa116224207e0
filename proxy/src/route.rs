//! The proxied routes: their paths, their spans' names, the prompts their bodies carry, and
//! each one's URL on a backend.

use pd_router::backend::Backend;
use pd_router::endpoint::Endpoint;
use pd_router::prompt_tokens::PromptKind;

/// The proxied routes (in the order [`crate::models::ModelHandles`] keeps them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// `POST /v1/completions`.
    Completions = 0,
    /// `POST /v1/chat/completions`.
    ChatCompletions = 1,
    /// `POST /generate` (SGLang's native API).
    Generate = 2,
}

impl Route {
    /// The route served at `path`, if it is a proxied one.
    pub(crate) fn at(path: &str) -> Option<Route> {
        [Route::Completions, Route::ChatCompletions, Route::Generate]
            .into_iter()
            .find(|route| route.path() == path)
    }

    /// Its path.
    pub(crate) fn path(self) -> &'static str {
        match self {
            Route::Completions => "/v1/completions",
            Route::ChatCompletions => "/v1/chat/completions",
            Route::Generate => "/generate",
        }
    }

    /// The name of its requests' spans.
    pub(crate) fn span_name(self) -> &'static str {
        match self {
            Route::Completions => "POST /v1/completions",
            Route::ChatCompletions => "POST /v1/chat/completions",
            Route::Generate => "POST /generate",
        }
    }

    /// The prompt its bodies carry.
    pub(crate) fn prompt_kind(self) -> PromptKind {
        match self {
            Route::ChatCompletions => PromptKind::Chat,
            Route::Completions | Route::Generate => PromptKind::Completion,
        }
    }

    /// The same route on `backend`.
    pub(crate) fn endpoint(self, backend: &Backend) -> &Endpoint {
        match self {
            Route::Completions => &backend.completions_url,
            Route::ChatCompletions => &backend.chat_completions_url,
            Route::Generate => &backend.generate_url,
        }
    }
}
