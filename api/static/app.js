"use strict";
/* rlrun dashboard: a dependency-free single-page app over the /v1 API (no build step).
   Routes: #/runs, #/runs/<id>, #/compare?runs=<id>,<id>&key=<metric>, #/datasets, #/datasets/<id>.
   With RLRUN_AUTH=on a 401 brings up the API key form (index.html); the key is kept in sessionStorage
   and sent as `Authorization: Bearer` on every call, the live stream included (class FetchEventSource).
   Charts are inline SVG (class Chart). Test hooks: data-testid on pages, tables and each chart's <svg>
   ("chart-<first key>", "compare-chart"); each series is a <polyline data-series=... data-points=N>. */

const FINISHED = new Set(["succeeded", "failed", "cancelled"]);
const STATUSES = ["queued", "running", "succeeded", "failed", "cancelled"];
const ALGORITHMS = ["sft", "reward_model", "dpo", "grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce",
  "reinforce_pp", "reinforce_baseline", "remax", "ppo", "vc_ppo", "eval", "merge"];
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777",
  "#4b5563", "#65a30d"];
const KEY_METRICS = ["eval/pass@1", "reward/mean", "loss"]; // the runs table shows the first one a run has
// The long phases a run goes through besides its steps (rlrun.schemas.PHASES), named as the CLI names them
// (rlrun/terminal.py: PHASE_LABELS).
const PHASE_LABELS = { model_load: "loading model", tokenize: "tokenising", reference: "reference log-probs",
  rollouts: "rollouts", eval: "evaluating", final_metrics: "final metrics", checkpoint: "writing checkpoint" };
const CHART_POINTS = 500; // max_points per key when (re)loading a series
const SVGNS = "http://www.w3.org/2000/svg";

/* ---------- DOM and formatting helpers ---------- */

function setAttrs(el, attrs) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
}
function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}
/** Replace an element's children, skipping null/undefined/false (unlike replaceChildren). */
function fill(el, ...children) {
  el.textContent = "";
  return append(el, children);
}
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  setAttrs(el, attrs);
  return append(el, children);
}
function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVGNS, tag);
  setAttrs(el, attrs);
  return append(el, children);
}
function card(title, ...children) {
  return h("section", { class: "card" }, title ? h("h2", {}, title) : null, ...children);
}
function badge(status, attrs = {}) {
  return h("span", { class: `badge status-${status}`, ...attrs }, status);
}
const enc = encodeURIComponent;

function fmtNum(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (!Number.isFinite(v)) return v > 0 ? "∞" : "−∞";
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 1e5 || a < 1e-3) return v.toExponential(2);
  if (Number.isInteger(v)) return String(v);
  return String(Number(v.toPrecision(4)));
}
function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}
function fmtDuration(sec) {
  if (sec === null || sec === undefined || !Number.isFinite(sec)) return "–";
  sec = Math.max(0, Math.round(sec));
  if (sec < 60) return `${sec}s`;
  if (sec < 3600) return `${Math.floor(sec / 60)}m ${sec % 60}s`;
  if (sec < 86400) return `${Math.floor(sec / 3600)}h ${Math.floor((sec % 3600) / 60)}m`;
  return `${Math.floor(sec / 86400)}d ${Math.floor((sec % 86400) / 3600)}h`;
}
function fmtAge(iso) {
  if (!iso) return "–";
  const sec = (Date.now() - Date.parse(iso)) / 1000;
  return sec < 5 ? "just now" : `${fmtDuration(sec).split(" ")[0]} ago`;
}
function fmtTime(iso) { return iso ? new Date(iso).toLocaleString() : "–"; }
function fmtClock(iso) { return iso ? new Date(iso).toLocaleTimeString() : ""; }
function shortId(id) { return String(id).slice(0, 8); }
function runLabel(run) { return run.name || (run.stage ? `${run.stage} · ${shortId(run.id)}` : shortId(run.id)); }
function runDuration(run) {
  if (!run.started_at) return null;
  const end = run.finished_at ? Date.parse(run.finished_at) : Date.now();
  return (end - Date.parse(run.started_at)) / 1000;
}
/** Text with control characters made visible (tiny models emit arbitrary bytes). */
function visible(text) {
  return String(text ?? "").replace(/[\x00-\x08\x0b-\x1f\x7f]/g,
    (c) => (c === "\x7f" ? "\u2421" : String.fromCharCode(0x2400 + c.charCodeAt(0))));
}
function textValue(v) {
  if (typeof v === "string") return visible(v);
  if (Array.isArray(v) && v.every((m) => m && typeof m === "object" && "role" in m)) {
    return v.map((m) => `${m.role}: ${visible(m.content)}`).join("\n");
  }
  return JSON.stringify(v);
}
function progressBar(step, total, attrs = {}) {
  const pct = total ? Math.min(100, (100 * step) / total) : 0;
  return h("div", { class: "progress", ...attrs },
    h("div", { class: "progress-bar" }, h("div", { class: "progress-fill", style: `width:${pct.toFixed(1)}%` })),
    h("span", { class: "progress-text", "data-testid": "progress-text" }, `${step} / ${total ?? "?"}`));
}
function fmtCount(n) { return Number(n).toLocaleString("en-US"); }
function phaseLabel(phase) { return PHASE_LABELS[phase] || String(phase).replace(/_/g, " "); }
const known = (v) => v !== null && v !== undefined;
/** "reference log-probs 120 / 1,300"; with no known total "loading model…" (or "tokenising… 1,200 done"). */
function phaseText(p) {
  if (known(p.total)) return `${phaseLabel(p.phase)} ${fmtCount(p.done ?? 0)} / ${fmtCount(p.total)}`;
  return `${phaseLabel(p.phase)}…${p.done ? ` ${fmtCount(p.done)} done` : ""}`;
}
/** Percent done of the phase (or of the steps), as a number; null when its total is unknown. */
function progressPct(p) {
  if (p.phase) return known(p.total) ? (p.total ? Math.min(100, (100 * (p.done ?? 0)) / p.total) : 100) : null;
  return p.total_steps ? Math.min(100, (100 * p.step) / p.total_steps) : null;
}
/** A run's progress as one line of text: its steps, or its long phase while one is under way (the steps
    after it once the run has taken one: an evaluation between steps). */
function progressText(p) {
  const steps = `${p.step} / ${p.total_steps ?? "?"}`;
  if (!p.phase) return steps;
  return p.step > 0 ? `${phaseText(p)} · step ${steps}` : phaseText(p);
}
/** A run's progress bar: filled by its steps, or by the items of its long phase while one is under way
    (an unknown total: a moving stripe). The text always names the phase, so colour is not the signal. */
function progressView(p, attrs = {}) {
  if (!p.phase) return progressBar(p.step, p.total_steps, attrs);
  const pct = progressPct(p);
  const fill = h("div", { class: "progress-fill", style: pct === null ? null : `width:${pct.toFixed(1)}%` });
  return h("div", { class: `progress in-phase${pct === null ? " indeterminate" : ""}`, "data-phase": p.phase, ...attrs },
    h("div", { class: "progress-bar" }, fill),
    h("span", { class: "progress-text", "data-testid": "progress-text" }, progressText(p)));
}
/** "⚠ 2" for a run its health checks flagged (null for none); its accessible name and tooltip list the codes. */
function warningBadge(warnings) {
  if (!warnings || !warnings.length) return null;
  const label = `${warnings.length} warning${warnings.length > 1 ? "s" : ""}: ${warnings.map((w) => w.code).join(", ")}`;
  return h("span", { class: "badge warn-badge", "data-testid": "warning-badge", role: "img", "aria-label": label,
    title: label }, `⚠ ${warnings.length}`);
}
/** The run page's list of warnings, each with its code, step and message in plain text (null for none). */
function warningsList(warnings) {
  if (!warnings || !warnings.length) return null;
  return h("section", { class: "warnings", "data-testid": "run-warnings", "aria-labelledby": "run-warnings-title" },
    h("h2", { id: "run-warnings-title" }, `⚠ Warnings (${warnings.length})`),
    h("ul", {}, warnings.map((w) => h("li", { "data-testid": "run-warning", "data-code": w.code },
      h("code", { class: "warn-code" }, w.code), h("span", { class: "muted small nowrap" }, `at step ${w.step}`),
      h("span", { class: "msg" }, w.message)))));
}

/* ---------- API ---------- */

