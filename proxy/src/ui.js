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

/** The engine version a backend reports, marked when the other role's differ (a P/D pair of
 * different versions). */
function version(b, others) {
  if (!b.version) return h("span", { class: "muted" }, "not known");
  const mixed = others.some((o) => o.version && o.version !== b.version);
  return mixed
    ? h("span", { class: "warn", "data-version": b.version }, b.version + " (differs from the other role's)")
    : h("span", { class: "mono", "data-version": b.version }, b.version);
}

function backends(list, withRanks, empty, others) {
  const headers = ["backend", "state", "in flight (engine load)", "version"].concat(withRanks ? ["dp ranks"] : []);
  return table(headers, list.map((b) => [h("span", { class: "mono", "data-backend": b.url }, b.url), health(b), load(b),
    version(b, others)].concat(withRanks ? [ranks(b)] : [])), empty);
}

/** 1234 as "1.2k", 2500000 as "2.5M": figures that fit a card. */
function compact(n) {
  if (n < 1000) return String(n);
  if (n < 1e6) return (n / 1e3).toFixed(n < 1e4 ? 1 : 0) + "k";
  return (n / 1e6).toFixed(n < 1e7 ? 1 : 0) + "M";
}

// The last five minutes, one point per snapshot: what the charts draw.
const KEPT = 300;
const history = [];
let previous = null;

/** The `q` quantile of the requests counted in `interval` (cumulative per bucket of `bounds`). */
function quantile(bounds, interval, q) {
  const total = interval[interval.length - 1] || 0;
  if (total === 0) return null;
  const i = interval.findIndex((count) => count >= q * total);
  const finite = bounds.filter((b) => b !== null);
  return (bounds[i] === null ? finite[finite.length - 1] : bounds[i]) * 1000;
}

/** Adds what happened since the previous snapshot to the history (once per snapshot). */
function remember(s) {
  if (previous !== null && s.at_ms === previous.at_ms) return;
  if (previous !== null && s.at_ms > previous.at_ms) {
    const seconds = (s.at_ms - previous.at_ms) / 1000;
    const all = (x) => x.outcomes.reduce((sum, o) => sum + o.count, 0);
    const failed = (x) => x.outcomes.filter((o) => o.outcome !== "ok").reduce((sum, o) => sum + o.count, 0);
    const before = (i) => (previous.ttft[i] ? previous.ttft[i][1] : 0);
    const interval = s.ttft.map((b, i) => b[1] - before(i));
    const bounds = s.ttft.map((b) => b[0]);
    history.push({
      rps: Math.max(0, all(s) - all(previous)) / seconds,
      errors: Math.max(0, failed(s) - failed(previous)) / seconds,
      p50: quantile(bounds, interval, 0.5),
      p99: quantile(bounds, interval, 0.99),
    });
    if (history.length > KEPT) history.shift();
  }
  previous = s;
}

const SVG = "http://www.w3.org/2000/svg";

/** An SVG element with attributes. */
function svg(tag, attrs, ...children) {
  const element = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) element.setAttribute(name, String(value));
  element.append(...children);
  return element;
}

/** A small line chart of the history: `lines` are [name, key, tone]; `format` a figure. */
function chart(title, lines, format) {
  const width = 300, height = 60;
  const values = lines.flatMap(([, key]) => history.map((p) => p[key]).filter((v) => v !== null));
  const top = Math.max(1e-9, ...values);
  const x = (i) => (i * width) / (KEPT - 1);
  const y = (v) => height - 2 - (v / top) * (height - 4);
  const polylines = lines.map(([, key, tone]) => svg("polyline", {
    class: "line " + tone, fill: "none",
    points: history.map((p, i) => (p[key] === null ? null : x(i) + "," + y(p[key]))).filter((p) => p).join(" "),
  }));
  const latest = lines.map(([name, key]) => {
    const last = history.length ? history[history.length - 1][key] : null;
    return name + " " + (last === null ? "-" : format(last));
  }).join(", ");
  return h("div", { class: "chart", "data-chart": title },
    h("div", { class: "label" }, title + ": " + latest),
    svg("svg", { viewBox: "0 0 " + width + " " + height, role: "img", "aria-label": title }, ...polylines));
}

