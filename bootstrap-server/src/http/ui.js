"use strict";
// The registry's page: what GET /ui/events streams, drawn with live.js's helpers (text only).

function ranks(worker) {
  return worker.dp_rank + " / " + worker.tp_rank + " / " + worker.pp_rank;
}

function lease(worker, age) {
  if (worker.lease_id_str === undefined) return h("span", { class: "muted" }, "none");
  if (worker.lease_remaining_ms === undefined) {
    return h("span", { class: "bad", "data-lease": "expired" }, worker.lease_id_str + ": expired");
  }
  const left = worker.lease_remaining_ms - age;
  const tone = left <= 0 ? "bad" : left < 5000 ? "warn" : "ok";
  const text = left <= 0 ? "expiring" : duration(left) + " left of " + worker.lease_ttl + " s";
  return h("span", { class: tone, "data-lease": left <= 0 ? "expiring" : "live" },
    worker.lease_id_str + ": " + text);
}

function engines(workers, age) {
  const byEngine = new Map();
  for (const worker of workers) {
    const id = worker.engine_id === undefined ? "(no engine id)" : worker.engine_id;
    if (!byEngine.has(id)) byEngine.set(id, []);
    byEngine.get(id).push(worker);
  }
  if (byEngine.size === 0) return [h("p", { class: "empty" }, "No worker is registered.")];
  return [...byEngine.entries()].map(([id, group]) => {
    const first = group[0];
    const draining = group.some((w) => w.draining);
    return h("section", { class: "engine", "data-engine": id },
      h("h3", {}, h("span", { class: "mono" }, id),
        first.incarnation !== undefined ? h("span", { class: "badge muted" }, "incarnation " + first.incarnation) : null,
        first.model !== undefined ? h("span", { class: "badge muted" }, first.model) : null,
        draining ? h("span", { class: "badge warn", "data-draining": "true" }, "draining") : null),
      table(["dp / tp / pp", "transfer address", "lease"],
        group.map((w) => [ranks(w), h("span", { class: "mono" }, w.addr), lease(w, age)]), ""));
  });
}

function sglang(workers) {
  const ranked = workers.filter((w) => w.sglang_topology !== undefined);
  if (ranked.length === 0) return [];
  const topology = ranked[0].sglang_topology;
  const rows = Object.entries(topology).map(([key, value]) =>
    [key, h("span", { class: "mono" }, typeof value === "string" ? value : JSON.stringify(value))]);
  return [h("h2", {}, "SGLang deployment"),
    h("p", { class: "muted" }, ranked.length + " rank(s) registered"),
    table(["", ""], rows, "")];
}

function changes(recent) {
  return table(["revision", "change", "engine", "dp / tp / pp", "address"], recent.map((c) => [
    String(c.revision),
    h("span", { class: c.type === "put" ? "ok" : "bad" }, c.type === "put" ? "registered" : "removed"),
    h("span", { class: "mono" }, c.worker.engine_id === undefined ? "" : c.worker.engine_id),
    ranks(c.worker),
    h("span", { class: "mono" }, c.worker.addr),
  ]), "No change since the server started.");
}

follow((s, age) => {
  const topology = s.expected === null || s.expected === undefined
    ? s.registered + " registered"
    : s.registered + " of " + s.expected;
  const engineIds = new Set(s.workers.map((w) => w.engine_id));
  return [
    h("div", { class: "cards" },
      card("topology", s.ready ? "ready" : "not ready", s.ready ? "ok" : "bad"),
      card("workers", topology, s.missing > 0 ? "warn" : ""),
      card("engines", String(engineIds.size)),
      card("revision", String(s.revision)),
      card("store", s.store_connected ? "following" : "disconnected", s.store_connected ? "ok" : "bad"),
      s.shutting_down ? card("server", "shutting down", "warn") : null),
    h("h2", {}, "Engines"),
    ...engines(s.workers, age),
    ...sglang(s.workers),
    h("h2", {}, "Latest changes"),
    changes(s.recent),
  ];
});