class ApiError extends Error {
  constructor(status, body) {
    const e = (body && body.error) || {};
    super(e.message || `HTTP ${status}`);
    this.status = status;
    this.code = e.code || (status ? `http_${status}` : "network");
    this.field = e.field || null;
  }
}
async function api(path, options = {}) {
  const key = apiKey();
  const headers = { Accept: "application/json", ...authHeader(key), ...options.headers };
  let resp;
  try {
    resp = await fetch(path, { ...options, headers });
  } catch (err) {
    throw new ApiError(0, { error: { code: "network", message: `cannot reach the API (${err.message})` } });
  }
  const body = await readJson(resp);
  if (!resp.ok) throw refused(new ApiError(resp.status, body), key);
  return body;
}
async function readJson(resp) {
  const text = await resp.text();
  try { return text ? JSON.parse(text) : null; } catch { return null; }
}
function qs(params) {
  const p = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v === null || v === undefined || v === "") continue;
    for (const x of [].concat(v)) p.append(k, x);
  }
  const q = p.toString();
  return q ? `?${q}` : "";
}
/** Map over items with at most `limit` requests in flight. */
async function pool(items, limit, fn) {
  const out = new Array(items.length);
  let next = 0;
  const worker = async () => { while (next < items.length) { const i = next++; out[i] = await fn(items[i], i); } };
  await Promise.all(Array.from({ length: Math.min(limit, items.length) }, worker));
  return out;
}

/* ---------- API key (RLRUN_AUTH=on) ---------- */

// Kept in sessionStorage, not localStorage, so that it is gone when the tab closes. It travels only in
// the Authorization header, never in a URL: URLs end up in server logs and the browser's history.
const KEY_ITEM = "rlrun.apiKey";

function apiKey() { return sessionStorage.getItem(KEY_ITEM) || ""; }
function authHeader(key) { return key ? { Authorization: `Bearer ${key}` } : {}; }

/** The error, after asking for a key if the server refused the one this request sent (or its absence).
    A refusal of a key that has been replaced since the request left changes nothing. */
function refused(err, sentKey) {
  if (err.status === 401 && sentKey === apiKey()) askForKey(sentKey ? err.message : "");
  return err;
}

/** Stop the page and show the key form; `message` says why the key sent was refused ("" if none was). */
function askForKey(message) {
  sessionStorage.removeItem(KEY_ITEM);
  stopPage();
  hideBanner();
  renderKeyStatus();
  fill(document.getElementById("app"), h("p", { class: "empty", "data-testid": "needs-key" },
    "This server needs an API key: enter one above."));
  showKeyError(message);
  const form = document.getElementById("key-form");
  if (form.hidden) {
    form.hidden = false;
    document.getElementById("key-input").focus();
  }
}
function showKeyError(message) {
  const el = document.getElementById("key-error");
  el.textContent = message;
  el.hidden = !message;
}
function useKey(e) {
  e.preventDefault();
  const input = document.getElementById("key-input");
  const key = input.value.trim();
  // a header value must be printable ASCII: fetch() would fail with a confusing "network" error
  if (!/^[\x21-\x7e]+$/.test(key)) {
    showKeyError("An API key is one word of printable characters (rlrun_…).");
    return;
  }
  sessionStorage.setItem(KEY_ITEM, key);
  input.value = "";
  document.getElementById("key-form").hidden = true;
  renderKeyStatus();
  route(); // a wrong key answers 401, which brings the form back with the API's message
}
function forgetKey() {
  sessionStorage.removeItem(KEY_ITEM);
  renderKeyStatus();
  route(); // with auth on, the page's first call answers 401 and brings the form back
}
/** The topbar's "key rlrun_<prefix>" (the prefix is the key's public part) and its "forget key" button. */
function renderKeyStatus() {
  const key = apiKey();
  document.getElementById("key-status").hidden = !key;
  document.getElementById("key-prefix").textContent = key.split("_").slice(0, 2).join("_");
}

/** A download link that works with a key: a plain link cannot send the Authorization header, so with a key
    the file is fetched into memory and saved from a blob: URL. Without one the browser follows the link. */
async function downloadWithKey(e) {
  const key = apiKey();
  if (!key) return;
  e.preventDefault();
  const link = e.currentTarget;
  try {
    const resp = await fetch(link.href, { headers: authHeader(key) });
    if (!resp.ok) throw refused(new ApiError(resp.status, await readJson(resp)), key);
    const url = URL.createObjectURL(await resp.blob());
    h("a", { href: url, download: link.getAttribute("download") }).click();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
  } catch (err) { showError(err); }
}

/* ---------- server-sent events over fetch ---------- */

/** The text/event-stream format, read as EventSource reads it (HTML standard, "Interpreting an event
    stream"): lines end in CRLF, LF or CR; "field: value" (one space after the colon dropped); data lines
    joined with "\n"; a blank line dispatches; lines starting with ":" are comments. */
class SseParser {
  constructor(onMessage) {
    this.onMessage = onMessage; // ({type, data, lastEventId})
    this.rest = ""; // the unfinished last line
    this.data = "";
    this.type = "";
    this.idBuffer = "";
    this.lastEventId = ""; // set when a message is dispatched; sent as Last-Event-ID on reconnecting
    this.retry = null; // ms, if the server sent "retry:"
  }

  /** Decoded text; a CR at its end stays pending until the next chunk shows whether an LF follows. */
  push(text) {
    const lines = (this.rest + text).split(/\r\n|\n|\r(?!$)/);
    this.rest = lines.pop();
    for (const line of lines) this.line(line);
  }

  /** The connection ended: a final CR ends its line; a message without its blank line is dropped, its id
      too (the next connection starts from the last id dispatched, as in Chromium's EventSource). */
  end() {
    if (this.rest.endsWith("\r")) this.line(this.rest.slice(0, -1));
    this.rest = "";
    this.data = "";
    this.type = "";
    this.idBuffer = this.lastEventId;
  }

  line(line) {
    if (line === "") return this.dispatch();
    if (line.startsWith(":")) return;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") this.type = value;
    else if (field === "data") this.data += `${value}\n`;
    else if (field === "id" && !value.includes("\0")) this.idBuffer = value;
    else if (field === "retry" && /^\d+$/.test(value)) this.retry = Number(value);
  }

  dispatch() {
    const { data, type } = this;
    this.lastEventId = this.idBuffer; // even for a message without data, as EventSource does
    this.data = "";
    this.type = "";
    if (data) this.onMessage({ type: type || "message", data: data.slice(0, -1), lastEventId: this.lastEventId });
  }
}

/** EventSource's interface (addEventListener, onopen, onerror, readyState, close) over fetch(), because
    EventSource cannot send the Authorization header. After a dropped connection it reconnects with
    Last-Event-ID, waiting 1 s, 2 s, 4 s … up to 30 s; a refusal (a 4xx answer) closes it for good. */
class FetchEventSource {
  static CONNECTING = 0;
  static OPEN = 1;
  static CLOSED = 2;

  constructor(url) {
    this.url = url;
    this.readyState = FetchEventSource.CONNECTING;
    this.onopen = null;
    this.onerror = null;
    this.listeners = new Map(); // type -> [handler]
    this.parser = new SseParser((msg) => this.emit(msg));
    this.drops = 0; // in a row, for the backoff
    this.abort = new AbortController();
    this.timer = setTimeout(() => this.connect(), 0); // once the caller has added its listeners
  }

  addEventListener(type, fn) {
    if (!this.listeners.has(type)) this.listeners.set(type, []);
    this.listeners.get(type).push(fn);
  }

  close() {
    this.readyState = FetchEventSource.CLOSED;
    clearTimeout(this.timer);
    this.abort.abort();
  }

  emit(msg) {
    for (const fn of this.listeners.get(msg.type) || []) {
      if (this.readyState === FetchEventSource.CLOSED) return; // a handler closed it ("end")
      // reported like any uncaught error, without dropping the connection (as EventSource does)
      try { fn(msg); } catch (err) { setTimeout(() => { throw err; }); }
    }
  }

  async connect() {
    const key = apiKey();
    const headers = { Accept: "text/event-stream", ...authHeader(key) };
    if (this.parser.lastEventId) headers["Last-Event-ID"] = this.parser.lastEventId;
    let resp;
    try {
      resp = await fetch(this.url, { headers, cache: "no-store", signal: this.abort.signal });
    } catch {
      return this.dropped();
    }
    if (resp.status >= 500 || resp.status === 429) return this.dropped(); // a restarting server or proxy
    if (!resp.ok || !isEventStream(resp)) return this.refuse(resp, key);
    this.readyState = FetchEventSource.OPEN;
    this.drops = 0;
    if (this.onopen) this.onopen();
    try { await this.read(resp.body); } catch { /* dropped, or aborted by close() */ }
    this.dropped();
  }

  async read(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    for (;;) {
      const { done, value } = await reader.read();
      if (done) return;
      this.parser.push(decoder.decode(value, { stream: true }));
    }
  }

