//! The protocol's rules, each checked on streams of its own: what a request must get back, how
//! the subset hint binds the choice, what the answer phase expects, and the health service.

use std::collections::BTreeSet;

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, CommonResponse, ProcessingResponse,
};
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::exchange::Exchange;
use crate::{Checker, DESTINATION, LB, SUBSET, SUBSET_NAMESPACE};

/// What a rule found: a note when it holds, why not when it fails.
pub type Outcome = Result<String, String>;

/// The destination an answer to the request's headers names.
pub struct Routed {
    /// `x-gateway-destination-endpoint`'s value.
    pub header: String,
    /// `envoy.lb` / `x-gateway-destination-endpoint` in the dynamic metadata, if any.
    pub metadata: Option<String>,
    /// Whether the route is to be re-evaluated (the header changed it).
    pub clear_route_cache: bool,
}

/// A completion request's body.
pub fn completion(checker: &Checker, prompt: &str) -> Vec<u8> {
    let mut body = serde_json::json!({"prompt": prompt, "max_tokens": 1});
    if let Some(model) = &checker.model {
        body["model"] = serde_json::Value::String(model.clone());
    }
    body.to_string().into_bytes()
}

/// The subset hint metadata: `entries` as a list, or as one comma-separated string.
pub fn subset(entries: &[&str], as_list: bool) -> Metadata {
    let value = match as_list {
        true => Value {
            kind: Some(Kind::ListValue(ListValue {
                values: entries.iter().map(|e| crate::string(e)).collect(),
            })),
        },
        false => crate::string(&entries.join(",")),
    };
    let hint = Struct {
        fields: [(SUBSET.to_owned(), value)].into(),
    };
    Metadata {
        filter_metadata: [(SUBSET_NAMESPACE.to_owned(), hint)].into(),
        ..Default::default()
    }
}

fn common(answer: &ProcessingResponse) -> Option<&CommonResponse> {
    match &answer.response {
        Some(processing_response::Response::RequestHeaders(h)) => h.response.as_ref(),
        _ => None,
    }
}

/// What `answer` is, in a few words.
pub fn kind(answer: &ProcessingResponse) -> String {
    use processing_response::Response;
    match &answer.response {
        Some(Response::RequestHeaders(_)) => "request_headers".into(),
        Some(Response::RequestBody(_)) => "request_body".into(),
        Some(Response::RequestTrailers(_)) => "request_trailers".into(),
        Some(Response::ResponseHeaders(_)) => "response_headers".into(),
        Some(Response::ResponseBody(_)) => "response_body".into(),
        Some(Response::ResponseTrailers(_)) => "response_trailers".into(),
        Some(Response::ImmediateResponse(i)) => {
            format!("an immediate {}", i.status.as_ref().map_or(0, |s| s.code))
        }
        Some(Response::StreamedImmediateResponse(_)) => "a streamed immediate answer".into(),
        None => "an empty answer".into(),
    }
}

/// The destination `answer` names, or why it names none.
pub fn routed(answer: &ProcessingResponse) -> Result<Routed, String> {
    let common =
        common(answer).ok_or_else(|| format!("got {}, not a headers answer", kind(answer)))?;
    let set = (common.header_mutation.as_ref()).map_or(&[][..], |m| &m.set_headers[..]);
    let header = (set.iter().filter_map(|o| o.header.as_ref()))
        .find(|h| h.key.eq_ignore_ascii_case(DESTINATION))
        .map(|h| match h.raw_value.is_empty() {
            true => h.value.clone(),
            false => String::from_utf8_lossy(&h.raw_value).into_owned(),
        })
        .ok_or_else(|| format!("no {DESTINATION} header set"))?;
    let port = header
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse::<u16>().ok());
    if header.contains(',') || port.is_none() {
        return Err(format!("{DESTINATION} is {header:?}, not one ip:port"));
    }
    let metadata = (answer.dynamic_metadata.as_ref())
        .and_then(|m| m.fields.get(LB))
        .and_then(|lb| match &lb.kind {
            Some(Kind::StructValue(lb)) => lb.fields.get(DESTINATION),
            _ => None,
        })
        .and_then(|value| match &value.kind {
            Some(Kind::StringValue(text)) => Some(text.clone()),
            _ => None,
        });
    Ok(Routed {
        header,
        metadata,
        clear_route_cache: common.clear_route_cache,
    })
}

/// The status of an immediate answer, if `answer` is one.
pub fn immediate(answer: &ProcessingResponse) -> Option<u16> {
    match &answer.response {
        Some(processing_response::Response::ImmediateResponse(i)) => {
            i.status.as_ref().map(|s| s.code as u16)
        }
        _ => None,
    }
}

