//! SGLang's P/D (what its router does): the client's body to P and to D at the same time, with
//! `bootstrap_host` and `bootstrap_port` (P's bootstrap server) and one random `bootstrap_room`
//! added, which D uses to find P's KV. The room also carries the chosen prefill dp rank: it is
//! drawn so that `room % dp_size` is that rank, which is how a prefill that follows the
//! bootstrap room (SGLang's default) picks its dp rank.

use bytes::Bytes;
use pd_protocol::sglang::BootstrapFields;
use pd_protocol::Rank;

use super::{Call, Refusal, Started};
use crate::error::ApiError;
use crate::metrics::Outcome;
use pd_router::body::{raw_json, Body, Edit};

/// The largest bootstrap room: SGLang's rooms are 0 to 2^63 - 1.
const MAX_ROOM: u64 = (1 << 63) - 1;

/// A room from `random` whose remainder modulo `dp_size` is `rank`.
fn room(random: u64, rank: Rank, dp_size: Rank) -> u64 {
    let dp_size = u64::from(dp_size.max(1));
    (random % (MAX_ROOM / dp_size)) * dp_size + u64::from(rank) % dp_size
}

/// P's bootstrap server as SGLang's host and port (`http://host:port`, IPv6 hosts unbracketed).
fn bootstrap_of(addr: &str) -> Option<(String, u16)> {
    let rest = addr.split_once("://").map_or(addr, |(_, rest)| rest);
    let (host, port) = rest.trim_end_matches('/').rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some((host.to_owned(), port.parse().ok()?))
}

/// Runs the SGLang flow.
pub(super) async fn run(call: Call<'_>, body: &Body<'_>) -> Result<Started, Refusal> {
    let addr = call.pair.bootstrap_addr.as_deref();
    let Some((host, port)) = addr.and_then(bootstrap_of) else {
        let who = format!(
            "prefill {} (bootstrap address {})",
            call.pair.backend.url(),
            addr.unwrap_or("none")
        );
        return Err(Refusal::from((
            ApiError::bad_gateway("the prefill has no usable bootstrap address").failed_at(who),
            Outcome::PrefillError,
        )));
    };
    let random = call.request.state.ids.next().as_u64_pair().0;
    let fields = BootstrapFields {
        bootstrap_host: host,
        bootstrap_port: port,
        bootstrap_room: room(random, call.pair.dp_rank, call.pair.dp_size),
    };
    let (host, port, room) = (
        raw_json(&fields.bootstrap_host),
        fields.bootstrap_port.to_string(),
        fields.bootstrap_room.to_string(),
    );
    let bootstrap = [
        Edit::Set("bootstrap_host", &host),
        Edit::Set("bootstrap_port", &port),
        Edit::Set("bootstrap_room", &room),
    ];
    let decode_body = Bytes::from(body.render(&bootstrap));
    // P only computes the prompt: it answers whole.
    let [host, port, room] = bootstrap;
    let prefill_body = Bytes::from(body.render(&[host, port, room, Edit::Set("stream", "false")]));
    let prefill = call.prefill(prefill_body);
    let overhead = call.start().elapsed();
    call.decode(body, decode_body, Some(prefill), None, overhead, None)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rooms_carry_the_dp_rank_and_stay_in_sglang_range() {
        for (random, rank, size) in [(u64::MAX, 3, 4), (0, 0, 1), (12345, 1, 2), (u64::MAX, 0, 1)] {
            let room = room(random, rank, size);
            assert!(room <= MAX_ROOM);
            assert_eq!(room % u64::from(size), u64::from(rank));
        }
        assert_eq!(
            bootstrap_of("http://10.0.0.5:8998"),
            Some(("10.0.0.5".into(), 8998))
        );
        assert_eq!(
            bootstrap_of("http://[fd00::1]:8998"),
            Some(("fd00::1".into(), 8998))
        );
    }
}