  /** The connection failed or ended before the server's last message: reconnect, after the last id. */
  dropped() {
    this.parser.end();
    if (this.readyState === FetchEventSource.CLOSED) return;
    this.readyState = FetchEventSource.CONNECTING;
    if (this.onerror) this.onerror();
    const delay = Math.min(30000, (this.parser.retry ?? 1000) * 2 ** this.drops++);
    this.timer = setTimeout(() => this.connect(), delay);
  }

  /** An answer that is not a stream: final, as for EventSource; a 401 asks for a key. */
  async refuse(resp, key) {
    const body = await readJson(resp).catch(() => null);
    if (this.readyState === FetchEventSource.CLOSED) return;
    this.close();
    const err = refused(new ApiError(resp.status, body), key);
    if (this.onerror) this.onerror(err);
  }
}
function isEventStream(resp) {
  return (resp.headers.get("Content-Type") || "").split(";")[0].trim().toLowerCase() === "text/event-stream";
}

/* ---------- error banner ---------- */

function showError(err) {
  if (err.status === 401) return; // the API key form says it (askForKey)
  const banner = document.getElementById("banner");
  const code = err instanceof ApiError ? `${err.code}${err.field ? ` (${err.field})` : ""}: ` : "";
  fill(banner, h("span", {}, code + (err.message || String(err))),
    h("button", { class: "link", onclick: () => { banner.hidden = true; } }, "dismiss"));
  banner.hidden = false;
}
function hideBanner() { document.getElementById("banner").hidden = true; }

/* ---------- chart ---------- */

let currentPage = null; // { alive, cleanups, charts }

/** A line chart as inline SVG: series = [{id, label, color, points: [[step, value], ...]}]. */
class Chart {
  constructor({ testid, title, height = 200 }) {
    this.testid = testid;
    this.title = title;
    this.height = height;
    this.series = [];
    this.plot = h("div", { class: "chart-plot" });
    this.legend = h("div", { class: "legend" });
    this.tip = h("div", { class: "tooltip", hidden: true });
    this.el = h("figure", { class: "chart", "data-chart": testid },
      h("figcaption", {}, title), this.plot, this.legend, this.tip);
    if (currentPage) currentPage.charts.add(this);
  }

  set(series) {
    this.series = series;
    if (this.el.isConnected) this.render();
    else requestAnimationFrame(() => this.render());
  }

  render() {
    const W = Math.max(240, Math.floor(this.plot.clientWidth || 480));
    const H = this.height;
    const m = { l: 58, r: 14, t: 10, b: 24 };
    const pw = W - m.l - m.r;
    const ph = H - m.t - m.b;
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (const sr of this.series) {
      for (const [x, y] of sr.points) {
        if (!Number.isFinite(y)) continue;
        if (x < x0) x0 = x;
        if (x > x1) x1 = x;
        if (y < y0) y0 = y;
        if (y > y1) y1 = y;
      }
    }
    const root = s("svg", { class: "chart-svg", width: W, height: H, viewBox: `0 0 ${W} ${H}`,
      "data-testid": this.testid, role: "img", "aria-label": this.title });
    const empty = !(x0 <= x1);
    if (empty) {
      x0 = 0; x1 = 1; y0 = 0; y1 = 1;
    }
    const xa = x0 === x1 ? x0 - 1 : x0, xb = x0 === x1 ? x1 + 1 : x1;
    let ya = y0, yb = y1;
    if (ya === yb) { const d = Math.abs(ya) * 0.05 || 1; ya -= d; yb += d; }
    const pad = (yb - ya) * 0.05;
    ya -= pad; yb += pad;
    const X = (v) => m.l + ((v - xa) / (xb - xa)) * pw;
    const Y = (v) => m.t + ph - ((v - ya) / (yb - ya)) * ph;
    this.scale = { X, m, pw, xa, xb };

    // grid and labels: the data's min and max (and the middle) on both axes
    const yTicks = empty ? [] : y0 === y1 ? [y0] : [y0, (y0 + y1) / 2, y1];
    for (const [i, v] of yTicks.entries()) {
      const cls = yTicks.length === 1 ? "" : i === 0 ? "min" : i === 2 ? "max" : "mid";
      root.append(s("line", { class: "grid", x1: m.l, x2: W - m.r, y1: Y(v), y2: Y(v) }),
        s("text", { class: `ylab ${cls}`, x: m.l - 6, y: Y(v) + 4, "text-anchor": "end" }, fmtNum(v)));
    }
    const xTicks = empty ? [] : x0 === x1 ? [x0] : [x0, Math.round((x0 + x1) / 2), x1];
    for (const [i, v] of xTicks.entries()) {
      const anchor = xTicks.length === 1 ? "middle" : i === 0 ? "start" : i === 2 ? "end" : "middle";
      root.append(s("text", { class: "xlab", x: X(v), y: H - 6, "text-anchor": anchor }, fmtNum(v)));
    }
    root.append(s("line", { class: "axis", x1: m.l, x2: m.l, y1: m.t, y2: m.t + ph }),
      s("line", { class: "axis", x1: m.l, x2: W - m.r, y1: m.t + ph, y2: m.t + ph }));
    if (empty) {
      root.append(s("text", { class: "nodata", x: m.l + pw / 2, y: m.t + ph / 2, "text-anchor": "middle" },
        "no points yet"));
    }
    for (const sr of this.series) {
      const pts = sr.points.filter((p) => Number.isFinite(p[1]));
      const drawn = pts.length > pw * 2 ? decimate(pts, Math.floor(pw)) : pts;
      root.append(s("polyline", {
        class: "series", fill: "none", stroke: sr.color, "stroke-width": 1.6, "stroke-linejoin": "round",
        "data-series": sr.id, "data-points": sr.points.length,
        points: drawn.map(([x, y]) => `${X(x).toFixed(1)},${Y(y).toFixed(1)}`).join(" "),
      }));
      if (pts.length <= 40) {
        for (const [x, y] of pts) root.append(s("circle", { cx: X(x), cy: Y(y), r: 2.4, fill: sr.color }));
      }
    }
    this.guide = s("line", { class: "guide", x1: 0, x2: 0, y1: m.t, y2: m.t + ph, visibility: "hidden" });
    root.append(this.guide);
    root.addEventListener("mousemove", (e) => this.hover(e, root));
    root.addEventListener("mouseleave", () => { this.tip.hidden = true; this.guide.setAttribute("visibility", "hidden"); });
    fill(this.plot, root);

    fill(this.legend, ...this.series.map((sr) => {
      const last = sr.points.length ? sr.points[sr.points.length - 1][1] : null;
      return h("span", { class: "legend-item", "data-series": sr.id, title: sr.title || sr.label },
        h("i", { class: "swatch", style: `background:${sr.color}` }),
        sr.href ? h("a", { href: sr.href }, sr.label) : h("span", {}, sr.label),
        h("b", {}, fmtNum(last)));
    }));
  }

  hover(e, root) {
    const { X, m, pw, xa, xb } = this.scale;
    const rect = root.getBoundingClientRect();
    const px = e.clientX - rect.left;
    if (px < m.l || px > m.l + pw || !this.series.some((sr) => sr.points.length)) return;
    const step = xa + ((px - m.l) / pw) * (xb - xa);
    const hits = this.series.map((sr) => [sr, nearest(sr.points, step)]).filter(([, p]) => p);
    let at = hits[0][1][0];
    for (const [, p] of hits) if (Math.abs(p[0] - step) < Math.abs(at - step)) at = p[0];
    const rows = hits.map(([sr, p]) => h("div", {}, h("i", { class: "swatch", style: `background:${sr.color}` }),
      `${sr.label}: `, h("b", {}, fmtNum(p[1])), p[0] !== at ? h("span", { class: "muted" }, ` @ ${p[0]}`) : ""));
    this.guide.setAttribute("x1", X(at));
    this.guide.setAttribute("x2", X(at));
    this.guide.setAttribute("visibility", "visible");
    fill(this.tip, h("div", { class: "muted" }, `step ${at}`), ...rows);
    this.tip.hidden = false;
    const left = px + 14 + this.tip.offsetWidth > rect.width ? px - 14 - this.tip.offsetWidth : px + 14;
    this.tip.style.left = `${Math.max(0, left) + this.plot.offsetLeft}px`;
    this.tip.style.top = `${this.plot.offsetTop + 8}px`;
  }
}

function nearest(points, step) {
  if (!points.length) return null;
  let lo = 0, hi = points.length - 1;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (points[mid][0] < step) lo = mid + 1; else hi = mid;
  }
  if (lo > 0 && Math.abs(points[lo - 1][0] - step) <= Math.abs(points[lo][0] - step)) lo -= 1;
  return points[lo];
}

