//! pd-router: the routing core of pd-bootstrap, shared by its two front doors (pd-proxy, the
//! OpenAI-compatible proxy, and pd-epp, the Gateway API Inference Extension endpoint picker).
//! It serves no HTTP: a front door hands it a request's facts and gets a placement back.
//!
//! **The fleet**: the [`backend`]s (prefills with their dp ranks, decodes) in a [`backend::Pool`],
//! and their lives ([`members`]): given by the flags ([`flags`], validated into [`config`]), found through each prefill's
//! bootstrap server ([`discovery`]) and through DNS names ([`dns`]); checked ([`health`]),
//! measured ([`engine_load`]), the models and LoRA adapters each serves ([`models`]), drained by
//! an operator or by their registry.
//!
//! **The placement**: the [`routing`] policies (one file each, behind one trait), the decision
//! whether a request goes through P at all (`routing::decision`), the engines' KV cache events
//! ([`kv_events`]) in a block index ([`kv_index`]) and the prompts' token ids for it
//! ([`prompt_tokens`]); [`Router::place`] ([`placement`]) runs them for one request.
//!
//! **Accounting**: a placed request holds its backends' calls ([`backend::Backend::call`],
//! counted in flight until dropped) and its share of the prefill's queued work
//! ([`routing::RequestInfo::take_prefill_work`]), so the policies see it until it ends.
//!
//! **Overload**: the engines' [`saturation`] from their own signals; the [`admission`] queue in
//! front of the placement while the pool is saturated (priorities, fair shares between tenants,
//! bounded waits, 429 when a request cannot get in); the [`latency`] each engine is predicted to
//! give a request, for the requests that carry targets; the [`retry_budget`].
//!
//! **Capacity**: the [`planner`], the engines each model's roles should have to meet latency
//! targets, from the demand seen and each engine's rate at the targets; and the [`duty`] of
//! engines that serve both roles (`--dual`), split between prefill and decode by its plans.
//!
//! Beside them: [`body`] (a request's JSON body, read without copying, and the fields P and D
//! receive), [`validate`] (what is wrong with a body before any engine sees it), [`endpoint`] (a backend's URLs, parsed once), [`metrics`] (the fleet's, registered
//! in the front door's registry) and [`sync`]; the [`tenants`] whose API keys say who sends a request,
//! and their limits.

pub mod admission;
pub mod backend;
pub mod body;
pub mod config;
pub mod discovery;
pub mod dns;
pub mod duty;
pub mod endpoint;
pub mod engine_load;
pub mod engine_version;
pub mod flags;
pub mod health;
pub mod kv_events;
pub mod kv_index;
pub mod latency;
pub mod members;
pub mod metrics;
pub mod models;
pub mod placement;
pub mod planner;
pub mod prompt_tokens;
pub mod retry_budget;
mod router;
pub mod routing;
pub mod saturation;
pub mod sync;
pub mod tenants;
pub mod validate;

pub use config::RouterConfig;
pub use placement::{Facts, Placement, Side, Unplaceable, Unplaced};
pub use router::{follows_kv_events, Router, RouterError, Running};
