//! The Gateway API Inference Extension's endpoint picker protocol, on Envoy's external
//! processing messages: the names it fixes and the messages pd-epp sends.
//!
//! - The picked endpoint goes out twice, identical: in the request header
//!   `x-gateway-destination-endpoint` and in the dynamic metadata `envoy.lb`
//!   / `x-gateway-destination-endpoint`, as one `ip:port`.
//! - The gateway may limit the choice to a subset: filter metadata `envoy.lb.subset_hint` /
//!   `x-gateway-destination-endpoint-subset`, a list of `ip:port` (or one comma-separated
//!   string, as Envoy's `header_to_metadata` makes it); present but empty or matching nothing,
//!   the answer is 503.
//! - Nothing eligible: an immediate 503; a request shed: 429.
//! - In the response phase the gateway reports the endpoint that served the request in
//!   `envoy.lb` / `x-gateway-destination-endpoint-served`.
//!
//! Bodies are exchanged in `FULL_DUPLEX_STREAMED` mode, as the protocol asks: the picker
//! buffers the request's body, answers its headers once the body is complete, then sends the
//! body back in chunks. A gateway may send them `BUFFERED` instead (Envoy then keeps the body,
//! so it can fail open and time the picker out): the headers are let through at once and the
//! endpoint is named in the answer to the whole body.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation,
    HeadersResponse, ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

/// The request header, and the `envoy.lb` metadata key, naming the picked endpoint.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata namespace of the destination.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The metadata key of the subset hint.
pub const SUBSET: &str = "x-gateway-destination-endpoint-subset";
/// The `envoy.lb` key naming the endpoint that served the request (response phase).
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// llm-d's header naming the prefill of a P/D request (`ip:port`) for the decode's sidecar.
pub const PREFILLER: &str = "x-prefiller-host-port";
/// The prefill's dp rank, beside [`PREFILLER`], for the sidecar.
pub const PREFILL_DP_RANK: &str = "x-pd-prefill-dp-rank";
/// The largest body chunk sent back to Envoy (GIE's reference picker's).
pub const BODY_CHUNK: usize = 62_000;

/// A header's value as Envoy sends it (in `raw_value`, else `value`).
pub fn header_value(header: &HeaderValue) -> &[u8] {
    if header.raw_value.is_empty() {
        header.value.as_bytes()
    } else {
        &header.raw_value
    }
}

/// A header to set (replacing any value the client sent).
pub fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn string(text: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(text.to_owned())),
    }
}

/// The `envoy.lb` dynamic metadata naming `endpoint`.
fn destination_metadata(endpoint: &str) -> Struct {
    let inner = Struct {
        fields: HashMap::from([(DESTINATION.to_owned(), string(endpoint))]),
    };
    Struct {
        fields: HashMap::from([(
            LB_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]),
    }
}

/// The answer naming `endpoint`, with `mutation`'s other headers set and removed: to the
/// request's headers (full-duplex bodies: sent once the body is complete), or, with `buffered`
/// bodies, to the body (its headers were let through unchanged; they are changed now, before
/// anything goes upstream), then carrying `body` when it changed.
pub fn route_to(
    endpoint: &str,
    mut mutation: HeaderMutation,
    buffered: bool,
    body: Option<&[u8]>,
) -> ProcessingResponse {
    mutation.set_headers.push(set_header(DESTINATION, endpoint));
    let mut common = CommonResponse {
        header_mutation: Some(mutation),
        clear_route_cache: true,
        ..Default::default()
    };
    let response = match buffered {
        false => processing_response::Response::RequestHeaders(HeadersResponse {
            response: Some(common),
        }),
        true => {
            common.body_mutation = body.map(|body| BodyMutation {
                mutation: Some(body_mutation::Mutation::Body(body.to_vec())),
            });
            processing_response::Response::RequestBody(BodyResponse {
                response: Some(common),
            })
        }
    };
    ProcessingResponse {
        response: Some(response),
        dynamic_metadata: Some(destination_metadata(endpoint)),
        ..Default::default()
    }
}

/// The request's body sent back in chunks, the last one ending the stream unless trailers
/// follow (`ends`: they do not); one empty message for an empty body.
pub fn body_chunks(body: &[u8], ends: bool) -> Vec<ProcessingResponse> {
    let chunks: Vec<&[u8]> = match body.is_empty() {
        true => vec![&[]],
        false => body.chunks(BODY_CHUNK).collect(),
    };
    let last = chunks.len() - 1;
    (chunks.into_iter().enumerate())
        .map(|(i, chunk)| streamed_body(chunk, ends && i == last, false))
        .collect()
}

/// A body chunk in full-duplex streamed mode: of the request, or (`response`) of the answer.
pub fn streamed_body(chunk: &[u8], end_of_stream: bool, response: bool) -> ProcessingResponse {
    let common = CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(body_mutation::Mutation::StreamedResponse(
                StreamedBodyResponse {
                    body: chunk.to_vec(),
                    end_of_stream,
                    ..Default::default()
                },
            )),
        }),
        ..Default::default()
    };
    body_answer(common, response)
}