/** Min-max decimation for drawing: about 2 * buckets points, first and last kept. */
function decimate(points, buckets) {
  const out = [points[0]];
  const n = points.length;
  for (let b = 0; b < buckets; b++) {
    const lo = 1 + Math.floor(((n - 2) * b) / buckets), hi = 1 + Math.floor(((n - 2) * (b + 1)) / buckets);
    if (lo >= hi) continue;
    let mn = lo, mx = lo;
    for (let i = lo; i < hi; i++) {
      if (points[i][1] < points[mn][1]) mn = i;
      if (points[i][1] > points[mx][1]) mx = i;
    }
    out.push(...(mn < mx ? [points[mn], points[mx]] : mn === mx ? [points[mn]] : [points[mx], points[mn]]));
  }
  out.push(points[n - 1]);
  return out;
}

/** A series keyed by step, kept sorted (a resumed attempt may rewrite a step). */
class Series {
  constructor() { this.points = []; }
  add(step, value) {
    const pts = this.points;
    if (!pts.length || step > pts[pts.length - 1][0]) { pts.push([step, value]); return; }
    let lo = 0, hi = pts.length;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (pts[mid][0] < step) lo = mid + 1; else hi = mid; }
    if (lo < pts.length && pts[lo][0] === step) pts[lo][1] = value; else pts.splice(lo, 0, [step, value]);
  }
  get last() { return this.points.length ? this.points[this.points.length - 1] : null; }
}

/* ---------- metric grouping for the run page ---------- */

