#!/usr/bin/env bash
# run-pd.sh: one vLLM prefill (P) / decode (D) deployment behind pd-bootstrap.
#
#   client -> pd-proxy -> P (vllm serve, kv_producer) and D (vllm serve, kv_consumer)
#   P workers register with bootstrap-server; D workers ask it where P's workers are.
#
# Each subcommand runs ONE component in the foreground, on the host where it belongs:
#
#   run-pd.sh bootstrap   on P_HOST   bootstrap-server (must run on P_HOST: see below)
#   run-pd.sh prefill     on P_HOST   vllm serve ... kv_producer
#   run-pd.sh decode      on D_HOST   vllm serve ... kv_consumer
#   run-pd.sh proxy       anywhere    pd-proxy (waits for the topology, then serves)
#   run-pd.sh check       anywhere    health, readiness, topology, metrics, one completion
#   run-pd.sh deregister ENGINE_ID    drop an old P engine's registrations (after a restart)
#
# Start them in that order (bootstrap first: recent vLLM gives up registering after 3 tries).
# Every variable at the top of this file can be overridden from the environment, e.g.
#   P_HOST=10.0.0.5 D_HOST=10.0.0.6 ./run-pd.sh prefill
# DRY_RUN=1 prints the command a subcommand would run instead of running it (no GPU needed).
#
# Facts this relies on, read in vLLM's source (vllm-project/vllm, main at 00f4240e):
# - kv_connector_extra_config "bootstrap_server_address": "host:port" makes every P rank
#   register there and NOT start vLLM's embedded bootstrap server. Older vLLM releases do
#   not have this key; `prefill` refuses to start on them (see docs/deploy.md for why
#   running next to the embedded server on the same port does not work).
# - D learns the bootstrap address per request from the proxy (remote_bootstrap_addr);
#   the proxy builds it as http://<host of the --prefill URL>:<BOOTSTRAP_PORT>. So the
#   bootstrap server must listen on P_HOST:BOOTSTRAP_PORT and P_HOST must be reachable
#   from D (never 127.0.0.1 or 0.0.0.0 when P and D are on different hosts).
# - Stock vLLM sends no Authorization header when it registers: do not give the bootstrap
#   server an auth token in this setup.
set -euo pipefail

# ---- what to serve --------------------------------------------------------------------
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}

# ---- where things run (addresses other hosts use to reach them) -----------------------
P_HOST=${P_HOST:-10.0.0.5}        # P's API host; the bootstrap server runs here too
D_HOST=${D_HOST:-10.0.0.6}        # D's API host
PROXY_HOST=${PROXY_HOST:-127.0.0.1}  # where `check` reaches the proxy

# ---- ports -----------------------------------------------------------------------------
P_PORT=${P_PORT:-8010}            # P's OpenAI API
D_PORT=${D_PORT:-8020}            # D's OpenAI API
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}  # bootstrap-server (vLLM's default port)
PROXY_PORT=${PROXY_PORT:-8000}    # pd-proxy, what clients call
PROXY_BIND=${PROXY_BIND:-127.0.0.1}   # 0.0.0.0 to serve other hosts

# ---- parallelism and GPUs --------------------------------------------------------------
P_TP=${P_TP:-1}                   # P tensor-parallel size
P_DP=${P_DP:-1}                   # P data-parallel size (internal load balancing, one node)
D_TP=${D_TP:-1}                   # D tensor-parallel size (keep = P_TP unless your vLLM
                                  # supports heterogeneous TP for Mooncake)
P_GPUS=${P_GPUS:-0}               # CUDA_VISIBLE_DEVICES for P (P_TP * P_DP GPUs)
D_GPUS=${D_GPUS:-0}               # CUDA_VISIBLE_DEVICES for D (D_TP GPUs)

# ---- Mooncake transfer engine ----------------------------------------------------------
MOONCAKE_PROTOCOL=${MOONCAKE_PROTOCOL:-rdma}  # "tcp" where there is no RDMA; same on P and D
MOONCAKE_DEVICE=${MOONCAKE_DEVICE:-}          # optional RDMA device whitelist, e.g. mlx5_0,mlx5_1
# Multi-NIC hosts: export VLLM_HOST_IP=<this host's address that the other side can reach>
# before `prefill`/`decode`; vLLM registers its workers' ZMQ addresses with it.

