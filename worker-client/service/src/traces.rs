//! Traces over OTLP, for the servers: off unless the standard variables name a collector
//! (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`, HTTP with protobuf;
//! `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` keep them off). The SDK reads the
//! rest of the standard variables itself: the sampler (`OTEL_TRACES_SAMPLER`,
//! `OTEL_TRACES_SAMPLER_ARG`; parent-based always-on by default), the batch's delay and sizes
//! (`OTEL_BSP_*`), `OTEL_SERVICE_NAME`, the endpoint's headers and timeout.
//!
//! [`enabled`] is one relaxed load: callers check it before they make a span or read a
//! `traceparent`, so with traces off a request pays nothing else. W3C trace context
//! (`traceparent`, `tracestate`) goes in and out through [`extract`] and [`inject`].

use std::sync::atomic::{AtomicBool, Ordering};

use axum::http::HeaderMap;
use opentelemetry::global::{self, BoxedTracer};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::Context;
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether traces are exported (checked before any span is made).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The tracer of this process (a no-op one while traces are off).
pub fn tracer() -> BoxedTracer {
    global::tracer("pd-bootstrap")
}

/// The trace context a request carries (`traceparent`, `tracestate`); an empty context when it
/// carries none or a malformed one.
pub fn extract(headers: &HeaderMap) -> Context {
    TraceContextPropagator::new().extract(&HeaderExtractor(headers))
}

/// Writes `context`'s `traceparent` (and `tracestate`) into `headers`.
pub fn inject(context: &Context, headers: &mut HeaderMap) {
    TraceContextPropagator::new().inject_context(context, &mut HeaderInjector(headers));
}

/// The exporter while traces are on; [`Traces::shutdown`] flushes what is still queued.
pub struct Traces {
    provider: Option<SdkTracerProvider>,
}

impl Traces {
    /// [`init_traces`] off the async runtime (the exporter's HTTP client blocks).
    pub async fn start(service: &'static str) -> Traces {
        let started = tokio::task::spawn_blocking(move || init_traces(service)).await;
        started.unwrap_or(Traces { provider: None })
    }

    /// [`Traces::shutdown`] off the async runtime: at a server's exit.
    pub async fn finish(self) {
        let _ = tokio::task::spawn_blocking(move || self.shutdown()).await;
    }

    /// Sends the spans still queued (bounded by the exporter's timeout) and stops exporting.
    pub fn shutdown(self) {
        if let Some(provider) = self.provider {
            ENABLED.store(false, Ordering::Relaxed);
            if let Err(err) = provider.shutdown() {
                tracing::warn!("traces: the last spans could not be sent: {err}");
            }
        }
    }
}

/// Starts exporting traces as `service` when the environment asks for it (see the module's
/// documentation); logs where they go, or why not.
pub fn init_traces(service: &'static str) -> Traces {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let endpoint =
        var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| var("OTEL_EXPORTER_OTLP_ENDPOINT"));
    let disabled = var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
        || var("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"));
    let Some(endpoint) = endpoint.filter(|_| !disabled) else {
        return Traces { provider: None };
    };
    if let Some(protocol) =
        var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL").or_else(|| var("OTEL_EXPORTER_OTLP_PROTOCOL"))
    {
        if protocol != "http/protobuf" {
            tracing::warn!(
                protocol,
                "traces: only OTLP over HTTP with protobuf is built in; using it"
            );
        }
    }
    let exporter = match opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .build()
    {
        Ok(exporter) => exporter,
        Err(err) => {
            tracing::error!("traces: cannot export to {endpoint}: {err}; traces are off");
            return Traces { provider: None };
        }
    };
    let mut resource = Resource::builder();
    if var("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(service);
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    global::set_tracer_provider(provider.clone());
    ENABLED.store(true, Ordering::Relaxed);
    tracing::info!(endpoint, "traces: exported over OTLP");
    Traces {
        provider: Some(provider),
    }
}