/// The answer to a body chunk let through unchanged (a body not sent full duplex).
pub fn body_seen(response: bool) -> ProcessingResponse {
    body_answer(CommonResponse::default(), response)
}

/// The answer to headers let through unchanged: the answer's, or (`response` false) the
/// request's when its body comes buffered after them (the endpoint is named with the body).
pub fn headers_seen(response: bool) -> ProcessingResponse {
    let headers = HeadersResponse {
        response: Some(CommonResponse::default()),
    };
    answer(match response {
        true => processing_response::Response::ResponseHeaders(headers),
        false => processing_response::Response::RequestHeaders(headers),
    })
}

/// The answer to trailers: nothing changed.
pub fn trailers_seen(response: bool) -> ProcessingResponse {
    let trailers = TrailersResponse::default();
    answer(match response {
        true => processing_response::Response::ResponseTrailers(trailers),
        false => processing_response::Response::RequestTrailers(trailers),
    })
}

/// `common` as the answer to a body message: the answer's (`response`) or the request's.
fn body_answer(common: CommonResponse, response: bool) -> ProcessingResponse {
    let body = BodyResponse {
        response: Some(common),
    };
    answer(match response {
        true => processing_response::Response::ResponseBody(body),
        false => processing_response::Response::RequestBody(body),
    })
}

/// A message carrying `response` alone.
fn answer(response: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..Default::default()
    }
}

/// An answer Envoy gives the client at once, instead of routing: `status` with a JSON `body`.
pub fn immediate(status: u16, body: &str, headers: &[(&str, &str)]) -> ProcessingResponse {
    let mut set_headers = vec![set_header("content-type", "application/json")];
    set_headers.extend(headers.iter().map(|(key, value)| set_header(key, value)));
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(status),
                }),
                headers: Some(HeaderMutation {
                    set_headers,
                    remove_headers: Vec::new(),
                }),
                body: body.as_bytes().to_vec(),
                details: format!("pd_epp_{status}"),
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

/// The subset the gateway limits the choice to, if it does: the `ip:port` (or bare `ip`)
/// entries of the hint, as a list of strings or comma-separated strings.
pub fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    let hint = metadata?
        .filter_metadata
        .get(SUBSET_NAMESPACE)?
        .fields
        .get(SUBSET)?;
    let mut entries = Vec::new();
    let mut add = |value: &Value| {
        if let Some(Kind::StringValue(text)) = &value.kind {
            entries.extend(
                (text.split(','))
                    .map(str::trim)
                    .filter(|entry| !entry.is_empty())
                    .map(str::to_owned),
            );
        }
    };
    match &hint.kind {
        Some(Kind::ListValue(list)) => list.values.iter().for_each(&mut add),
        _ => add(hint),
    }
    Some(entries)
}

/// The endpoint that served the request, as the gateway reports it in the response phase.
pub fn served(metadata: Option<&Metadata>) -> Option<&str> {
    let lb = metadata?.filter_metadata.get(LB_NAMESPACE)?;
    match &lb.fields.get(SERVED)?.kind {
        Some(Kind::StringValue(endpoint)) => Some(endpoint),
        _ => None,
    }
}

