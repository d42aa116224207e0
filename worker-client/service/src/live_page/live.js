"use strict";
// What every live page shares: elements built from text only (a value is never parsed as
// HTML, so whatever an engine registered is shown as it is), the snapshot stream from the
// server (server-sent events, `state` events of JSON), and durations for people.

/** An element with properties (`class`, `title`, `data-*`) and children (nodes or text). */
function h(tag, props, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(props || {})) {
    if (name === "class") element.className = value;
    else element.setAttribute(name, String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    element.append(child instanceof Node ? child : String(child));
  }
  return element;
}

/** A labelled figure. */
function card(label, value, tone) {
  return h("div", { class: "card" }, h("div", { class: "label" }, label),
    h("div", { class: "value " + (tone || ""), "data-card": label }, value));
}

/** A table with a header row; `rows` are arrays of cells (nodes or text). */
function table(headers, rows, empty) {
  if (rows.length === 0) return h("p", { class: "empty" }, empty);
  return h("div", { class: "scroll" }, h("table", {},
    h("thead", {}, h("tr", {}, headers.map((name) => h("th", {}, name)))),
    h("tbody", {}, rows.map((cells) => h("tr", {}, cells.map((cell) => h("td", {}, cell)))))));
}

/** Milliseconds as "850 ms", "12.3 s", "4 min 10 s". */
function duration(ms) {
  if (ms < 1000) return Math.max(0, Math.round(ms)) + " ms";
  if (ms < 60000) return (ms / 1000).toFixed(1) + " s";
  const minutes = Math.floor(ms / 60000);
  return minutes + " min " + Math.round((ms % 60000) / 1000) + " s";
}

/**
 * Follows the server's snapshots: `render(snapshot, age)` runs on each one, and every second
 * with the time since it arrived (for countdowns). The header's `#live` says whether the stream
 * is up; the browser reconnects by itself when it drops.
 */
function follow(render) {
  const status = document.getElementById("live");
  const app = document.getElementById("app");
  let snapshot = null;
  let received = 0;
  const draw = () => {
    if (snapshot === null) return;
    const parts = render(snapshot, Date.now() - received);
    app.replaceChildren(...parts.filter((part) => part instanceof Node));
  };
  const source = new EventSource("ui/events");
  source.addEventListener("state", (event) => {
    snapshot = JSON.parse(event.data);
    received = Date.now();
    status.textContent = "live";
    status.className = "badge ok";
    draw();
  });
  source.addEventListener("error", () => {
    status.textContent = "reconnecting";
    status.className = "badge warn";
  });
  setInterval(draw, 1000);
}