# ---- pd-bootstrap ----------------------------------------------------------------------
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BIN_DIR=${BIN_DIR:-$ROOT/target/release}   # built by: cargo build --release --bins
BOOTSTRAP_DATA_DIR=${BOOTSTRAP_DATA_DIR:-./bootstrap-data}
# replace: a restarted P engine (vLLM gives it a new engine id) takes its dp rank back
# without an operator. reject: it is refused with "Engine ID mismatch" until someone runs
# `run-pd.sh deregister OLD_ENGINE_ID`.
ENGINE_CONFLICT=${ENGINE_CONFLICT:-replace}
# The P nodes' network (CIDR, comma separated): they register without a token. Needed beside
# PD_BOOTSTRAP_AUTH_TOKEN; without either, anyone who reaches the port can register.
WRITERS=${WRITERS:-}
PROXY_POLICY=${PROXY_POLICY:-round_robin}   # or least_loaded, or precise_prefix (then KV_EVENTS=1)
# precise_prefix: P and D publish their KV cache events (prefix caching on) and the proxy routes
# each request to the engine holding the longest part of its prompt. The proxy then needs the
# model's tokenizer: a folder with tokenizer.json, reachable where the proxy runs.
KV_EVENTS=${KV_EVENTS:-0}                   # 1: --kv-events-config on P and D
KV_EVENTS_PORT=${KV_EVENTS_PORT:-5557}      # the PUB socket (vLLM adds the dp rank: P_DP ports from here)
KV_REPLAY_PORT=${KV_REPLAY_PORT:-5657}      # the replay socket (the dp rank added too, so apart from the PUB ports)
PROXY_TOKENIZER=${PROXY_TOKENIZER:-}        # precise_prefix: the model's tokenizer folder
PROXY_MODE=${PROXY_MODE:-concurrent}        # or sequential
READY_TIMEOUT=${READY_TIMEOUT:-1200}        # seconds to wait for engines to come up

# ---- helpers ---------------------------------------------------------------------------
say() { printf '\n== %s\n' "$*" >&2; }
die() { printf 'run-pd.sh: %s\n' "$*" >&2; exit 1; }

# An IPv6 literal needs brackets in host:port and in URLs.
bracket() { if [[ $1 == *:* ]]; then printf '[%s]' "$1"; else printf '%s' "$1"; fi; }

# Where P workers, D workers, the proxy and `check` reach the bootstrap server.
BOOTSTRAP_URL="http://$(bracket "$P_HOST"):$BOOTSTRAP_PORT"

# Runs (execs) a command, or prints it with DRY_RUN=1.
run() {
  if [[ ${DRY_RUN:-0} == 1 ]]; then
    printf '%q ' "$@"; printf '\n'
    exit 0
  fi
  exec "$@"
}

# Dies unless our binaries are built.
need_bins() {
  local name
  for name in "$@"; do
    [[ -x $BIN_DIR/$name || ${DRY_RUN:-0} == 1 ]] \
      || die "$BIN_DIR/$name not found: run 'cargo build --release --bins' in $ROOT (or set BIN_DIR)"
  done
}

# Polls URL until it answers 2xx or TIMEOUT seconds pass.
wait_http() {
  local url=$1 timeout=$2 start=$SECONDS
  [[ ${DRY_RUN:-0} == 1 ]] && return 0
  until curl -fs -o /dev/null --max-time 5 "$url"; do
    (( SECONDS - start < timeout )) || die "no answer from $url after ${timeout}s"
    sleep 2
  done
}

kv_config() {  # kv_config ROLE [EXTRA_JSON_MEMBERS]
  local extra="\"mooncake_protocol\":\"$MOONCAKE_PROTOCOL\""
  [[ -n $MOONCAKE_DEVICE ]] && extra+=",\"device_name\":\"$MOONCAKE_DEVICE\""
  [[ -n ${2:-} ]] && extra+=",$2"
  printf '{"kv_connector":"MooncakeConnector","kv_role":"%s","kv_connector_extra_config":{%s}}' "$1" "$extra"
}

