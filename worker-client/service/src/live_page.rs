//! The live pages the servers serve at `/ui`: one page each, self-contained (its style and
//! scripts are embedded in the binary and served from the same origin; nothing is fetched from
//! elsewhere), kept current by a stream of JSON snapshots over server-sent events.
//!
//! [`assets`] serves the page (`GET /ui`), the shared style and script, and the server's own
//! script, which the page names relative to itself (so that a page served under a prefix, such
//! as a bootstrap instance's `/instances/NAME/ui`, finds them and its stream); [`snapshots`]
//! streams what the page shows. A server's script calls `follow(render)` (from `live.js`) with
//! a function turning a snapshot into elements, built from text only, so no value is ever read
//! as HTML. The pages have no write actions.

use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use axum::http::header;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use futures_util::Stream;

use crate::Draining;

const STYLE: &str = include_str!("live_page/style.css");
const LIVE_JS: &str = include_str!("live_page/live.js");

/// Only this origin's scripts, styles and streams; no frames, no plugins.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
    frame-ancestors 'none'";

/// The routes of a live page titled `title`, drawn by `app_js`: `GET /ui` and its assets.
pub fn assets<S: Clone + Send + Sync + 'static>(
    title: &'static str,
    app_js: &'static str,
) -> Router<S> {
    let page = page(title);
    Router::new()
        .route(
            "/ui",
            get(move || async move { asset("text/html; charset=utf-8", page) }),
        )
        .route(
            "/ui/style.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE.to_owned()) }),
        )
        .route(
            "/ui/live.js",
            get(|| async { asset("text/javascript; charset=utf-8", LIVE_JS.to_owned()) }),
        )
        .route(
            "/ui/app.js",
            get(move || async move { asset("text/javascript; charset=utf-8", app_js.to_owned()) }),
        )
}

fn asset(content_type: &'static str, body: String) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
}

fn page(title: &str) -> String {
    let title: String = title
        .chars()
        .filter(|c| c.is_alphanumeric() || " -_.:".contains(*c))
        .collect();
    format!(
        r#"<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="ui/style.css">
</head>
<body>
<header><h1>{title}</h1><span id="live" class="badge muted">connecting</span></header>
<main id="app"><p class="empty">Waiting for the first snapshot…</p></main>
<script src="ui/live.js"></script>
<script src="ui/app.js"></script>
</body>
</html>
"#
    )
}

/// The page's stream: a `state` event with `snapshot()`'s JSON at once, then again each time
/// `changed()` resolves (a change, or a heartbeat: the server decides), until the server stops
/// accepting. A client that does not read holds one snapshot at most.
pub fn snapshots<F, Snap, C, Changed>(
    draining: Draining,
    snapshot: F,
    changed: C,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>>
where
    F: Fn() -> Snap + Send + 'static,
    Snap: Future<Output = serde_json::Value> + Send + 'static,
    C: Fn() -> Changed + Send + 'static,
    Changed: Future<Output = ()> + Send + 'static,
{
    // Both futures are made before they run: they must own what they read (clones of the
    // server's state) and read it when polled.
    let stream = futures_util::stream::unfold(true, move |first| {
        let change = (!first).then(&changed);
        let next = snapshot();
        let draining = draining.clone();
        async move {
            if let Some(change) = change {
                tokio::select! {
                    () = change => {}
                    () = draining.stopping() => return None,
                }
            }
            let data = next.await.to_string();
            Some((Ok(Event::default().event("state").data(data)), false))
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}
