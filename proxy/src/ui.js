"use strict";
// The proxy's page: what GET /ui/events streams, drawn with live.js's helpers (text only).

function health(b) {
  if (b.leaving) return h("span", { class: "warn", "data-state": "leaving" }, "leaving");
  if (b.drained) return h("span", { class: "warn", "data-state": "drained" }, "drained");
  return b.healthy
    ? h("span", { class: "ok", "data-state": "healthy" }, "healthy")
    : h("span", { class: "bad", "data-state": "unhealthy" }, "unhealthy");
}

function load(b) {
  return b.engine_load === undefined ? String(b.in_flight) : b.in_flight + " (engine: " + b.engine_load + ")";
}

function ranks(b) {
  if (!b.dp_ranks || b.dp_ranks.length === 0) return h("span", { class: "muted" }, "none yet");
  return b.dp_ranks.map((r) => h("div", { class: "mono" },
    r.dp_rank + ": " + (r.engine_id === null || r.engine_id === undefined ? "(no engine id)" : r.engine_id),
    r.draining ? h("span", { class: "badge warn" }, "draining") : null,
    r.in_flight > 0 ? h("span", { class: "badge muted" }, r.in_flight + " in flight") : null));
}

function backends(list, withRanks, empty) {
  const headers = ["backend", "state", "in flight (engine load)"].concat(withRanks ? ["dp ranks"] : []);
  return table(headers, list.map((b) => [h("span", { class: "mono", "data-backend": b.url }, b.url), health(b), load(b)]
    .concat(withRanks ? [ranks(b)] : [])), empty);
}

follow((s) => {
  const requests = s.outcomes.reduce((sum, o) => sum + o.count, 0);
  return [
    h("div", { class: "cards" },
      card("status", s.ready ? "ready" : "not ready", s.ready ? "ok" : "bad"),
      card("mode", s.mode),
      card("ready pairs", String(s.ready_pairs)),
      card("healthy decodes", String(s.decodes.filter((d) => d.healthy && !d.drained && !d.leaving).length)),
      card("requests", String(requests)),
      s.kv_index ? card("KV index", s.kv_index.blocks + " of " + s.kv_index.max_blocks + " blocks") : null,
      card("admission queue", s.admission.waiting + " of " + s.admission.capacity,
        s.admission.waiting > 0 ? "warn" : "ok"),
      card("saturated", s.saturated.prefills || s.saturated.decodes
        ? [s.saturated.prefills ? "prefills" : null, s.saturated.decodes ? "decodes" : null]
          .filter((x) => x).join(", ")
        : "no", s.saturated.prefills || s.saturated.decodes ? "warn" : "ok")),
    s.detail ? h("p", { class: "warn" }, s.detail) : null,
    h("h2", {}, "Prefills"),
    backends(s.prefills, true, "No prefill."),
    h("h2", {}, "Decodes"),
    backends(s.decodes, false, "No decode."),
    h("h2", {}, "Routing decisions"),
    table(["decision", "reason", "requests"], s.decisions.map((d) => [d.decision, d.reason, String(d.count)]),
      "No request routed yet."),
    h("h2", {}, "Admission queue"),
    table(["priority", "waiting"], s.admission.priorities.map((p) => [String(p[0]), String(p[1])]),
      "Nothing waits."),
    Object.keys(s.admission.tenants).length > 0
      ? table(["tenant", "waiting"], Object.entries(s.admission.tenants).map((t) => [t[0], String(t[1])]), "")
      : null,
    table(["shed because", "requests"], s.shed.filter((r) => r.count > 0).map((r) => [r.outcome, String(r.count)]),
      "No request shed."),
    h("h2", {}, "Requests by outcome"),
    table(["outcome", "requests"], s.outcomes.map((o) => [o.outcome, String(o.count)]), "No request yet."),
  ];
});