# The installed vLLM must know kv_connector_extra_config.bootstrap_server_address.
require_external_bootstrap_support() {
  [[ ${DRY_RUN:-0} == 1 || ${SKIP_VLLM_CHECK:-0} == 1 ]] && return 0
  local dir
  dir=$(python3 -c 'import importlib.util as u; s = u.find_spec("vllm"); print(s.submodule_search_locations[0])') \
    || die "vLLM is not installed for python3"
  if ! find "$dir" -path '*mooncake*' -name '*.py' -print0 | xargs -0 grep -ql 'bootstrap_server_address'; then
    die "this vLLM ($dir) has no Mooncake 'bootstrap_server_address' option: its P rank 0 always
starts an embedded bootstrap server and its workers register there, so pd-bootstrap cannot
take its place. Upgrade vLLM, or use vLLM's own server (SKIP_VLLM_CHECK=1 skips this test)."
  fi
}

# ---- subcommands -----------------------------------------------------------------------
cmd_bootstrap() {
  # Stock vLLM registers without a token: a token alone makes every P registration a 401, so
  # it needs the P network in the allow-list (WRITERS) beside it.
  if [[ -n ${PD_BOOTSTRAP_AUTH_TOKEN:-} && -z ${WRITERS:-} ]]; then
    die "PD_BOOTSTRAP_AUTH_TOKEN without WRITERS locks vLLM's P workers out: set WRITERS to their network (CIDR)"
  fi
  local writers=()
  [[ -z ${WRITERS:-} ]] || writers=(--allow-writes-from "$WRITERS")
  # --dp-size/--tp-size: /query and /ready answer 503 until all P_DP * P_TP workers registered,
  # so neither the proxy nor D sees half an engine.
  need_bins bootstrap-server
  run "$BIN_DIR/bootstrap-server" \
    --host 0.0.0.0 --port "$BOOTSTRAP_PORT" \
    --data-dir "$BOOTSTRAP_DATA_DIR" \
    --dp-size "$P_DP" --tp-size "$P_TP" \
    --engine-conflict "$ENGINE_CONFLICT" "${writers[@]}" \
    --log-format text
}

# The engine arguments that publish its KV cache events, when KV_EVENTS=1.
kv_events_args() {
  (( KV_EVENTS )) || return 0
  printf '%s\n' --enable-prefix-caching --kv-events-config \
    "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"topic\":\"kv\",\"endpoint\":\"tcp://*:$KV_EVENTS_PORT\",\"replay_endpoint\":\"tcp://*:$KV_REPLAY_PORT\"}"
}

cmd_prefill() {
  require_external_bootstrap_support
  # Recent vLLM tries to register 3 times (timeout VLLM_MOONCAKE_CONNECTOR_TIMEOUT, 30 s)
  # and then fails start-up: make sure the bootstrap server is up first.
  say "waiting for the bootstrap server at $BOOTSTRAP_URL"
  wait_http "$BOOTSTRAP_URL/health" 120
  local address
  address="$(bracket "$P_HOST"):$BOOTSTRAP_PORT"   # "host:port", no scheme (vLLM splits on ':')
  local dp_args=()
  (( P_DP > 1 )) && dp_args=(--data-parallel-size "$P_DP")
  local events=()
  mapfile -t events < <(kv_events_args)
  run env CUDA_VISIBLE_DEVICES="$P_GPUS" vllm serve "$MODEL" \
    --host 0.0.0.0 --port "$P_PORT" \
    --tensor-parallel-size "$P_TP" "${dp_args[@]}" "${events[@]}" \
    --kv-transfer-config "$(kv_config kv_producer "\"bootstrap_server_address\":\"$address\"")"
}

cmd_decode() {
  # D needs no bootstrap setting: the proxy tells it remote_bootstrap_addr and
  # remote_engine_id with every request.
  local events=()
  mapfile -t events < <(kv_events_args)
  run env CUDA_VISIBLE_DEVICES="$D_GPUS" vllm serve "$MODEL" \
    --host 0.0.0.0 --port "$D_PORT" \
    --tensor-parallel-size "$D_TP" "${events[@]}" \
    --kv-transfer-config "$(kv_config kv_consumer)"
}