/// The streamed body chunk `answer` carries (of the request, or of the answer with
/// `response`), with its end-of-stream mark.
fn streamed(answer: &ProcessingResponse, response: bool) -> Result<(Vec<u8>, bool), String> {
    use processing_response::Response;
    let body = match (&answer.response, response) {
        (Some(Response::RequestBody(body)), false) | (Some(Response::ResponseBody(body)), true) => {
            body
        }
        _ => return Err(format!("got {} where a body chunk was due", kind(answer))),
    };
    let mutation = (body.response.as_ref())
        .and_then(|c| c.body_mutation.as_ref())
        .and_then(|m| m.mutation.as_ref());
    match mutation {
        Some(body_mutation::Mutation::StreamedResponse(chunk)) => {
            Ok((chunk.body.clone(), chunk.end_of_stream))
        }
        _ => Err("a body answer without a streamed body mutation".into()),
    }
}

/// Reads the request's body back, chunk by chunk, until its end.
pub async fn body_back(exchange: &mut Exchange) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    loop {
        let answer = exchange.answer().await.map_err(|e| e.to_string())?;
        let (chunk, end) = streamed(&answer, false)?;
        body.extend(chunk);
        if end {
            return Ok(body);
        }
    }
}

/// Sends a completion (`body` in `chunks`, the HTTP/1.1 way when `empty_end`: the data, then an
/// empty chunk ending it) with `metadata`; returns the first answer and the stream.
pub async fn send_request(
    checker: &mut Checker,
    metadata: Option<Metadata>,
    body: &[u8],
    chunks: usize,
    empty_end: bool,
) -> Result<(ProcessingResponse, Exchange), String> {
    let mut exchange = checker.open(metadata).await?;
    let fail = |e: crate::exchange::ExchangeError| e.to_string();
    exchange
        .request_headers("POST", "/v1/completions", false)
        .await
        .map_err(fail)?;
    let size = body.len().div_ceil(chunks.max(1)).max(1);
    let parts: Vec<&[u8]> = body.chunks(size).collect();
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len() && !empty_end;
        exchange.request_body(part, last).await.map_err(fail)?;
    }
    if empty_end {
        exchange.request_body(b"", true).await.map_err(fail)?;
    }
    let answer = exchange.answer().await.map_err(fail)?;
    Ok((answer, exchange))
}

/// Routes requests until the endpoints stop changing: the pool as the picker shows it.
pub async fn discover(checker: &mut Checker) -> Result<BTreeSet<String>, String> {
    let mut seen = BTreeSet::new();
    for i in 0..16 {
        let body = completion(checker, &format!("discovery prompt {i}"));
        let (answer, _) = send_request(checker, None, &body, 1, false).await?;
        seen.insert(routed(&answer)?.header);
    }
    Ok(seen)
}

/// R1: a request is routed once its body is complete, in the header and the metadata alike.
pub async fn routes_in_header_and_metadata(checker: &mut Checker) -> Outcome {
    let body = completion(checker, "the header and the metadata");
    let (answer, _) = send_request(checker, None, &body, 1, true).await?;
    let routed = routed(&answer)?;
    if routed.header.contains(',') || routed.header.rsplit_once(':').is_none() {
        return Err(format!(
            "{DESTINATION} is {:?}, not one ip:port",
            routed.header
        ));
    }
    match routed.metadata {
        Some(metadata) if metadata == routed.header => Ok(routed.header),
        Some(metadata) => Err(format!("header {} but metadata {metadata}", routed.header)),
        None => Err(format!("no {LB}/{DESTINATION} in the dynamic metadata")),
    }
}

/// R2: the answer to the headers asks Envoy to route again (the header changed the route).
pub async fn clears_the_route_cache(checker: &mut Checker) -> Outcome {
    let body = completion(checker, "route cache");
    let (answer, _) = send_request(checker, None, &body, 1, false).await?;
    match routed(&answer)?.clear_route_cache {
        true => Ok("clear_route_cache set".into()),
        false => Err("clear_route_cache is not set: Envoy keeps the route chosen before".into()),
    }
}

/// R3: the body comes back whole after the headers answer, in order, ending once.
pub async fn returns_the_body(checker: &mut Checker, size: usize, chunks: usize) -> Outcome {
    let body = completion(checker, &"x".repeat(size));
    let (answer, mut exchange) = send_request(checker, None, &body, chunks, true).await?;
    routed(&answer)?;
    let back = body_back(&mut exchange).await?;
    match back == body {
        true => Ok(format!(
            "{} bytes sent in {chunks} chunks came back whole",
            body.len()
        )),
        false => Err(format!(
            "sent {} bytes, got {} back, not the same",
            body.len(),
            back.len()
        )),
    }
}

