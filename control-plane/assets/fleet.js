// kvroute fleet page: polls debug/fleet.json once a second and redraws. Plain DOM, no
// dependencies; every value from the server is inserted as text, never as HTML.
"use strict";

const POLL_MS = 1000;
const SVG_NS = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "onclick") node.addEventListener("click", v);
    else node.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : String(c));
  }
  return node;
}

function num(v, digits = 0) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  return Number(v).toLocaleString("en-US", {
    minimumFractionDigits: digits,
    maximumFractionDigits: digits,
  });
}

function pct(v) {
  return v === null || v === undefined ? "–" : num(v * 100, 1) + "%";
}

function bytes(v) {
  if (v >= 1 << 20) return num(v / (1 << 20), 1) + " MiB";
  if (v >= 1 << 10) return num(v / (1 << 10), 1) + " KiB";
  return num(v) + " B";
}

function age(ms) {
  if (ms === null || ms === undefined) return "never";
  return ms < 1000 ? num(ms) + " ms ago" : num(ms / 1000, 1) + " s ago";
}

// A sparkline of `values` (nulls are gaps) scaled to [0, max]; `max` null means "largest value".
function sparkline(values, max) {
  const w = 90, h = 22;
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("width", w);
  svg.setAttribute("height", h);
  const known = values.filter((v) => v !== null && v !== undefined);
  if (known.length === 0) return svg;
  const top = max !== null ? max : Math.max(1, ...known);
  const n = Math.max(values.length - 1, 1);
  let points = [];
  const flush = () => {
    if (points.length === 0) return;
    if (points.length === 1) points.push([points[0][0] + 1, points[0][1]]);
    const area = document.createElementNS(SVG_NS, "polygon");
    area.setAttribute("class", "area");
    const first = points[0][0], last = points[points.length - 1][0];
    area.setAttribute("points", [[first, h], ...points, [last, h]].map((p) => p.join(",")).join(" "));
    svg.append(area);
    const line = document.createElementNS(SVG_NS, "polyline");
    line.setAttribute("points", points.map((p) => p.join(",")).join(" "));
    svg.append(line);
    points = [];
  };
  values.forEach((v, i) => {
    if (v === null || v === undefined) return flush();
    const x = (i / n) * (w - 2) + 1;
    const y = h - 1 - (Math.min(v, top) / top) * (h - 2);
    points.push([x.toFixed(1), y.toFixed(1)]);
  });
  flush();
  return svg;
}

function tile(label, value, sub) {
  return el("div", { class: "tile" },
    el("div", { class: "label" }, label),
    el("div", { class: "value" }, value),
    sub ? el("div", { class: "sub" }, sub) : null);
}

function renderTiles(data) {
  const t = data.totals;
  const reasons = Object.entries(t.recent_reasons)
    .sort((a, b) => b[1] - a[1])
    .map(([r, n]) => `${r} ${n}`)
    .join(" · ");
  const accuracy = t.actual_cached_tokens > 0
    ? pct(t.predicted_cached_tokens / t.actual_cached_tokens) + " of actual"
    : "no reports yet";
  document.getElementById("tiles").replaceChildren(
    tile("decisions", num(t.decisions), reasons || "none yet"),
    tile("precise", t.decisions ? pct(t.precise_decisions / t.decisions) : "–", "scored from KV events"),
    tile("fleet cache hit", pct(t.hit_rate), `${num(t.outcomes)} outcomes reported`),
    tile("predicted cached", num(t.predicted_cached_tokens), accuracy),
    tile("in flight", num(t.inflight), "routed, not yet reported"),
    tile("no endpoint", num(t.no_endpoint), "filter failed open"),
    tile("fallbacks", num(t.fallbacks), "served by a later endpoint"),
    tile("guarded", num(t.guarded), "hot replica skipped"),
    tile("prefix index", num(t.index_blocks) + " blocks", bytes(t.index_bytes)),
  );
}

function health(e) {
  if (e.health !== "ready") return ["down", "unreachable"];
  if (e.stale) return ["stale", "metrics stale"];
  return ["up", "ready"];
}

