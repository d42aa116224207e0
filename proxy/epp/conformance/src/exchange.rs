//! Playing Envoy: one ext_proc stream to the picker under test, the messages Envoy would send
//! (a request's headers, its body in chunks, the answer's headers and body), and what comes
//! back, each wait bounded.

use std::collections::HashMap;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use envoy_types::pb::google::protobuf::Struct;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Streaming;

/// Why an exchange could not go on.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    /// The picker could not be reached.
    #[error("cannot connect: {0}")]
    Connect(#[from] tonic::transport::Error),
    /// The stream failed.
    #[error("the stream failed: {0}")]
    Stream(#[from] tonic::Status),
    /// Nothing came back in time.
    #[error("no answer within {0:?}")]
    Silent(Duration),
    /// The picker ended the stream.
    #[error("the picker ended the stream")]
    Ended,
    /// The picker stopped reading.
    #[error("the picker stopped reading the stream")]
    Closed,
}

/// One ext_proc stream.
pub struct Exchange {
    sending: mpsc::Sender<ProcessingRequest>,
    answers: Streaming<ProcessingResponse>,
    /// Metadata sent with every message (the subset hint), as Envoy repeats it.
    metadata: Option<Metadata>,
    wait: Duration,
}

/// Connects to the picker at `endpoint` (`http://host:port`).
pub async fn connect(endpoint: &str) -> Result<ExternalProcessorClient<Channel>, ExchangeError> {
    let channel = Channel::from_shared(endpoint.to_owned())
        .map_err(|err| tonic::Status::invalid_argument(err.to_string()))?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await?;
    Ok(ExternalProcessorClient::new(channel).max_decoding_message_size(64 << 20))
}

impl Exchange {
    /// Opens a stream on `client`, each answer awaited at most `wait`; `metadata` goes with
    /// every message.
    pub async fn open(
        client: &mut ExternalProcessorClient<Channel>,
        metadata: Option<Metadata>,
        wait: Duration,
    ) -> Result<Self, ExchangeError> {
        let (sending, outbound) = mpsc::channel(64);
        let answers = client
            .process(ReceiverStream::new(outbound))
            .await?
            .into_inner();
        Ok(Exchange {
            sending,
            answers,
            metadata,
            wait,
        })
    }

    async fn send(&self, request: processing_request::Request) -> Result<(), ExchangeError> {
        let message = ProcessingRequest {
            request: Some(request),
            metadata_context: self.metadata.clone(),
            ..Default::default()
        };
        self.sending
            .send(message)
            .await
            .map_err(|_| ExchangeError::Closed)
    }

    /// Sends a request's headers (`end_of_stream`: it has no body).
    pub async fn request_headers(
        &self,
        method: &str,
        path: &str,
        end_of_stream: bool,
    ) -> Result<(), ExchangeError> {
        let headers = headers(&[
            (":method", method),
            (":path", path),
            (":authority", "conformance.local"),
            (":scheme", "http"),
            ("content-type", "application/json"),
            ("x-request-id", "epp-conformance"),
        ]);
        self.send(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(headers),
            end_of_stream,
            ..Default::default()
        }))
        .await
    }

    /// Sends a chunk of the request's body.
    pub async fn request_body(
        &self,
        body: &[u8],
        end_of_stream: bool,
    ) -> Result<(), ExchangeError> {
        self.send(processing_request::Request::RequestBody(HttpBody {
            body: body.to_vec(),
            end_of_stream,
            ..Default::default()
        }))
        .await
    }

    /// Sends the answer's headers with `:status`, reporting `served` as the endpoint that
    /// served the request.
    pub async fn response_headers(
        &mut self,
        status: u16,
        served: &str,
    ) -> Result<(), ExchangeError> {
        let lb = Struct {
            fields: HashMap::from([(crate::SERVED.to_owned(), crate::string(served))]),
        };
        let mut metadata = self.metadata.clone().unwrap_or_default();
        metadata.filter_metadata.insert(crate::LB.to_owned(), lb);
        let status = status.to_string();
        let message = ProcessingRequest {
            request: Some(processing_request::Request::ResponseHeaders(HttpHeaders {
                headers: Some(headers(&[
                    (":status", &status),
                    ("content-type", "text/event-stream"),
                ])),
                ..Default::default()
            })),
            metadata_context: Some(metadata),
            ..Default::default()
        };
        self.sending
            .send(message)
            .await
            .map_err(|_| ExchangeError::Closed)
    }

    /// Sends a chunk of the answer's body.
    pub async fn response_body(
        &self,
        body: &[u8],
        end_of_stream: bool,
    ) -> Result<(), ExchangeError> {
        self.send(processing_request::Request::ResponseBody(HttpBody {
            body: body.to_vec(),
            end_of_stream,
            ..Default::default()
        }))
        .await
    }

    /// The next answer.
    pub async fn answer(&mut self) -> Result<ProcessingResponse, ExchangeError> {
        match tokio::time::timeout(self.wait, self.answers.message()).await {
            Err(_) => Err(ExchangeError::Silent(self.wait)),
            Ok(Err(status)) => Err(ExchangeError::Stream(status)),
            Ok(Ok(None)) => Err(ExchangeError::Ended),
            Ok(Ok(Some(answer))) => Ok(answer),
        }
    }
}

/// Envoy's header map of `pairs` (values in `raw_value`, as Envoy sends them).
fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: (pairs.iter())
            .map(|(key, value)| HeaderValue {
                key: (*key).to_owned(),
                raw_value: value.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    }
}