/// Whether `endpoint` (`ip:port`) is in `subset`, whose entries are `ip:port` or a bare `ip`.
pub fn in_subset(subset: &[String], endpoint: &str) -> bool {
    let host = endpoint.rsplit_once(':').map_or(endpoint, |(host, _)| host);
    subset
        .iter()
        .any(|entry| entry == endpoint || entry == host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::ListValue;

    fn hint(value: Value) -> Metadata {
        let inner = Struct {
            fields: HashMap::from([(SUBSET.to_owned(), value)]),
        };
        Metadata {
            filter_metadata: HashMap::from([(SUBSET_NAMESPACE.to_owned(), inner)]),
            ..Default::default()
        }
    }

    #[test]
    fn a_subset_is_read_as_a_list_or_as_one_string() {
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![string("10.0.0.1:8000"), string("10.0.0.2:8000")],
            })),
        };
        let from_list = subset_hint(Some(&hint(list))).unwrap();
        let from_text = subset_hint(Some(&hint(string("10.0.0.1:8000, 10.0.0.2:8000")))).unwrap();
        assert_eq!(from_list, from_text);
        assert_eq!(from_list, ["10.0.0.1:8000", "10.0.0.2:8000"]);
        assert_eq!(subset_hint(Some(&hint(string("")))), Some(Vec::new()));
        assert_eq!(subset_hint(Some(&Metadata::default())), None);
        assert_eq!(subset_hint(None), None);
    }

    #[test]
    fn subset_entries_match_an_address_or_its_host() {
        let subset = ["10.0.0.1:8000".to_owned(), "10.0.0.3".to_owned()];
        assert!(in_subset(&subset, "10.0.0.1:8000"));
        assert!(!in_subset(&subset, "10.0.0.1:8001"));
        assert!(in_subset(&subset, "10.0.0.3:9000"));
        assert!(!in_subset(&subset, "10.0.0.2:8000"));
        assert!(!in_subset(&[], "10.0.0.1:8000"));
    }

    #[test]
    fn a_large_body_goes_back_in_chunks_ending_the_stream_once() {
        let body = vec![b'x'; BODY_CHUNK * 2 + 5];
        let chunks = body_chunks(&body, true);
        assert_eq!(chunks.len(), 3);
        let ends: Vec<bool> = chunks
            .iter()
            .map(|chunk| match &chunk.response {
                Some(processing_response::Response::RequestBody(body)) => {
                    match body
                        .response
                        .as_ref()
                        .and_then(|r| r.body_mutation.as_ref())
                    {
                        Some(BodyMutation {
                            mutation: Some(body_mutation::Mutation::StreamedResponse(s)),
                        }) => s.end_of_stream,
                        _ => panic!("not a streamed body"),
                    }
                }
                _ => panic!("not a request body"),
            })
            .collect();
        assert_eq!(ends, [false, false, true]);
        // Trailers follow: no chunk ends the stream, they do.
        let before_trailers = body_chunks(&body, false);
        assert!(before_trailers.iter().all(|chunk| match &chunk.response {
            Some(processing_response::Response::RequestBody(body)) => !matches!(
                body.response.as_ref().and_then(|r| r.body_mutation.as_ref()),
                Some(BodyMutation { mutation: Some(body_mutation::Mutation::StreamedResponse(s)) }) if s.end_of_stream
            ),
            _ => false,
        }));
        assert_eq!(body_chunks(b"", true).len(), 1);
    }

    #[test]
    fn the_destination_is_in_the_header_and_the_metadata_alike() {
        let answer = route_to("10.0.0.1:8000", HeaderMutation::default(), false, None);
        let metadata = answer.dynamic_metadata.unwrap();
        let Some(Kind::StructValue(lb)) = &metadata.fields[LB_NAMESPACE].kind else {
            panic!("no envoy.lb struct");
        };
        assert_eq!(lb.fields[DESTINATION], string("10.0.0.1:8000"));
        let Some(processing_response::Response::RequestHeaders(headers)) = answer.response else {
            panic!("not a headers answer");
        };
        let common = headers.response.unwrap();
        assert!(common.clear_route_cache);
        let set = &common.header_mutation.unwrap().set_headers;
        let header = set[0].header.as_ref().unwrap();
        assert_eq!(
            (header.key.as_str(), header_value(header)),
            (DESTINATION, &b"10.0.0.1:8000"[..])
        );
    }
}
