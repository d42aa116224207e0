//! The checker fails a picker that breaks the rules: a sloppy picker (a list of endpoints in
//! the header and no metadata, the route cache kept, the body never sent back, the subset
//! ignored, no health service) runs here, and every rule it breaks is a FAIL line.

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, processing_response, CommonResponse, HeaderMutation, HeadersResponse,
    ProcessingRequest, ProcessingResponse,
};
use pd_epp_conformance::Checker;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

struct Sloppy;

#[tonic::async_trait]
impl ExternalProcessor for Sloppy {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let (out, answers) = mpsc::channel(16);
        let mut inbound = request.into_inner();
        tokio::spawn(async move {
            while let Ok(Some(message)) = inbound.message().await {
                let ended = match message.request {
                    Some(processing_request::Request::RequestHeaders(h)) => h.end_of_stream,
                    Some(processing_request::Request::RequestBody(b)) => b.end_of_stream,
                    _ => false,
                };
                if !ended {
                    continue;
                }
                let header = HeaderValueOption {
                    header: Some(HeaderValue {
                        key: "x-gateway-destination-endpoint".into(),
                        raw_value: b"10.0.0.1:8000,10.0.0.2:8000".to_vec(),
                        ..Default::default()
                    }),
                    ..Default::default()
                };
                let answer = ProcessingResponse {
                    response: Some(processing_response::Response::RequestHeaders(
                        HeadersResponse {
                            response: Some(CommonResponse {
                                header_mutation: Some(HeaderMutation {
                                    set_headers: vec![header],
                                    remove_headers: Vec::new(),
                                }),
                                ..Default::default()
                            }),
                        },
                    )),
                    ..Default::default()
                };
                let _ = out.send(Ok(answer)).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(answers)))
    }
}

#[tokio::test]
async fn a_picker_breaking_the_rules_fails_them() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(ExternalProcessorServer::new(Sloppy))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let wait = Duration::from_millis(300);
    let mut checker = Checker::connect(&addr.to_string(), None, wait)
        .await
        .unwrap();
    let verdicts = checker.run(|_| {}).await;
    let failed: Vec<&str> = (verdicts.iter())
        .filter(|v| v.outcome.is_err())
        .map(|v| v.rule)
        .collect();
    for broken in [
        "health: liveness, readiness and the ext_proc service are SERVING",
        "a complete request is routed in the header and the envoy.lb metadata alike, one ip:port",
        "the headers answer clears the route cache",
        "a body in several chunks comes back whole",
        "a subset hint (a list) binds the choice",
        "an empty subset is an immediate 503",
        "a body that is not JSON is an immediate 4xx",
        "the answer phase goes through (headers answered, body chunks echoed)",
    ] {
        assert!(failed.contains(&broken), "{broken:?} passed: {verdicts:#?}");
    }
    // Every rule fails: even its answer to a bodyless request names a list, not one endpoint.
    assert_eq!(failed.len(), verdicts.len(), "{verdicts:#?}");
}
