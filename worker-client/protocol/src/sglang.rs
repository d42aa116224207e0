//! SGLang's P/D bootstrap wire (`sglang.srt.disaggregation.common.conn`): what a prefill rank
//! sends to `PUT /route`, what a decode reads from `GET /route`, the bootstrap-room routes, and
//! the fields SGLang's router puts in P's and D's bodies.
//!
//! Field names and shapes are SGLang's; see `docs/protocol.md` for the routes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::Rank;

/// `PUT /route`: one prefill rank registers (every rank sends its own row).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteRow {
    /// Attention tensor-parallel size.
    pub attn_tp_size: Rank,
    /// This rank's attention tp rank.
    pub attn_tp_rank: Rank,
    /// Attention context-parallel size.
    pub attn_cp_size: Rank,
    /// This rank's attention cp rank.
    pub attn_cp_rank: Rank,
    /// Attention data-parallel size.
    pub attn_dp_size: Rank,
    /// This rank's attention dp rank.
    pub attn_dp_rank: Rank,
    /// Pipeline-parallel size.
    pub pp_size: Rank,
    /// This rank's pp rank.
    pub pp_rank: Rank,
    /// System data-parallel size (1 when dp is attention-only).
    pub system_dp_size: Rank,
    /// This rank's system dp rank.
    pub system_dp_rank: Rank,
    /// Where this rank serves its KV.
    pub rank_ip: String,
    /// Its port.
    pub rank_port: u16,
    /// Tokens per KV page.
    pub page_size: u32,
    /// The KV cache's element type.
    pub kv_cache_dtype: String,
    /// The KV layout, when not the default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_layout: Option<Value>,
    /// DeepSeek V4.1's speculative layout, when used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dsv41_spec_layout: Option<Value>,
    /// How requests pick a prefill dp rank (`follow_bootstrap_room` by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_balance_method: Option<String>,
    /// Whether the DSA cache is split by layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_dsa_cache_layer_split: Option<bool>,
    /// Whether the KV cache is sharded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_kv_cache_sharding: Option<bool>,
    /// The prefill's HTTP port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_http_port: Option<u16>,
    /// How decode allocates (`early` by default); every row must agree.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_allocation_policy: Option<String>,
}

impl RouteRow {
    /// The dp group of this rank: the attention dp rank, or the system dp rank when there is
    /// system dp.
    pub fn dp_rank(&self) -> Rank {
        if self.system_dp_size == 1 {
            self.attn_dp_rank
        } else {
            self.system_dp_rank
        }
    }

    /// The number of dp groups, chosen the same way.
    pub fn dp_size(&self) -> Rank {
        if self.system_dp_size == 1 {
            self.attn_dp_size
        } else {
            self.system_dp_size
        }
    }

    /// The topology this row describes (what `GET /route` with every rank `-1` answers).
    pub fn topology(&self) -> RouteTopology {
        let method = self
            .load_balance_method
            .as_deref()
            .unwrap_or("follow_bootstrap_room");
        RouteTopology {
            attn_tp_size: self.attn_tp_size,
            attn_cp_size: self.attn_cp_size,
            dp_size: self.dp_size(),
            pp_size: self.pp_size,
            page_size: self.page_size,
            kv_cache_dtype: self.kv_cache_dtype.clone(),
            follow_bootstrap_room: method == "follow_bootstrap_room",
            enable_dsa_cache_layer_split: self.enable_dsa_cache_layer_split.unwrap_or(false),
            enable_kv_cache_sharding: self.enable_kv_cache_sharding.unwrap_or(false),
            prefill_http_port: self.prefill_http_port,
            decode_allocation_policy: self
                .decode_allocation_policy
                .clone()
                .unwrap_or_else(|| "early".to_owned()),
            kv_layout: self.kv_layout.clone(),
            dsv41_spec_layout: self.dsv41_spec_layout.clone(),
        }
    }
}

/// `GET /route` with every rank `-1`: the prefill deployment's topology, fixed by its first
/// registered row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteTopology {
    /// Attention tensor-parallel size.
    pub attn_tp_size: Rank,
    /// Attention context-parallel size.
    pub attn_cp_size: Rank,
    /// Number of dp groups.
    pub dp_size: Rank,
    /// Pipeline-parallel size.
    pub pp_size: Rank,
    /// Tokens per KV page.
    pub page_size: u32,
    /// The KV cache's element type.
    pub kv_cache_dtype: String,
    /// Whether a request's dp rank follows its bootstrap room (else `/query_dp_ranks` says).
    pub follow_bootstrap_room: bool,
    /// Whether the DSA cache is split by layer.
    pub enable_dsa_cache_layer_split: bool,
    /// Whether the KV cache is sharded.
    pub enable_kv_cache_sharding: bool,
    /// The prefill's HTTP port.
    pub prefill_http_port: Option<u16>,
    /// How decode allocates.
    pub decode_allocation_policy: String,
    /// The KV layout, only when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_layout: Option<Value>,
    /// DeepSeek V4.1's speculative layout, only when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dsv41_spec_layout: Option<Value>,
}

impl RouteTopology {
    /// How many rows make the deployment complete: dp x cp x tp x pp.
    pub fn rank_count(&self) -> usize {
        [
            self.dp_size,
            self.attn_cp_size,
            self.attn_tp_size,
            self.pp_size,
        ]
        .iter()
        .map(|n| *n as usize)
        .product()
    }
}

/// `GET /route` with concrete ranks: where that rank serves its KV.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankInfo {
    /// Its address.
    pub rank_ip: String,
    /// Its port.
    pub rank_port: u16,
}

/// `POST /register_dp_rank`: the prefill dp rank that serves a bootstrap room.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterDpRank {
    /// The room (0 to 2^63 - 1).
    pub bootstrap_room: u64,
    /// The dp rank.
    pub dp_rank: Rank,
}

/// `POST /query_dp_ranks`: which dp rank serves each room.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueryDpRanks {
    /// The rooms asked about.
    pub bootstrap_rooms: Vec<u64>,
}

/// Answer of `POST /query_dp_ranks`: room (as a decimal string) -> dp rank, for the rooms known.
pub type DpRanks = BTreeMap<String, Rank>;

/// What SGLang's router adds to P's and D's bodies so that D finds P's KV.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootstrapFields {
    /// P's bootstrap host.
    pub bootstrap_host: String,
    /// P's bootstrap port.
    pub bootstrap_port: u16,
    /// The room shared by P and D for this request (random, 0 to 2^63 - 1).
    pub bootstrap_room: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_as_sglang_sends_it_gives_its_topology() {
        let row: RouteRow = serde_json::from_str(
            r#"{"attn_tp_size": 2, "attn_tp_rank": 1, "attn_cp_size": 1, "attn_cp_rank": 0,
                "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
                "system_dp_size": 2, "system_dp_rank": 1, "rank_ip": "10.0.0.5",
                "rank_port": 17000, "page_size": 64, "kv_cache_dtype": "bfloat16",
                "load_balance_method": "round_robin", "prefill_http_port": 30000}"#,
        )
        .unwrap();
        assert_eq!((row.dp_rank(), row.dp_size()), (1, 2));
        let topology = row.topology();
        assert!(!topology.follow_bootstrap_room);
        assert_eq!(topology.rank_count(), 4);
        let json = serde_json::to_value(&topology).unwrap();
        assert_eq!(json["decode_allocation_policy"], "early");
        assert!(json.get("kv_layout").is_none(), "only when set");
    }
}