// The KV-event column: off (approximate only), down, or live with blocks and lag.
function events(e) {
  const k = e.kv_events;
  if (!k) return el("td", { class: "num muted" }, "off");
  const title = `gaps ${k.gaps} · replays ${k.replays} · resets ${k.resets}` +
    (k.partial ? " · partial history" : "") + (k.last_error ? ` · ${k.last_error}` : "");
  if (!e.events_live) return el("td", { class: "num error", title }, "down");
  const lag = k.lag_ms === null || k.lag_ms === undefined ? "" : ` · ${num(k.lag_ms)} ms`;
  return el("td", { class: "num", title }, `live · ${num(e.precise_blocks)}${lag}`);
}

// What scoring assumes of the endpoint: learned from its counters, or (dimmed) the prior.
function calibration(e) {
  const c = e.calibration;
  if (!c) return el("td", { class: "num" }, "-");
  const learned = c.prefill_evidence_points > 0;
  const title = learned
    ? `learned from ${num(c.prefill_evidence_points)} scrape intervals; ITL ${c.itl_ms_idle.toFixed(1)} ms idle, ${c.itl_ms_full.toFixed(1)} ms with KV full`
    : "the prior: no finished request seen yet";
  return el("td", { class: "num" + (learned ? "" : " dim"), title },
    `${num(Math.round(c.prefill_tokens_per_ms * 1000))} tok/s · ${c.itl_ms_idle.toFixed(1)} ms`);
}

function renderEndpoints(data) {
  const seconds = (data.sample_interval_ms * 240) / 1000;
  document.getElementById("window").textContent = `sparklines: last ${num(seconds)} s`;
  const rows = data.endpoints.map((e) => {
    const m = e.metrics || {};
    const h = e.history;
    const [cls, title] = health(e);
    const kv = m.kv_usage;
    const bar = el("span", { class: "bar" + (kv > 0.9 ? " hot" : "") }, el("span"));
    bar.firstChild.style.width = kv === undefined ? "0%" : `${Math.round(Math.min(kv, 1) * 100)}%`;
    const spark = (values, max) => el("td", { class: "spark" }, sparkline(values, max));
    return el("tr", { "data-endpoint": e.address },
      el("td", { title: e.scrape_error || title }, el("span", { class: `dot ${cls}` }), e.address),
      el("td", { class: "num" }, num(m.waiting)),
      spark(h.map((s) => s.waiting), null),
      el("td", { class: "num" }, num(m.running)),
      el("td", { class: "num" }, pct(kv), bar),
      spark(h.map((s) => s.kv_usage), 1),
      el("td", { class: "num" }, num(e.inflight)),
      spark(h.map((s) => s.inflight), null),
      el("td", { class: "num", title: `${num(e.served.cached_tokens)} of ${num(e.served.prompt_tokens)} prompt tokens` }, pct(e.hit_rate)),
      spark(h.map((s) => s.hit_rate), 1),
      calibration(e),
      el("td", { class: "num" }, num(e.backlog_tokens)),
      el("td", { class: "num" }, num(e.indexed_blocks)),
      events(e),
      el("td", { class: "num" }, age(e.scrape_age_ms)),
    );
  });
  document.querySelector("#endpoints tbody").replaceChildren(...rows);
}

// The fleet numbers (issue #18): per pool, then per endpoint, each as a share of prompt tokens.
const GAP_REASONS = ["load_spill", "eviction", "mismatch", "fallback", "unheld"];

function reuseCells(r) {
  const share = (n) => (r.prompt_tokens > 0 ? pct(n / r.prompt_tokens) : "–");
  const cell = (n) => el("td", { class: "num", title: `${num(n)} tokens` }, share(n));
  return [
    el("td", { class: "num" }, num(r.prompt_tokens)),
    cell(r.available_tokens),
    cell(r.aimed_tokens),
    cell(r.delivered_tokens),
    ...GAP_REASONS.map((g) => cell(r.gap_tokens[g])),
  ];
}

function routingState(e) {
  const s = e.routing_state || "exact";
  const title = s === "exact" ? "prefix hits credited" : `reason ${e.state_reason}`;
  return el("td", s === "exact" ? { title } : { class: "error", title },
    s + (e.state_reason ? ` · ${e.state_reason}` : ""));
}

function renderReuse(data) {
  const pools = data.pools.map((p) =>
    el("tr", {}, el("td", {}, el("b", {}, p.pool || "(no model)")), el("td", {}, "pool"), ...reuseCells(p.reuse),
      el("td", { class: "num" }, "")));
  const endpoints = data.endpoints.map((e) => {
    const c = (e.metrics || {}).prefix_cache;
    const engine = c && c.queries > 0 ? pct(c.hits / c.queries) : "–";
    return el("tr", {}, el("td", {}, e.address), routingState(e), ...reuseCells(e.reuse),
      el("td", { class: "num" }, engine));
  });
  document.querySelector("#reuse tbody").replaceChildren(...pools, ...endpoints);
}