follow((s) => {
  remember(s);
  const requests = s.outcomes.reduce((sum, o) => sum + o.count, 0);
  const [prefillPolicy, decodePolicy] = s.policy;
  const prefillPicks = s.picks.filter((p) => p.choice === "prefill");
  const picked = prefillPicks.reduce((sum, p) => sum + p.count, 0);
  const hits = prefillPicks.filter((p) => p.reason === "kv_hit").reduce((sum, p) => sum + p.count, 0);
  return [
    h("div", { class: "cards" },
      card("status", s.ready ? "ready" : "not ready", s.ready ? "ok" : "bad"),
      card("mode", s.mode),
      card("policy", prefillPolicy === decodePolicy ? prefillPolicy : "P " + prefillPolicy + ", D " + decodePolicy),
      card("ready pairs", String(s.ready_pairs)),
      card("healthy decodes", String(s.decodes.filter((d) => d.healthy && !d.drained && !d.leaving).length)),
      card("requests", String(requests)),
      s.kv_index ? card("KV index", compact(s.kv_index.blocks) + " / " + compact(s.kv_index.max_blocks) + " blocks") : null,
      picked > 0 ? card("prefill KV hits", Math.round((100 * hits) / picked) + "%") : null,
      card("admission queue", s.admission.waiting + " of " + s.admission.capacity,
        s.admission.waiting > 0 ? "warn" : "ok"),
      card("saturated", s.saturated.prefills || s.saturated.decodes
        ? [s.saturated.prefills ? "prefills" : null, s.saturated.decodes ? "decodes" : null]
          .filter((x) => x).join(", ")
        : "no", s.saturated.prefills || s.saturated.decodes ? "warn" : "ok")),
    s.detail ? h("p", { class: "warn" }, s.detail) : null,
    h("div", { class: "charts" },
      chart("requests per second", [["all", "rps", "ok"], ["not ok", "errors", "bad"]], (v) => v.toFixed(1)),
      chart("time to first byte", [["p50", "p50", "ok"], ["p99", "p99", "warn"]], duration)),
    h("h2", {}, "Prefills"),
    backends(s.prefills, true, "No prefill.", s.decodes),
    h("h2", {}, "Decodes"),
    backends(s.decodes, false, "No decode.", s.prefills),
    h("h2", {}, "Routing decisions"),
    table(["decision", "reason", "requests"], s.decisions.map((d) => [d.decision, d.reason, String(d.count)]),
      "No request routed yet."),
    s.picks.length > 0
      ? table(["KV-aware pick", "reason", "requests"], s.picks.map((p) => [p.choice, p.reason, String(p.count)]), "")
      : null,
    s.planner ? h("h2", {}, "Capacity planner") : null,
    s.planner
      ? table(["model", "role", "engines", "desired", "floor", "one engine, req/s", "why", "demand, req/s"],
        s.planner.flatMap((m) => m.roles.map((r) => [
          m.model || "(none)", r.role, String(r.current), String(r.desired),
          r.floor === null ? "-" : String(r.floor),
          r.engine_requests_per_second === null ? "-" : r.engine_requests_per_second.toFixed(2),
          r.why, m.requests_per_second.toFixed(2)])),
        "No request seen yet.")
      : null,
    s.duals ? h("h2", {}, "Engines of both roles") : null,
    s.duals
      ? table(["engine", "duty", "for, s", "prefills in flight", "decodes in flight"],
        s.duals.map((d) => [d.url, d.duty, d.for_seconds.toFixed(0), String(d.prefill_in_flight),
          String(d.decode_in_flight)]), "")
      : null,
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