/// R4: a request without a body (headers ending the stream) is routed at once.
pub async fn routes_a_bodyless_request(checker: &mut Checker) -> Outcome {
    let mut exchange = checker.open(None).await?;
    let fail = |e: crate::exchange::ExchangeError| e.to_string();
    exchange
        .request_headers("GET", "/v1/models", true)
        .await
        .map_err(fail)?;
    let answer = exchange.answer().await.map_err(fail)?;
    Ok(routed(&answer)?.header)
}

/// R5: a subset hint limits the choice to it (`as_list`: a list value, else Envoy's
/// comma-separated string); checked for every endpoint seen.
pub async fn honours_the_subset(
    checker: &mut Checker,
    endpoints: &BTreeSet<String>,
    as_list: bool,
) -> Outcome {
    for endpoint in endpoints {
        for _ in 0..3 {
            let body = completion(checker, "a subset of one");
            let metadata = subset(&[endpoint], as_list);
            let (answer, _) = send_request(checker, Some(metadata), &body, 1, false).await?;
            let picked = routed(&answer)?.header;
            if &picked != endpoint {
                return Err(format!("subset [{endpoint}] but {picked} picked"));
            }
        }
    }
    Ok(format!(
        "{} endpoint(s), each picked alone",
        endpoints.len()
    ))
}

/// R6: an empty subset, or one with no eligible endpoint, is an immediate 503.
pub async fn refuses_an_empty_subset(checker: &mut Checker, entries: &[&str]) -> Outcome {
    let body = completion(checker, "nothing eligible");
    let (answer, _) = send_request(checker, Some(subset(entries, true)), &body, 1, false).await?;
    match immediate(&answer) {
        Some(503) => Ok("503".into()),
        _ => Err(format!("got {}, not an immediate 503", kind(&answer))),
    }
}

/// R7: a body that is not JSON is refused at once with a 4xx.
pub async fn refuses_a_broken_body(checker: &mut Checker) -> Outcome {
    let (answer, _) = send_request(checker, None, b"{not json", 1, false).await?;
    match immediate(&answer) {
        Some(status) if (400..500).contains(&status) => Ok(status.to_string()),
        _ => Err(format!("got {}, not an immediate 4xx", kind(&answer))),
    }
}

/// R8: the answer phase goes through: its headers (with the endpoint that served it) are
/// answered, its body chunks echoed in full-duplex mode.
pub async fn lets_the_answer_through(checker: &mut Checker) -> Outcome {
    let body = completion(checker, "the answer phase");
    let (answer, mut exchange) = send_request(checker, None, &body, 1, false).await?;
    let endpoint = routed(&answer)?.header;
    body_back(&mut exchange).await?;
    let fail = |e: crate::exchange::ExchangeError| e.to_string();
    exchange
        .response_headers(200, &endpoint)
        .await
        .map_err(fail)?;
    let answer = exchange.answer().await.map_err(fail)?;
    if !matches!(
        answer.response,
        Some(processing_response::Response::ResponseHeaders(_))
    ) {
        return Err(format!("got {} for the answer's headers", kind(&answer)));
    }
    let chunks: [&[u8]; 2] = [b"data: {\"choices\": []}\n\n", b"data: [DONE]\n\n"];
    for (i, chunk) in chunks.iter().enumerate() {
        exchange.response_body(chunk, i == 1).await.map_err(fail)?;
        let answer = exchange.answer().await.map_err(fail)?;
        let (echoed, end) = streamed(&answer, true)?;
        if echoed != *chunk || end != (i == 1) {
            return Err(format!("answer chunk {i} came back changed"));
        }
    }
    Ok(format!(
        "served by {endpoint}; headers answered, 2 chunks echoed"
    ))
}

/// R9: the health service answers for liveness, readiness and the ext_proc service.
pub async fn reports_health(checker: &Checker) -> Outcome {
    let channel = tonic::transport::Channel::from_shared(checker.endpoint.clone())
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    let mut health = HealthClient::new(channel);
    let mut statuses = Vec::new();
    for service in [
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        let request = HealthCheckRequest {
            service: service.to_owned(),
        };
        let answer = tokio::time::timeout(checker.wait, health.check(request))
            .await
            .map_err(|_| format!("{service}: no answer within {:?}", checker.wait))?
            .map_err(|status| format!("{service}: {}", status.message()))?;
        let status = answer.into_inner().status;
        if status != ServingStatus::Serving as i32 {
            return Err(format!("{service} is not SERVING ({status})"));
        }
        statuses.push(service);
    }
    Ok(format!("{} SERVING", statuses.join(", ")))
}