// One chart per group, in this order; `each` makes one chart per matching key. Keys matching no group
// get a chart each (after these); final/* values are shown as a table, not charted.
const GROUPS = [
  { title: "Loss", keys: ["loss"] },
  { title: "Reward (mean, min, max)", keys: ["reward/mean", "reward/min", "reward/max"] },
  { title: "Reward components (mean)", match: /^reward\/(?!failures$)[^/]+\/mean$/ },
  { title: "Reward std", keys: ["reward/std"] },
  { title: "Accuracy", keys: ["rewards/accuracy", "accuracy", "token_accuracy"] },
  { title: "Implicit rewards", keys: ["rewards/chosen", "rewards/rejected"] },
  { title: "Reward margin", keys: ["rewards/margin", "margin"] },
  { title: "Log-probs", keys: ["logps/chosen", "logps/rejected"] },
  { title: "Scores", keys: ["scores/mean", "scores/std"] },
  { title: "Evaluation", match: /^eval\//, each: true },
  { title: "KL to reference", keys: ["kl/ref", "kl/seq"] },
  { title: "Policy entropy", keys: ["policy/entropy"] },
  { title: "Clip fraction", keys: ["policy/clipfrac"] },
  { title: "Approx. KL (old policy)", keys: ["policy/approx_kl"] },
  { title: "Losses", match: /^loss\// },
  { title: "Value", match: /^(value|critic)\// },
  { title: "Advantages", match: /^adv\// },
  { title: "Response length", keys: ["response/length_mean", "response/length_max"] },
  { title: "Truncated responses", keys: ["response/truncated_frac"] },
  { title: "Groups", match: /^groups\// , each: true },
  { title: "Reward failures", keys: ["reward/failures"] },
  { title: "KL coefficient", keys: ["kl/coef"] },
  { title: "Grad norm", keys: ["grad_norm"] },
  { title: "Learning rate", keys: ["lr"] },
  { title: "Throughput", match: /^perf\//, each: true },
];

/** [{title, keys}] for the keys a run has, in display order. */
function groupKeys(keys) {
  const left = new Set(keys.filter((k) => !k.startsWith("final/")));
  const out = [];
  for (const g of GROUPS) {
    const hit = g.keys ? g.keys.filter((k) => left.has(k)) : [...left].filter((k) => g.match.test(k)).sort();
    if (!hit.length) continue;
    hit.forEach((k) => left.delete(k));
    if (g.each) hit.forEach((k) => out.push({ title: k, keys: [k] }));
    else out.push({ title: g.title, keys: hit });
  }
  [...left].sort().forEach((k) => out.push({ title: k, keys: [k] }));
  return out;
}

/* ---------- router ---------- */

function parseHash() {
  const raw = location.hash.replace(/^#/, "") || "/runs";
  const [path, query = ""] = raw.split("?");
  return { parts: path.split("/").filter(Boolean).map(decodeURIComponent), params: new URLSearchParams(query) };
}

function stopPage() {
  if (!currentPage) return;
  currentPage.alive = false;
  for (const f of currentPage.cleanups.splice(0)) { try { f(); } catch { /* ignore */ } }
}
async function route() {
  stopPage();
  const ctx = { alive: true, cleanups: [], charts: new Set() };
  currentPage = ctx;
  hideBanner();
  const { parts, params } = parseHash();
  const section = parts[0] || "runs";
  for (const a of document.querySelectorAll("[data-nav]")) a.classList.toggle("active", a.dataset.nav === section);
  const main = document.getElementById("app");
  fill(main);
  try {
    if (section === "runs" && parts[1]) await runPage(ctx, main, parts[1]);
    else if (section === "runs") await runsPage(ctx, main, params);
    else if (section === "compare") await comparePage(ctx, main, params);
    else if (section === "datasets") await datasetsPage(ctx, main, parts[1]);
    else main.append(h("p", { class: "empty" }, "No such page. ", h("a", { href: "#/runs" }, "Go to runs")));
  } catch (err) {
    if (!ctx.alive) return;
    showError(err);
    main.append(h("p", { class: "empty", "data-testid": "page-error" }, err.message || String(err)));
  }
}
function every(ctx, ms, fn) {
  const t = setInterval(() => { if (ctx.alive && !document.hidden) fn(); }, ms);
  ctx.cleanups.push(() => clearInterval(t));
}
let resizeTimer = null;
window.addEventListener("resize", () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(() => currentPage && currentPage.charts.forEach((c) => c.el.isConnected && c.render()), 150);
});
window.addEventListener("hashchange", route);
document.getElementById("key-form").addEventListener("submit", useKey);
document.getElementById("forget-key").addEventListener("click", forgetKey);
renderKeyStatus();
route();

/* ---------- runs list ---------- */

async function runsPage(ctx, main, params) {
  document.title = "Runs · rlrun";
  const filters = { status: params.get("status") || "", algorithm: params.get("algorithm") || "",
    flagged: ["true", "false"].includes(params.get("flagged")) ? params.get("flagged") : "" };
  const selected = new Set();
  const keyMetric = new Map(); // run id -> {key, value, final}
  const rowCache = new Map(); // run id -> {sig, tr}
  let runs = [];
  let hasMore = false;
  let nextCursor = null;

  const statusSel = h("select", { id: "filter-status", "data-testid": "filter-status" },
    h("option", { value: "" }, "all statuses"), STATUSES.map((st) => h("option", { value: st }, st)));
  const algoSel = h("select", { id: "filter-algorithm", "data-testid": "filter-algorithm" },
    h("option", { value: "" }, "all algorithms"), ALGORITHMS.map((a) => h("option", { value: a }, a)));
  // ?flagged= of GET /v1/runs: runs with (or without) health warnings
  const flaggedSel = h("select", { id: "filter-flagged", "data-testid": "filter-flagged", "aria-label": "health warnings" },
    h("option", { value: "" }, "with or without warnings"), h("option", { value: "true" }, "⚠ flagged: with warnings"),
    h("option", { value: "false" }, "without warnings"));
  statusSel.value = filters.status;
  algoSel.value = filters.algorithm;
  flaggedSel.value = filters.flagged;
  const compareBtn = h("button", { class: "primary", "data-testid": "compare-button", disabled: true,
    onclick: () => { location.hash = `#/compare?runs=${[...selected].map(enc).join(",")}`; } }, "Compare");
  const count = h("span", { class: "muted", "data-testid": "runs-count" });
  const tbody = h("tbody");
  const table = h("table", { class: "table runs", id: "runs-table", "data-testid": "runs-table" },
    h("thead", {}, h("tr", {}, h("th", { class: "check" }), ["Run", "Status", "Algorithm", "Model", "Progress",
      "Key metric", "Created", "Duration"].map((t) => h("th", {}, t)))), tbody);
  const more = h("button", { "data-testid": "load-more", hidden: true, onclick: () => load(false) }, "Load more");
  main.append(h("div", { class: "page-head" }, h("h1", {}, "Runs"), count),
    h("div", { class: "toolbar" }, statusSel, algoSel, flaggedSel, compareBtn,
      h("span", { class: "muted hint" }, "tick runs to overlay a metric")),
    h("div", { class: "card flush" }, table), more);

  const syncUrl = () => history.replaceState(null, "", `#/runs${qs(filters)}`);
  statusSel.addEventListener("change", () => { filters.status = statusSel.value; syncUrl(); load(true); });
  flaggedSel.addEventListener("change", () => { filters.flagged = flaggedSel.value; syncUrl(); load(true); });
  algoSel.addEventListener("change", () => { filters.algorithm = algoSel.value; syncUrl(); render(); });

  function updateCompare() {
    compareBtn.disabled = selected.size < 1;
    compareBtn.textContent = selected.size ? `Compare ${selected.size} run${selected.size > 1 ? "s" : ""}` : "Compare";
  }

  function render() {
    const shown = runs.filter((r) => !filters.algorithm || r.algorithm === filters.algorithm);
    count.textContent = `${shown.length} shown${hasMore ? " (more below)" : ""}`;
    more.hidden = !hasMore;
    if (!shown.length) {
      rowCache.clear();
      fill(tbody, h("tr", {}, h("td", { colspan: 9, class: "empty" },
        runs.length || filters.status || filters.flagged ? "No run matches the filters."
          : "No runs yet: submit one with POST /v1/runs (see the README).")));
      return;
    }
    // rows are rebuilt only when what they show changed, so a checkbox being clicked stays in place
    const trs = shown.map((r) => {
      const km = keyMetric.get(r.id);
      const sig = JSON.stringify([r.status, r.name, r.progress, r.warnings, km && km.key, km && km.value,
        fmtAge(r.created_at), fmtDuration(runDuration(r))]);
      const cached = rowCache.get(r.id);
      if (cached && cached.sig === sig) return cached.tr;
      const tr = runRow(r, km);
      rowCache.set(r.id, { sig, tr });
      return tr;
    });
    const same = trs.length === tbody.children.length && trs.every((tr, i) => tbody.children[i] === tr);
    if (!same) tbody.replaceChildren(...trs);
  }

  function runRow(r, km) {
    const box = h("input", { type: "checkbox", "data-testid": "select-run", "aria-label": `select ${runLabel(r)}`,
      checked: selected.has(r.id), onchange: (e) => {
        if (e.target.checked) selected.add(r.id); else selected.delete(r.id);
        updateCompare();
      } });
    return h("tr", { class: "clickable", "data-testid": "run-row", "data-run-id": r.id, "data-status": r.status,
      onclick: (e) => { if (!e.target.closest("input,a")) location.hash = `#/runs/${r.id}`; } },
    h("td", { class: "check" }, box),
    h("td", {}, h("a", { href: `#/runs/${r.id}` }, runLabel(r)),
      r.name ? h("span", { class: "muted mono small" }, ` ${shortId(r.id)}`) : null,
      r.stage ? h("span", { class: "muted small" }, ` · stage ${r.stage}`) : null),
    h("td", { class: "nowrap" }, badge(r.status, { "data-testid": "status" }), " ", warningBadge(r.warnings)),
    h("td", {}, r.algorithm),
    h("td", { class: "small" }, modelRef(r.spec && r.spec.model)),
    h("td", {}, progressView(r.progress)),
    h("td", { "data-testid": "key-metric" }, km && km.key
      ? [h("span", { class: "muted small" }, `${km.key} `), h("b", {}, fmtNum(km.value))] : "–"),
    h("td", { title: fmtTime(r.created_at) }, fmtAge(r.created_at)),
    h("td", {}, fmtDuration(runDuration(r))));
  }

  async function loadKeyMetrics() {
    const todo = runs.filter((r) => { const km = keyMetric.get(r.id); return !km || !km.final; });
    await pool(todo, 4, async (r) => {
      try {
        const page = await api(`/v1/runs/${r.id}/metrics${qs({ key: KEY_METRICS, max_points: 4 })}`);
        const lastOf = {};
        for (const p of page.data) lastOf[p.key] = p.value;
        const key = KEY_METRICS.find((k) => k in lastOf);
        keyMetric.set(r.id, { key, value: key ? lastOf[key] : null, final: FINISHED.has(r.status) });
      } catch { /* a run deleted meanwhile: leave it blank */ }
    });
    if (ctx.alive) render();
  }

  async function load(reset) {
    const page = await api(`/v1/runs${qs({ limit: 50, status: filters.status, flagged: filters.flagged,
      after: reset ? null : nextCursor })}`);
    if (!ctx.alive) return;
    runs = reset ? page.data : runs.concat(page.data);
    hasMore = page.has_more;
    nextCursor = page.next_cursor;
    render();
    loadKeyMetrics();
  }

  async function refresh() {
    const limit = Math.min(200, Math.max(50, runs.length));
    try {
      const page = await api(`/v1/runs${qs({ limit, status: filters.status, flagged: filters.flagged })}`);
      if (!ctx.alive) return;
      runs = page.data;
      hasMore = page.has_more;
      nextCursor = page.next_cursor;
      render();
      loadKeyMetrics();
    } catch (err) { showError(err); }
  }

  updateCompare();
  await load(true);
  every(ctx, 5000, refresh);
}

/* ---------- one run ---------- */

/** The model a run started from, when it is one the inference routes can name (a run or a preset). */
function startModel(run) {
  const m = run.spec.model || "";
  return m.startsWith("run:") || m.startsWith("tiny:") ? m : "";
}

/** A prompt box that streams the run's model's answer beside another model's (e.g. the SFT start). */
function playground(run) {
  const prompt = h("textarea", { id: "pg-prompt", "data-testid": "pg-prompt", rows: 3, "aria-label": "Prompt",
    placeholder: "A prompt, written as the run's data writes them (e.g. 12+30=)" });
  const other = h("input", { id: "pg-other", "data-testid": "pg-other", value: startModel(run), size: 44,
    "aria-label": "Compare with model (run:<id>, tiny:<preset>; empty: none)" });
  const chat = h("input", { type: "checkbox", id: "pg-chat", "aria-label": "Chat (apply the chat template)" });
  const maxTokens = h("input", { type: "number", id: "pg-max", value: 32, min: 1, max: 4096, "aria-label": "Max tokens" });
  const temperature = h("input", { type: "number", id: "pg-temp", value: 0, min: 0, max: 2, step: 0.1, "aria-label": "Temperature" });
  const outs = [0, 1].map((i) => h("pre", { class: "answer", "data-testid": `pg-answer-${i}` }));
  const heads = [0, 1].map(() => h("h3", { class: "small mono" }));
  const button = h("button", { "data-testid": "pg-ask", onclick: ask }, "Ask");
  async function ask() {
    const models = [`run:${run.id}`, other.value.trim()];
    button.disabled = true;
    try {
      await Promise.all(models.map(async (model, i) => {
        fill(heads[i], model || "–");
        fill(outs[i], "");
        if (!model) return;
        try {
          await streamCompletion(model, prompt.value, chat.checked, Number(maxTokens.value), Number(temperature.value),
            (piece) => outs[i].append(piece));
        } catch (err) {
          outs[i].append(h("span", { class: "error-text" }, ` [${err.message}]`));
        }
      }));
    } finally { button.disabled = false; }
  }
  return h("div", { class: "playground", "data-testid": "playground" },
    h("label", {}, "Prompt", prompt),
    h("div", { class: "pg-controls" },
      h("label", {}, "Compare with ", other), h("label", {}, chat, " chat"),
      h("label", {}, "max tokens ", maxTokens), h("label", {}, "temperature ", temperature), button),
    h("div", { class: "two-col" }, [0, 1].map((i) => h("div", {}, heads[i], outs[i]))));
}

/** POST an OpenAI completion (or chat) request with stream: true; onText(piece) for each piece of text. */
async function streamCompletion(model, prompt, chat, maxTokens, temperature, onText) {
  const body = chat ? { model, messages: [{ role: "user", content: prompt }] } : { model, prompt };
  Object.assign(body, { max_tokens: maxTokens, temperature, stream: true });
  const resp = await fetch(chat ? "/v1/chat/completions" : "/v1/completions", {
    method: "POST", headers: { "Content-Type": "application/json", ...authHeader(apiKey()) }, body: JSON.stringify(body),
  });
  if (!resp.ok) throw new ApiError(resp.status, await readJson(resp));
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const choice = (JSON.parse(data).choices || [])[0];
        if (choice) onText(chat ? (choice.delta.content || "") : (choice.text || ""));
      }
    }
  }
}

async function runPage(ctx, main, runId) {
  document.title = `Run ${shortId(runId)} · rlrun`;
  const base = `/v1/runs/${enc(runId)}`;
  let run = await api(base);
  if (!ctx.alive) return;
  document.title = `${runLabel(run)} · rlrun`;

  const series = new Map(); // key -> Series
  const loadedUpTo = new Map(); // key -> last step of the downsampled load (older stream points are skipped)
  const eventIds = new Set();
  let charts = new Map(); // first key -> {chart, keys}
  let layoutSig = "";
  let dirty = false;
  let liveState = FINISHED.has(run.status) ? "" : "connecting";
  let confirmCancel = false;

  const header = h("section", { class: "card run-header", "data-testid": "run-header" });
  const finalBox = h("div", { class: "final", "data-testid": "final-metrics" });
  const chartsGrid = h("div", { class: "charts", "data-testid": "charts" });
  const eventsList = h("ol", { class: "events", "data-testid": "events" });
  const eventsBox = h("div", { class: "scroll" }, eventsList);
  const ckptBox = h("div", { "data-testid": "checkpoints" }, h("p", { class: "muted" }, "Loading…"));
  const samplesBox = h("div", { "data-testid": "samples" });
  const samplesCard = card("Samples", samplesBox);
  samplesCard.hidden = true;
  const spec = h("pre", { class: "json", "data-testid": "spec" }, JSON.stringify(run.spec, null, 2));
  const pipelineBox = h("div", { class: "pipeline", "data-testid": "pipeline" });
  main.append(h("p", { class: "crumbs" }, h("a", { href: "#/runs" }, "← Runs")), header,
    card("Metrics", finalBox, chartsGrid),
    h("div", { class: "two-col" }, card("Events", eventsBox), card("Checkpoints", ckptBox)),
    samplesCard, card("Spec", spec));
  if (run.status === "succeeded" && run.output_path && run.algorithm !== "reward_model") {
    main.insertBefore(card("Playground", playground(run)), main.lastElementChild);
  }

  function renderHeader() {
    const done = FINISHED.has(run.status);
    const cancelBtn = done ? null : h("button", {
      class: confirmCancel ? "danger" : "", id: "cancel-run", "data-testid": "cancel-button",
      disabled: run.cancel_requested, onclick: onCancel,
    }, run.cancel_requested ? "Cancelling…" : confirmCancel ? "Confirm cancel" : "Cancel run");
    const facts = [
      ["Algorithm", run.algorithm],
      ["Model", modelRef(run.spec.model)],
      ["Dataset", run.dataset_id ? h("a", { href: `#/datasets/${run.dataset_id}`, class: "mono" }, shortId(run.dataset_id)) : "–"],
      ["Created", h("span", { title: fmtTime(run.created_at) }, fmtAge(run.created_at))],
      ["Duration", fmtDuration(runDuration(run))],
      ["Attempt", run.attempt],
    ];
    if (run.output_path) facts.push(["Output", h("span", { class: "mono small" }, run.output_path), "wide"]);
    fill(header,
      h("div", { class: "run-title" },
        h("h1", {}, runLabel(run)),
        badge(run.status, { id: "run-status", "data-testid": "status" }),
        liveState ? h("span", { class: `live live-${liveState}`, "data-testid": "live" },
          liveState === "live" ? "● live" : liveState === "connecting" ? "connecting…" : "reconnecting…") : null,
        h("span", { class: "spacer" }),
        h("a", { class: "button", href: `#/compare?runs=${run.id}` }, "Compare…"),
        cancelBtn),
      h("div", { class: "mono muted small" }, run.id),
      h("div", { class: "run-progress", id: "run-progress", "data-testid": "progress" }, progressParts()),
      run.error ? h("div", { class: "error-box", "data-testid": "run-error" }, run.error) : null,
      warningsList(run.warnings),
      h("dl", { class: "facts" }, facts.map(([k, v, cls]) => h("div", { class: cls }, h("dt", {}, k), h("dd", {}, v)))),
      pipelineBox);
  }

  async function onCancel() {
    if (!confirmCancel) {
      confirmCancel = true;
      renderHeader();
      setTimeout(() => { confirmCancel = false; if (ctx.alive) renderHeader(); }, 4000);
      return;
    }
    confirmCancel = false;
    try {
      run = await api(`${base}/cancel`, { method: "POST" });
    } catch (err) { showError(err); }
    if (ctx.alive) renderHeader();
  }

  async function loadPipeline() {
    if (!run.pipeline_id) return;
    try {
      const p = await api(`/v1/pipelines/${run.pipeline_id}`);
      fill(pipelineBox, h("span", { class: "muted" }, `pipeline ${p.name || shortId(p.id)} `),
        badge(p.status), " ",
        p.stages.map((st, i) => [i ? h("span", { class: "muted" }, " → ") : null,
          st.run_id && st.run_id !== run.id ? h("a", { href: `#/runs/${st.run_id}` }, st.name)
            : h("b", {}, st.name), " ", badge(st.status)]),
        p.reason ? h("div", { class: "muted small" }, p.reason) : null);
    } catch { /* optional */ }
  }

  function layoutCharts() {
    const groups = groupKeys([...series.keys()]);
    const sig = JSON.stringify(groups);
    if (sig === layoutSig) return false;
    layoutSig = sig;
    charts = new Map();
    for (const g of groups) {
      const chart = new Chart({ testid: `chart-${g.keys[0]}`, title: g.title });
      charts.set(g.keys[0], { chart, keys: g.keys });
    }
    fill(chartsGrid, ...[...charts.values()].map((c) => c.chart.el));
    if (!charts.size) chartsGrid.append(h("p", { class: "empty" }, FINISHED.has(run.status)
      ? "This run logged no metrics." : "No metrics yet: charts appear as the run logs them."));
    return true;
  }

  function drawCharts() {
    dirty = false;
    layoutCharts();
    for (const { chart, keys } of charts.values()) {
      chart.set(keys.map((k, i) => ({ id: k, label: k, color: COLORS[i % COLORS.length], points: series.get(k).points })));
    }
    const finals = [...series.keys()].filter((k) => k.startsWith("final/")).sort();
    fill(finalBox, finals.length ? h("h3", {}, "Final metrics") : null,
      finals.length ? h("div", { class: "tiles" }, finals.map((k) => h("div", { class: "tile", "data-key": k },
        h("span", { class: "muted small" }, k.slice(6)), h("b", {}, fmtNum(series.get(k).last[1]))))) : null);
  }

  function addPoint(key, step, value) {
    if (!series.has(key)) series.set(key, new Series());
    series.get(key).add(step, value);
  }

  async function loadMetrics() {
    const page = await api(`${base}/metrics${qs({ max_points: CHART_POINTS })}`);
    for (const p of page.data) {
      addPoint(p.key, p.step, p.value);
      loadedUpTo.set(p.key, Math.max(loadedUpTo.get(p.key) ?? -1, p.step));
    }
    drawCharts();
  }

  /** Add one event to the list; false if it was there already. */
  function addEvent(e) {
    if (eventIds.has(e.id)) return false;
    eventIds.add(e.id);
    const nearBottom = eventsBox.scrollHeight - eventsBox.scrollTop - eventsBox.clientHeight < 30;
    eventsList.append(h("li", { class: `event kind-${e.kind}`, title: e.data ? JSON.stringify(e.data) : "" },
      h("time", { title: fmtTime(e.created_at) }, fmtClock(e.created_at)),
      h("span", { class: `kind kind-${e.kind}` }, e.kind), h("span", { class: "msg" }, e.message)));
    if (nearBottom) eventsBox.scrollTop = eventsBox.scrollHeight;
    return true;
  }

  async function loadEvents() {
    let after = null;
    for (let i = 0; i < 10; i++) {
      const page = await api(`${base}/events${qs({ limit: 1000, after })}`);
      page.data.forEach(addEvent);
      if (!page.has_more) break;
      after = page.next_cursor;
    }
    if (!eventIds.size) eventsList.append(h("li", { class: "muted" }, "No events."));
  }

  async function loadCheckpoints() {
    const ckpts = await api(`${base}/checkpoints`);
    if (!ckpts.length) {
      fill(ckptBox, h("p", { class: "muted" }, FINISHED.has(run.status) ? "No checkpoints kept." : "No checkpoints yet."));
      return;
    }
    const preferred = ["reward/mean", "eval/accuracy", "loss", "final/loss", "rewards/accuracy",
      "final/rewards/accuracy", "accuracy", "token_accuracy", "eval/loss"];
    const shownKeys = (m) => preferred.filter((k) => k in m).slice(0, 3);
    fill(ckptBox, h("table", { class: "table compact" },
      h("thead", {}, h("tr", {}, ["Step", "Size", "Saved", "Metrics", "Model ref", ""].map((t) => h("th", {}, t)))),
      h("tbody", {}, ckpts.map((c) => h("tr", { "data-testid": "checkpoint-row", "data-step": c.step },
        h("td", { class: "num" }, c.step), h("td", { class: "nowrap" }, fmtBytes(c.size_bytes)),
        h("td", { class: "nowrap", title: fmtTime(c.created_at) }, fmtClock(c.created_at)),
        h("td", { class: "small" }, shownKeys(c.metrics).map((k) => h("div", {}, `${k} `, h("b", {}, fmtNum(c.metrics[k]))))),
        h("td", { class: "mono small" }, c.model_ref),
        h("td", {}, h("a", { href: `${base}/checkpoints/${c.step}/download`, download: `${shortId(run.id)}-step-${c.step}.tar`,
          "data-testid": "checkpoint-download", onclick: downloadWithKey }, "download")))))));
  }

  let samples = [];
  let sampleStep = null;
  async function loadSamples() {
    const all = [];
    let after = null;
    for (let i = 0; i < 10; i++) { // at most 5000 samples
      const page = await api(`${base}/samples${qs({ limit: 500, after })}`);
      all.push(...page.data);
      if (!page.has_more) break;
      after = page.next_cursor;
    }
    samples = all;
    renderSamples();
  }
  function renderSamples() {
    samplesCard.hidden = !samples.length;
    if (!samples.length) return;
    const steps = [...new Set(samples.map((x) => x.step))].sort((a, b) => a - b);
    if (sampleStep === null || !steps.includes(sampleStep)) sampleStep = steps[steps.length - 1];
    const sel = h("select", { "data-testid": "sample-step", onchange: (e) => { sampleStep = Number(e.target.value); renderSamples(); } },
      steps.map((st) => h("option", { value: st }, `step ${st}`)));
    sel.value = String(sampleStep);
    const rows = samples.filter((x) => x.step === sampleStep).sort((a, b) => b.reward - a.reward);
    const mean = rows.reduce((a, x) => a + x.reward, 0) / rows.length;
    fill(samplesBox, h("div", { class: "toolbar" }, sel,
      h("span", { class: "muted" }, `${rows.length} completions, mean reward ${fmtNum(mean)}; best first`)),
    h("div", { class: "scroll tall" }, h("table", { class: "table compact samples" },
      h("thead", {}, h("tr", {}, ["Reward", "Prompt", "Completion", "Details"].map((t) => h("th", {}, t)))),
      h("tbody", {}, rows.map((x) => h("tr", { "data-testid": "sample-row" },
        h("td", { class: "num" }, h("b", {}, fmtNum(x.reward))),
        h("td", {}, h("div", { class: "text" }, visible(x.prompt))),
        h("td", {}, h("div", { class: "text" }, visible(x.completion))),
        h("td", { class: "small muted" }, sampleDetails(x.data))))))));
  }

  renderHeader();
  const results = await Promise.allSettled([loadMetrics(), loadEvents(), loadCheckpoints(), loadSamples(), loadPipeline()]);
  if (!ctx.alive) return;
  results.filter((r) => r.status === "rejected").slice(0, 1).forEach((r) => showError(r.reason));

  if (!FINISHED.has(run.status)) startLive();

  function startLive() {
    const es = new FetchEventSource(`${base}/stream`);
    ctx.cleanups.push(() => es.close());
    let ckptTimer = null;
    let runTimer = null;
    // The stream tells neither when a long phase ends nor a warning's message: read the run again after a burst.
    const refreshSoon = () => { clearTimeout(runTimer); runTimer = setTimeout(() => ctx.alive && refreshRun(), 300); };
    ctx.cleanups.push(() => clearTimeout(runTimer));
    const setLive = (state) => { if (liveState !== state) { liveState = state; renderHeader(); } };
    es.onopen = () => setLive("live");
    es.onerror = () => { if (ctx.alive && liveState) setLive(es.readyState === FetchEventSource.CLOSED ? "" : "reconnecting"); };
    es.addEventListener("metrics", (msg) => {
      let maxStep = run.progress.step;
      for (const p of JSON.parse(msg.data)) {
        if (p.step <= (loadedUpTo.get(p.key) ?? -1)) continue; // already in the downsampled load
        addPoint(p.key, p.step, p.value);
        if (!p.key.startsWith("final/")) maxStep = Math.max(maxStep, p.step);
      }
      dirty = true;
      if (maxStep !== run.progress.step) {
        const total = run.progress.total_steps;
        run.progress.step = total ? Math.min(maxStep, total) : maxStep;
        updateProgress();
        if (run.progress.phase) refreshSoon(); // a step was taken: the phase shown has probably ended
      }
    });
    es.addEventListener("event", (msg) => {
      const e = JSON.parse(msg.data);
      // The stream starts with the run's past events: only those the page had not loaded tell of now.
      if (!addEvent(e)) return;
      if (e.kind === "progress" && e.data) {
        const { phase = null, done = null, total = null } = e.data;
        run.progress = { ...run.progress, phase, done, total };
        updateProgress();
      }
      if (e.kind === "warning") refreshSoon();
      if (e.kind === "checkpoint") {
        clearTimeout(ckptTimer);
        ckptTimer = setTimeout(() => ctx.alive && loadCheckpoints().catch(() => {}), 300);
      }
    });
    es.addEventListener("status", (msg) => {
      const st = JSON.parse(msg.data);
      Object.assign(run, { status: st.status, error: st.error });
      // the status message has no phase fields: keep the phase, which only a running run is in
      const phase = st.status === "running" ? {} : { phase: null, done: null, total: null };
      run.progress = { ...run.progress, step: Math.max(run.progress.step, st.step), total_steps: st.total_steps, ...phase };
      renderHeader();
      if (FINISHED.has(st.status)) refreshRun();
    });
    es.addEventListener("end", () => {
      es.close();
      liveState = "";
      refreshRun();
    });
  }

  function progressParts() {
    const pct = progressPct(run.progress);
    return [progressView(run.progress), h("span", { class: "muted small" }, pct === null ? "" : `${pct.toFixed(0)}%`)];
  }

  function updateProgress() {
    const box = header.querySelector("#run-progress");
    if (box) fill(box, progressParts());
  }

  async function refreshRun() {
    try {
      const fresh = await api(base);
      if (!ctx.alive) return;
      fresh.progress.step = Math.max(fresh.progress.step, FINISHED.has(fresh.status) ? 0 : run.progress.step);
      run = fresh;
      if (FINISHED.has(run.status)) {
        liveState = "";
        await Promise.allSettled([loadCheckpoints(), loadSamples()]);
      }
      if (ctx.alive) renderHeader();
    } catch (err) { showError(err); }
  }

  every(ctx, 500, () => { if (dirty) drawCharts(); });
  every(ctx, 5000, () => { if (!FINISHED.has(run.status)) refreshRun(); });
  every(ctx, 15000, () => { if (!FINISHED.has(run.status) && run.status === "running") loadSamples().catch(() => {}); });
}

/** A model reference; `run:<id>` and `run:<id>@<step>` link to that run. */
function modelRef(model) {
  const m = /^run:([0-9a-f-]{36})(@\d+)?$/.exec(model || "");
  if (!m) return h("span", { class: "mono" }, model);
  return h("span", { class: "mono" }, "run:", h("a", { href: `#/runs/${m[1]}`, title: m[1] }, shortId(m[1])), m[2] || "");
}

function sampleDetails(data) {
  if (!data) return "";
  const parts = [];
  if (data.components) for (const [k, v] of Object.entries(data.components)) parts.push(`${k} ${fmtNum(v)}`);
  for (const [k, v] of Object.entries(data)) if (k !== "components") parts.push(`${k}: ${typeof v === "object" ? JSON.stringify(v) : v}`);
  return parts.join(" · ");
}

/* ---------- compare ---------- */

async function comparePage(ctx, main, params) {
  document.title = "Compare · rlrun";
  const ids = [...new Set((params.get("runs") || "").split(",").map((x) => x.trim()).filter(Boolean))];
  let key = params.get("key") || "";
  const idsInput = h("input", { type: "text", id: "compare-runs", "data-testid": "compare-runs", class: "wide mono",
    placeholder: "run ids, comma-separated", value: ids.join(", ") });
  const keySel = h("select", { id: "compare-key", "data-testid": "compare-key" });
  const go = (k) => {
    const list = idsInput.value.split(/[\s,]+/).filter(Boolean);
    location.hash = `#/compare${qs({ runs: list.join(","), key: k })}`;
  };
  const picker = h("details", { class: "picker" }, h("summary", {}, "Pick from recent runs"));
  main.append(h("div", { class: "page-head" }, h("h1", {}, "Compare runs")),
    h("div", { class: "toolbar" }, h("label", {}, "Runs ", idsInput), h("label", {}, "Metric ", keySel),
      h("button", { class: "primary", "data-testid": "compare-apply", onclick: () => go(keySel.value || key) }, "Show")),
    picker);
  keySel.addEventListener("change", () => go(keySel.value));
  idsInput.addEventListener("keydown", (e) => { if (e.key === "Enter") go(keySel.value || key); });

  api(`/v1/runs${qs({ limit: 50 })}`).then((page) => {
    if (!ctx.alive) return;
    picker.append(h("div", { class: "pick-list" }, page.data.map((r) => h("label", { class: "pick" },
      h("input", { type: "checkbox", checked: ids.includes(r.id), onchange: (e) => {
        const list = idsInput.value.split(/[\s,]+/).filter(Boolean).filter((x) => x !== r.id);
        if (e.target.checked) list.push(r.id);
        idsInput.value = list.join(", ");
      } }), ` ${runLabel(r)} `, h("span", { class: "muted small" }, `${r.algorithm} · ${r.status} · ${shortId(r.id)}`)))));
    if (!ids.length) picker.open = true;
  }).catch(() => {});

  if (!ids.length) {
    keySel.append(h("option", { value: "" }, "—"));
    main.append(h("p", { class: "empty" }, "Choose runs: tick them on the runs page, pick them above, or paste run ids."));
    return;
  }
  let runs = await Promise.all(ids.map((id) => api(`/v1/runs/${enc(id)}`).catch((err) => ({ id, missing: err }))));
  if (!ctx.alive) return;
  const missing = runs.filter((r) => r.missing);
  runs = runs.filter((r) => !r.missing);
  if (missing.length) showError(new Error(`not found: ${missing.map((r) => r.id).join(", ")}`));
  const keyLists = await Promise.all(runs.map((r) => api(`/v1/runs/${r.id}/metric-keys`).catch(() => [])));
  if (!ctx.alive) return;
  const counts = new Map();
  keyLists.flat().forEach((k) => counts.set(k, (counts.get(k) || 0) + 1));
  const common = [...counts.keys()].filter((k) => counts.get(k) === runs.length).sort();
  const partial = [...counts.keys()].filter((k) => counts.get(k) < runs.length).sort();
  if (!key) key = ["reward/mean", "eval/accuracy", "loss"].find((k) => common.includes(k)) || common[0] || partial[0] || "";
  keySel.append(...common.map((k) => h("option", { value: k }, k)),
    partial.length ? h("optgroup", { label: "not logged by every run" }, partial.map((k) => h("option", { value: k }, k))) : null);
  if (key && !counts.has(key)) keySel.append(h("option", { value: key }, `${key} (no run has it)`));
  keySel.value = key;

  const chart = new Chart({ testid: "compare-chart", title: key || "no metric", height: 320 });
  const summary = h("tbody");
  main.append(card(null, chart.el), card("Runs", h("table", { class: "table compact", "data-testid": "compare-table" },
    h("thead", {}, h("tr", {}, ["", "Run", "Status", "Algorithm", "Model", "Learning rate", "Progress", "Last", "Min", "Max"]
      .map((t) => h("th", {}, t)))), summary)));

  async function load() {
    const pages = await Promise.all(runs.map((r) => (key
      ? api(`/v1/runs/${r.id}/metrics${qs({ key, max_points: CHART_POINTS })}`) : Promise.resolve({ data: [] }))));
    if (!ctx.alive) return;
    const data = runs.map((r, i) => ({
      id: r.id, label: `${runLabel(r)} (${r.algorithm})`, title: r.id, href: `#/runs/${r.id}`,
      color: COLORS[i % COLORS.length], points: pages[i].data.map((p) => [p.step, p.value]),
    }));
    chart.set(data);
    fill(summary, ...data.map((d, i) => {
      const r = runs[i];
      const vals = d.points.map((p) => p[1]);
      const hp = (r.spec && r.spec.hyperparameters) || {};
      return h("tr", { "data-run-id": r.id }, h("td", {}, h("i", { class: "swatch", style: `background:${d.color}` })),
        h("td", {}, h("a", { href: d.href }, runLabel(r))),
        h("td", { class: "nowrap" }, badge(r.status), " ", warningBadge(r.warnings)), h("td", {}, r.algorithm),
        h("td", { class: "mono small" }, r.spec.model), h("td", { class: "num" }, fmtNum(hp.learning_rate)),
        h("td", { class: "num", "data-testid": "compare-progress" }, progressText(r.progress)),
        h("td", { class: "num" }, vals.length ? fmtNum(vals[vals.length - 1]) : "–"),
        h("td", { class: "num" }, vals.length ? fmtNum(Math.min(...vals)) : "–"),
        h("td", { class: "num" }, vals.length ? fmtNum(Math.max(...vals)) : "–"));
    }));
  }
  await load();
  every(ctx, 5000, async () => {
    if (runs.every((r) => FINISHED.has(r.status))) return;
    try {
      runs = await Promise.all(runs.map((r) => api(`/v1/runs/${r.id}`).catch(() => r)));
      await load();
    } catch (err) { showError(err); }
  });
}

/* ---------- datasets ---------- */

async function datasetsPage(ctx, main, datasetId) {
  document.title = "Datasets · rlrun";
  const page = await api(`/v1/datasets${qs({ limit: 200 })}`);
  if (!ctx.alive) return;
  const lengths = (st) => Object.entries(st.lengths || {}).map(([k, v]) => `${k} ${fmtNum(v.mean)}/${v.max}`).join(" · ");
  const flags = (st) => Object.entries(st.flags || {}).filter(([, v]) => v).map(([k, v]) => `${k.replace(/_/g, " ")} ${v}`).join(" · ");
  const datasetRow = (d) => h("tr", {
    class: `clickable${d.id === datasetId ? " selected" : ""}`, "data-testid": "dataset-row", "data-dataset-id": d.id,
    onclick: (e) => { if (!e.target.closest("a")) location.hash = `#/datasets/${d.id}`; },
  },
  h("td", {}, h("a", { href: `#/datasets/${d.id}` }, d.name), h("span", { class: "muted mono small" }, ` ${shortId(d.id)}`)),
  h("td", {}, h("span", { class: "tag" }, d.kind)),
  h("td", { class: "num" }, d.row_count),
  h("td", { class: "num" }, fmtBytes(d.size_bytes)),
  h("td", { class: "num" }, d.stats.exact_duplicates),
  h("td", { class: "small" }, flags(d.stats) || "–"),
  h("td", { class: "small" }, lengths(d.stats)),
  h("td", { class: "small" }, Object.entries(d.stats.source_formats || {}).map(([k, v]) => `${k} ${v}`).join(" · ")),
  h("td", { title: fmtTime(d.created_at) }, fmtAge(d.created_at)));
  const headings = ["Name", "Kind", "Rows", "Size", "Duplicates", "Flags", "Mean/max length (chars)", "Formats", "Created"];
  const body = page.data.length ? page.data.map(datasetRow)
    : h("tr", {}, h("td", { colspan: 9, class: "empty" }, "No datasets yet: upload one with POST /v1/datasets."));
  main.append(h("div", { class: "page-head" }, h("h1", {}, "Datasets"), h("span", { class: "muted" }, `${page.data.length} shown`)),
    h("div", { class: "card flush" }, h("table", { class: "table", "data-testid": "datasets-table" },
      h("thead", {}, h("tr", {}, headings.map((t) => h("th", {}, t)))), h("tbody", {}, body))));
  if (!datasetId) return;

  const ds = page.data.find((d) => d.id === datasetId) || await api(`/v1/datasets/${enc(datasetId)}`);
  const rows = await api(`/v1/datasets/${enc(datasetId)}/rows${qs({ limit: 20 })}`);
  if (!ctx.alive) return;
  const cols = [];
  for (const r of rows.data) for (const k of Object.keys(r.data)) if (!cols.includes(k)) cols.push(k);
  main.append(h("section", { class: "card", "data-testid": "dataset-preview", id: "dataset-preview" },
    h("h2", {}, `${ds.name} `, h("span", { class: "tag" }, ds.kind), h("span", { class: "muted mono small" }, ` ${ds.id}`)),
    h("p", { class: "muted" }, `${ds.row_count} rows, ${fmtBytes(ds.size_bytes)}; first ${rows.data.length} shown.`),
    h("div", { class: "scroll tall" }, h("table", { class: "table compact rows" },
      h("thead", {}, h("tr", {}, h("th", {}, "#"), cols.map((c) => h("th", {}, c)))),
      h("tbody", {}, rows.data.map((r) => h("tr", { "data-testid": "dataset-preview-row" }, h("td", { class: "num idx" }, r.index),
        cols.map((c) => h("td", {}, c in r.data ? h("div", { class: "text" }, textValue(r.data[c])) : ""))))))),
    h("details", {}, h("summary", {}, "Upload stats"), h("pre", { class: "json" }, JSON.stringify(ds.stats, null, 2)))));
  document.getElementById("dataset-preview").scrollIntoView({ block: "nearest" });
}