cmd_proxy() {
  local wc="$BIN_DIR/worker-client"
  need_bins worker-client pd-proxy
  if [[ ${DRY_RUN:-0} != 1 ]]; then
    say "waiting for all $((P_DP * P_TP)) P workers to register at $BOOTSTRAP_URL"
    "$wc" --url "$BOOTSTRAP_URL" wait-ready --wait-timeout "$READY_TIMEOUT"
    say "waiting for P and D to answer /health"
    wait_http "http://$(bracket "$P_HOST"):$P_PORT/health" "$READY_TIMEOUT"
    wait_http "http://$(bracket "$D_HOST"):$D_PORT/health" "$READY_TIMEOUT"
  fi
  local tokenizer=()
  if [[ $PROXY_POLICY == precise_prefix ]]; then
    [[ -n $PROXY_TOKENIZER ]] || die "PROXY_POLICY=precise_prefix needs PROXY_TOKENIZER (the model's tokenizer folder) and KV_EVENTS=1 on P and D"
    tokenizer=(--tokenizer "$PROXY_TOKENIZER")
  fi
  # The bootstrap port after the P URL: D is told http://P_HOST:BOOTSTRAP_PORT, i.e. ours.
  run "$BIN_DIR/pd-proxy" \
    --host "$PROXY_BIND" --port "$PROXY_PORT" \
    --prefill "http://$(bracket "$P_HOST"):$P_PORT" "$BOOTSTRAP_PORT" \
    --decode "http://$(bracket "$D_HOST"):$D_PORT" \
    --policy "$PROXY_POLICY" --mode "$PROXY_MODE" "${tokenizer[@]}"
}

cmd_check() {
  local wc="$BIN_DIR/worker-client" proxy_url
  need_bins worker-client
  proxy_url="http://$(bracket "$PROXY_HOST"):$PROXY_PORT"
  if [[ ${DRY_RUN:-0} == 1 ]]; then
    echo "check: $BOOTSTRAP_URL/{health,ready,metrics}, $wc query, P/D /health, $proxy_url/{health,ready,metrics,v1/completions}"
    exit 0
  fi
  say "bootstrap-server /health and /ready ($BOOTSTRAP_URL)"
  curl -fsS "$BOOTSTRAP_URL/health"; echo
  local ready
  ready=$(curl -sS "$BOOTSTRAP_URL/ready")
  echo "$ready"
  [[ $ready == *'"status":"ready"'* ]] \
    || die "P topology incomplete (see 'missing' above): wait, or check the P logs and --dp-size/--tp-size"
  say "registered P workers (one row per dp/tp/pp rank)"
  "$wc" --url "$BOOTSTRAP_URL" query
  say "bootstrap-server metrics"
  curl -fsS "$BOOTSTRAP_URL/metrics" | grep -E '^bootstrap_(workers|engines|topology_revision|http_requests_total)' || true
  say "P and D /health"
  curl -fsS -o /dev/null -w "P %{http_code}\n" "http://$(bracket "$P_HOST"):$P_PORT/health"
  curl -fsS -o /dev/null -w "D %{http_code}\n" "http://$(bracket "$D_HOST"):$D_PORT/health"
  say "pd-proxy /health, /ready, /metrics ($proxy_url)"
  curl -fsS "$proxy_url/health"; echo
  curl -fsS "$proxy_url/ready"; echo
  curl -fsS "$proxy_url/metrics" | grep -v '^#' | head -n 20 || true
  say "one completion through the proxy"
  curl -fsS --max-time 300 "$proxy_url/v1/completions" \
    -H 'Content-Type: application/json' \
    -d "$(printf '{"model":"%s","prompt":"The capital of France is","max_tokens":16,"temperature":0}' "$MODEL")"
  echo
  say "OK. D asked the bootstrap server (GET /query) when it first met P's engine id:"
  curl -fsS "$BOOTSTRAP_URL/metrics" | grep -E '^bootstrap_http_requests_total\{.*/query' || true
}

cmd_deregister() {
  [[ $# -eq 1 ]] || die "usage: run-pd.sh deregister ENGINE_ID   (ids: run-pd.sh check, or worker-client query)"
  need_bins worker-client
  run "$BIN_DIR/worker-client" --url "$BOOTSTRAP_URL" deregister --engine-id "$1"
}

usage() { sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

main() {
  local cmd=${1:-}
  [[ $# -gt 0 ]] && shift
  case $cmd in
    bootstrap) cmd_bootstrap ;;
    prefill) cmd_prefill ;;
    decode) cmd_decode ;;
    proxy) cmd_proxy ;;
    check) cmd_check ;;
    deregister) cmd_deregister "$@" ;;
    -h | --help | help | '') usage ;;
    *) usage; die "unknown subcommand: $cmd" ;;
  esac
}

main "$@"
