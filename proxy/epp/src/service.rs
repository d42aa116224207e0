//! The gRPC services: Envoy's `ExternalProcessor` (each stream an [`Exchange`] on a task of
//! its own) and the gRPC health protocol, whose `readiness` and ext_proc service turn serving
//! once a request can be placed ([`Shared::is_ready`]), `liveness` as soon as the process
//! answers.

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use crate::exchange::Exchange;
use crate::state::Shared;

/// The ext_proc service.
pub(crate) struct Picker(pub Arc<Shared>);

/// Messages an exchange may have waiting for Envoy (its body chunks among them).
const OUTBOUND: usize = 64;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let (out, answers) = mpsc::channel(OUTBOUND);
        tokio::spawn(Exchange::new(self.0.clone(), out).run(request.into_inner()));
        Ok(Response::new(ReceiverStream::new(answers)))
    }
}

/// The names health is reported under: GIE's `readiness` and the ext_proc service's.
const READINESS: [&str; 2] = ["readiness", "envoy.service.ext_proc.v3.ExternalProcessor"];

/// Keeps `reporter`'s statuses true: `liveness` and the overall status serving, readiness
/// following [`Shared::is_ready`] (checked every `every`) until `draining` says not.
pub(crate) async fn report_health(
    reporter: HealthReporter,
    shared: Arc<Shared>,
    draining: pd_service::Draining,
    every: Duration,
) {
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    reporter
        .set_service_status("", ServingStatus::Serving)
        .await;
    let mut last = None;
    loop {
        let ready = shared.is_ready() && !draining.is_draining();
        if last != Some(ready) {
            let status = match ready {
                true => ServingStatus::Serving,
                false => ServingStatus::NotServing,
            };
            for name in READINESS {
                reporter.set_service_status(name, status).await;
            }
            tracing::info!(ready, "readiness");
            last = Some(ready);
        }
        tokio::time::sleep(every).await;
    }
}

/// The ext_proc server of `shared`, taking request bodies up to its limit in one message.
pub(crate) fn ext_proc(shared: Arc<Shared>) -> ExternalProcessorServer<Picker> {
    let largest = shared.max_body_bytes.saturating_add(64 * 1024);
    ExternalProcessorServer::new(Picker(shared)).max_decoding_message_size(largest)
}