let selected = null;

function renderDecisions(data) {
  const rows = data.recent.map((d) =>
    el("tr", { class: d.decision_id === selected ? "selected" : "" },
      el("td", {}, el("button", { class: "link", onclick: () => select(d.decision_id) }, d.decision_id)),
      el("td", {}, el("span", { class: `badge ${d.reason}` }, d.reason)),
      el("td", {}, d.endpoints[0] || "–"),
      // Tokens: the one unit of both modes (blocks are hash or engine blocks).
      el("td", { class: "num", title: `${num(d.cached_blocks)} blocks` }, num(d.cached_tokens)),
    ));
  if (rows.length === 0) {
    rows.push(el("tr", {}, el("td", { colspan: 4, class: "muted" }, "no decisions yet")));
  }
  document.querySelector("#decisions tbody").replaceChildren(...rows);
}

async function select(id) {
  selected = id;
  history.replaceState(null, "", `#decision=${id}`);
  document.getElementById("explain-id").textContent = String(id);
  const body = document.getElementById("explain-body");
  try {
    const resp = await fetch(`debug/decisions/${encodeURIComponent(id)}`, { cache: "no-store" });
    const d = await resp.json();
    if (!resp.ok) {
      body.replaceChildren(el("p", { class: "error" }, d.error || `HTTP ${resp.status}`));
      return;
    }
    const head = el("tr", {}, ...["endpoint", "cached blk", "cached tok", "uncached", "queue",
      "prefill", "decode", "kv", "total ms", "in flight", ""]
      .map((h, i) => el("th", { class: i === 0 ? "" : "num" }, h)));
    const rows = d.candidates.map((c, i) =>
      el("tr", { class: i === 0 ? "chosen" : "" },
        el("td", {}, c.endpoint),
        el("td", { class: "num" }, num(c.cached_blocks)),
        el("td", { class: "num" }, num(c.cached_tokens)),
        el("td", { class: "num" }, num(c.uncached_tokens)),
        el("td", { class: "num" }, num(c.queue_ms, 1)),
        el("td", { class: "num" }, num(c.prefill_ms, 1)),
        el("td", { class: "num" }, num(c.decode_ms, 1)),
        el("td", { class: "num" }, num(c.kv_ms, 1)),
        el("td", { class: "num" }, num(c.total_ms, 1)),
        el("td", { class: "num" }, num(c.inflight)),
        el("td", { class: "muted" }, (c.precise ? "precise" : "approx") + (c.guarded ? " · guarded" : "")),
      ));
    const r = d.response;
    body.replaceChildren(
      el("p", {}, "reason ", el("span", { class: `badge ${r.reason}` }, r.reason),
        ` · sent to ${r.endpoints.join(", ") || "nobody (fail open)"} · ${num(r.cached_tokens)} cached tokens`
        + ` (${num(r.cached_blocks)} ${d.candidates[0] && d.candidates[0].precise ? "engine" : "hash"} blocks)`),
      el("table", { id: "candidates" }, el("thead", {}, head), el("tbody", {}, ...rows)),
      el("p", { class: "muted small" }, "Times in ms. Best first; the first row was chosen, the next ",
        "ones are the fallbacks Envoy tries if it cannot connect."),
    );
  } catch (err) {
    body.replaceChildren(el("p", { class: "error" }, `cannot load decision ${id}: ${err}`));
  }
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const resp = await fetch("debug/fleet.json", { cache: "no-store" });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    const data = await resp.json();
    renderTiles(data);
    renderEndpoints(data);
    renderReuse(data);
    renderDecisions(data);
    const up = data.endpoints.filter((e) => health(e)[0] === "up").length;
    status.className = "status";
    status.textContent = `${up}/${data.endpoints.length} endpoints ready · up ${num(data.now_ms / 1000)} s · updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    status.className = "status down";
    status.textContent = `control plane unreachable (${err.message}); retrying`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

const wanted = /^#decision=(\d+)$/.exec(location.hash);
if (wanted) select(Number(wanted[1]));
poll();
