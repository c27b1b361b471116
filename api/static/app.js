"use strict";
/* rlrun dashboard: a dependency-free single-page app over the /v1 API (no build step).
   Routes: #/runs?q=&status=&flagged=&algorithm=&sort=&tag=, #/runs/<id>, #/compare?runs=<id>,<id>&keys=<metric>,<metric>,
   #/datasets, #/datasets/<id>.
   With RLRUN_AUTH=on a 401 brings up the API key form (index.html); the key is kept in sessionStorage
   and sent as `Authorization: Bearer` on every call, the live stream included (class FetchEventSource).
   Charts are uPlot (vendored in static/vendor/uplot; class Chart). Test hooks: data-testid on pages and
   tables, on each chart's plot ("chart-<first key>", "compare-chart-<key>") and its controls; each series has a
   legend item [data-series=... data-points=N]; the chart's <figure data-chart> holds the Chart as ._chart. */

const FINISHED = new Set(["succeeded", "failed", "cancelled"]);
const STATUSES = ["queued", "running", "succeeded", "failed", "cancelled"];
const ALGORITHMS = ["sft", "reward_model", "dpo", "grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce",
  "reinforce_pp", "reinforce_baseline", "remax", "ppo", "vc_ppo", "eval", "merge", "training_session"];
// the runs table's key metric for an algorithm: the one chosen for it (localStorage KEY_METRIC_ITEM +
// algorithm), else the first of these its runs logged
const KEY_METRICS = ["eval/pass@1", "reward/mean", "loss"];
const KEY_METRIC_ITEM = "rlrun.keyMetric.";
// Columns the runs table sorts by (server-side, GET /v1/runs?sort=): header text -> sort field.
const SORTABLE = { Run: "name", Status: "status", Algorithm: "algorithm", Created: "created_at" };
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
  const codes = [...new Set(warnings.map((w) => w.code))];
  return h("span", { class: "badge warn-badge", "data-testid": "warning-badge", role: "img", "aria-label": label,
    title: label }, `⚠ ${codes.join(", ")}`);
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

/* ---------- charts (uPlot 1.6.32, vendored in static/vendor/uplot and loaded by index.html) ---------- */

let currentPage = null; // { alive, cleanups, charts }
let chartPages = 0; // numbers each page's cursor-sync group

// Paul Tol's "bright" scheme: told apart under the common colour-vision deficiencies, legible on light and
// dark. Each series of a chart also gets its own dash pattern, so that no two differ by colour alone
// (reward min and max are red and green here, and solid and dashed).
const COLORS = ["#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377", "#bbbbbb"];
const DASHES = [[], [7, 4], [2, 3], [9, 3, 2, 3], [14, 4], [4, 2, 1, 2, 1, 2], [1, 5]];
const ZOOM_POINTS_MAX = 2000; // max_points of a zoomed range (about the chart's width in pixels)
const ZOOM_SPAN_MIN = 1e-4; // a pinch zooms x in to at most this fraction of the whole range
const TABLE_ROWS = 200; // a chart's table view shows the last this many steps
const STEP_INCRS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1e3, 2e3, 2500, 5e3, 1e4, 2e4, 25e3, 5e4,
  1e5, 2e5, 25e4, 5e5, 1e6];

function seriesStyle(i) {
  return { color: COLORS[i % COLORS.length], dash: DASHES[i % DASHES.length] };
}

/** The chart settings shared by every chart of a page (its toolbar: chartControls). */
function chartView() {
  return { x: "step", smoothing: 0, log: false, zero: false, sync: `rlrun-page-${++chartPages}` };
}

/** A metric series as columns in step order (a resumed attempt may rewrite a step): `time` is seconds
    since the epoch (null where not known), non-finite values are null. */
class Cols {
  constructor(step = [], value = [], time = null) {
    this.step = step;
    this.value = value.map((v) => (Number.isFinite(v) ? v : null));
    this.time = time || step.map(() => null);
  }
  add(step, value, time = null) {
    const v = Number.isFinite(value) ? value : null;
    const st = this.step;
    const n = st.length;
    if (!n || step > st[n - 1]) { st.push(step); this.value.push(v); this.time.push(time); return; }
    let lo = 0, hi = n;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (st[mid] < step) lo = mid + 1; else hi = mid; }
    if (st[lo] === step) { this.value[lo] = v; this.time[lo] = time ?? this.time[lo]; return; }
    st.splice(lo, 0, step); this.value.splice(lo, 0, v); this.time.splice(lo, 0, time);
  }
  get last() {
    for (let i = this.value.length - 1; i >= 0; i--) if (this.value[i] !== null) return this.value[i];
    return null;
  }
}
const NO_COLS = new Cols();

/** A run's metric series, chart-sized: Map(key -> Cols), from GET .../metrics?format=columns, which answers
    {key: {step: [...], value: [...], time: [...] (with time=true)}}: each key at most maxPoints points, first
    and last kept, min-max downsampled, non-finite values as null. */
async function fetchColumns(runId, { keys = null, maxPoints = CHART_POINTS, minStep = null, maxStep = null,
  time = false } = {}) {
  const body = await api(`/v1/runs/${enc(runId)}/metrics${qs({ format: "columns", max_points: maxPoints,
    key: keys, min_step: minStep, max_step: maxStep, time: time ? "true" : null })}`);
  return new Map(Object.entries(body).map(([k, c]) => [k, new Cols(c.step, c.value, c.time)]));
}

/** TensorBoard's smoothing: an exponential moving average over the points in step order, debiased (divided
    by 1 - w^n after n points) so that the first points are not pulled towards 0. Nulls stay null. */
function smooth(values, w) {
  if (!w) return values.slice();
  const out = new Array(values.length);
  let acc = 0, n = 0;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (v === null) { out[i] = null; continue; }
    acc = acc * w + (1 - w) * v;
    n += 1;
    out[i] = acc / (1 - w ** n);
  }
  return out;
}

function fmtTick(v) {
  if (v === null || v === undefined) return "";
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 1e6 || a < 1e-3) return v.toExponential(1).replace("e+", "e");
  return String(Number(v.toPrecision(6)));
}
function fmtWall(sec) { return sec === null || sec === undefined ? "–" : new Date(sec * 1000).toLocaleString(); }

/** Page-level chart settings: x axis (step or wall time), smoothing, log y, y from zero. `onChange(what)`. */
function chartControls(view, onChange) {
  const shown = h("output", { class: "mono", "data-testid": "chart-smoothing-value" }, view.smoothing.toFixed(2));
  const xSel = h("select", { "data-testid": "chart-x", "aria-label": "x axis", onchange: (e) => { view.x = e.target.value; onChange("x"); } },
    h("option", { value: "step" }, "step"), h("option", { value: "time" }, "wall time"));
  xSel.value = view.x;
  return h("div", { class: "toolbar chart-controls", role: "group", "aria-label": "chart settings" },
    h("label", {}, "x axis ", xSel),
    h("label", { title: "exponential moving average over the points in step order (debiased, as TensorBoard)" },
      "smoothing ", h("input", { type: "range", min: 0, max: 0.99, step: 0.01, value: view.smoothing,
        "data-testid": "chart-smoothing", "aria-label": "smoothing", oninput: (e) => {
          view.smoothing = Number(e.target.value);
          shown.textContent = view.smoothing.toFixed(2);
          onChange("smoothing");
        } }), " ", shown),
    h("label", {}, h("input", { type: "checkbox", "data-testid": "chart-log", checked: view.log,
      onchange: (e) => { view.log = e.target.checked; onChange("log"); } }), " log y"),
    h("label", {}, h("input", { type: "checkbox", "data-testid": "chart-zero", checked: view.zero,
      onchange: (e) => { view.zero = e.target.checked; onChange("zero"); } }), " y from 0"),
    h("span", { class: "muted small hint", "data-testid": "chart-hint" }, "drag across a chart to zoom, double-click "
      + "to reset; on a touch screen pinch to zoom, drag sideways to pan, double-tap to reset"));
}

/** One line chart on uPlot. Each series is drawn twice: its raw values faint, and smoothed on top (with
    smoothing 0 only the raw line, at full strength). Test hooks: the plot has data-testid=<testid>, the
    figure data-chart=<testid> (and data-zoom / data-fetched while zoomed), each legend item
    data-series=<id> data-points=<points loaded>; figure._chart is this object (figure._chart.u the uPlot).
    `fetchRange(ids, minStep, maxStep, maxPoints)` -> Map(id -> Cols): a zoomed range at full resolution.
    Zoom: a mouse drags across the plot (uPlot's select); on a touch screen two fingers pinch and one finger
    pans a zoomed chart (onPointer). Either way zoomTo() sets the range and fetches it. */
class Chart {
  constructor({ testid, title, yLabel = title, view, height = 220, fetchRange = null }) {
    Object.assign(this, { testid, title, yLabel, view, height, fetchRange });
    this.defs = [];
    this.full = new Map(); // id -> Cols: the whole run (what the page holds)
    this.zoom = null; // {min, max, data: Map | null} in x units
    this.fingers = new Map(); // pointerId -> clientX of each finger on the plot (touch screens)
    this.touch = null; // {xs, min, max, lo, hi}: fingers' clientX and x range when a finger last came or went
    this.moved = null; // {min, max}: the x range the fingers have moved to, shown live; zoomTo() when they lift
    this.u = null;
    this.shape = "";
    this.frame = 0;
    this.kb = null; // {idx, left}: where the arrow keys last put the cursor
    this.resetBtn = h("button", { type: "button", class: "chart-reset", hidden: true, "data-testid": "reset-zoom",
      "aria-label": `reset zoom of ${title}`, onclick: () => this.resetZoom() }, "reset zoom");
    this.plot = h("div", { class: "chart-plot", tabindex: 0, role: "group", "data-testid": testid,
      "aria-label": `${title} chart: drag to zoom, double-click to reset (on a touch screen: pinch to zoom, drag `
        + "sideways to pan, double-tap to reset); Left and Right arrow keys move the cursor point by point, Home "
        + "and End jump to the ends, Escape hides it",
      onkeydown: (e) => this.onKey(e), onpointerdown: (e) => this.onPointer(e),
      onpointermove: (e) => this.onPointer(e), onpointerup: (e) => this.onPointer(e),
      onpointercancel: (e) => this.onPointer(e) });
    this.legend = h("div", { class: "legend" });
    this.note = h("p", { class: "chart-note muted small", "data-testid": "chart-note", hidden: true });
    this.said = h("div", { class: "sr-only", "aria-live": "polite", "data-testid": "chart-said" });
    this.tableBox = h("div", { class: "chart-table-box" });
    this.table = h("details", { class: "chart-table", "data-testid": "chart-table", ontoggle: () => this.renderTable() },
      h("summary", {}, "table of points"), this.tableBox);
    this.el = h("figure", { class: "chart", "data-chart": testid },
      h("figcaption", {}, h("span", { class: "chart-title" }, title), this.resetBtn),
      this.plot, this.legend, this.note, this.table, this.said);
    this.el._chart = this;
    this.seenWidth = -1;
    this.ro = new ResizeObserver((entries) => { // only a new width matters (the height is the chart's own)
      const w = Math.floor(entries[entries.length - 1].contentRect.width);
      if (w !== this.seenWidth) { this.seenWidth = w; this.schedule(); }
    });
    this.ro.observe(this.plot);
    if (currentPage) currentPage.charts.add(this);
  }

  /** defs: [{id, label, color, dash, href, title}]. */
  setSeries(defs) {
    this.defs = defs;
    this.legendVals = [];
    fill(this.legend, h("span", { class: "legend-x muted" }),
      defs.map((d) => {
        const val = h("b", {});
        this.legendVals.push(val);
        return h("span", { class: "legend-item", "data-series": d.id, title: d.title || d.label },
          swatch(d), d.href ? h("a", { href: d.href }, d.label) : h("span", {}, d.label), val);
      }));
    this.legendX = this.legend.firstChild;
    this.schedule();
  }

  /** The whole-run series, Map(id -> Cols); Cols the page appends to later need only schedule(). */
  setData(full) {
    this.full = full;
    this.schedule();
  }

  current() { return (this.zoom && this.zoom.data) || this.full; }

  /** The x range to show: where the fingers have moved it, else the zoom's, else null (the whole run). */
  shown() { return this.moved || this.zoom; }

  /** Redraw at the next frame (data appended, settings or size changed); several calls, one redraw. */
  schedule() {
    if (!this.frame) this.frame = requestAnimationFrame(() => this.draw());
  }

  destroy() {
    cancelAnimationFrame(this.frame);
    this.ro.disconnect();
    if (this.u) this.u.destroy();
    this.u = null;
  }

  /** uPlot's data: [x, raw 1, smoothed 1, raw 2, smoothed 2, ...] joined on x (null where a series has no
      point there). In log view the values <= 0 become null and are counted in this.dropped. */
  aligned() {
    const data = this.current();
    const xKey = this.view.x === "time" ? "time" : "step";
    const cols = this.defs.map((d) => data.get(d.id) || NO_COLS);
    const seen = new Set();
    for (const c of cols) for (const x of c[xKey]) if (x !== null) seen.add(x);
    const xs = [...seen].sort((a, b) => a - b);
    const at = new Map(xs.map((x, i) => [x, i]));
    const out = [xs];
    for (const c of cols) {
      const sm = smooth(c.value, this.view.smoothing);
      const raw = new Array(xs.length).fill(null), sy = new Array(xs.length).fill(null);
      c[xKey].forEach((x, i) => { if (x !== null) { const j = at.get(x); raw[j] = c.value[i]; sy[j] = sm[i]; } });
      out.push(raw, sy);
    }
    this.dropped = 0;
    this.logOn = this.view.log && out.slice(1).some((ys) => ys.some((v) => v !== null && v > 0));
    if (this.logOn) {
      for (let k = 1; k < out.length; k++) {
        out[k] = out[k].map((v) => {
          if (v !== null && v <= 0) { if (k % 2) this.dropped += 1; return null; }
          return v;
        });
      }
    }
    return out;
  }

  draw() {
    this.frame = 0;
    const data = this.aligned();
    const loaded = this.current();
    this.defs.forEach((d, i) => {
      const item = this.legend.children[i + 1];
      if (item) item.dataset.points = String((loaded.get(d.id) || NO_COLS).step.length);
    });
    const notes = [];
    if (this.view.log && !this.logOn) notes.push("log scale: no positive values, shown linear");
    else if (this.dropped) notes.push(`log scale: ${this.dropped} value${this.dropped === 1 ? "" : "s"} ≤ 0 not shown`);
    if (this.view.x === "time" && data[0].length === 0 && this.defs.some((d) => (loaded.get(d.id) || NO_COLS).step.length)) {
      notes.push("no wall times for these points");
    }
    this.note.textContent = notes.join("; ");
    this.note.hidden = !notes.length;
    if (this.table.open) this.renderTable();

    const width = Math.floor(this.plot.clientWidth);
    if (width < 60) return; // in a closed section (or not laid out yet): drawn when it opens
    // by the window's width, not the chart's: a chart's height must not depend on its width (a scrollbar
    // coming and going would resize it for ever)
    const height = window.innerWidth < 600 ? Math.min(this.height, 200) : this.height;
    const shape = JSON.stringify([this.view.x, this.logOn, this.view.zero, this.view.smoothing > 0,
      this.defs.map((d) => [d.id, d.color])]);
    if (!this.u || shape !== this.shape) {
      this.build(width, height, data);
      this.shape = shape;
    } else {
      const u = this.u;
      if (u.width !== width || u.height !== height) u.setSize({ width, height });
      // A hover stays on its point: the x range may grow with new points, so the cursor is put back on
      // that x once uPlot has redrawn with the new scales (its "draw" hook: uPlot commits asynchronously).
      if (u.cursor.left >= 0 && u.cursor.idx !== null && u.cursor.idx !== undefined) {
        this.hold = { x: u.data[0][u.cursor.idx], kb: Boolean(this.kb && this.kb.left === u.cursor.left) };
      }
      const range = this.shown();
      u.setData(data, !range);
      if (range) u.setScale("x", { min: range.min, max: range.max });
    }
    if (this.u.cursor.idx === null || this.u.cursor.idx === undefined) this.showValues(null);
  }

  build(width, height, data) {
    if (this.u) this.u.destroy();
    this.kb = null;
    const css = getComputedStyle(document.documentElement);
    const ink = css.getPropertyValue("--muted").trim() || "#6b7280";
    const grid = { stroke: css.getPropertyValue("--grid").trim() || "#eceef1", width: 1 };
    const time = this.view.x === "time";
    const smoothed = this.view.smoothing > 0;
    const series = [{ label: time ? "wall time" : "step" }];
    for (const d of this.defs) {
      series.push({ label: `${d.label} (raw)`, stroke: smoothed ? `${d.color}55` : d.color, width: smoothed ? 1 : 1.75,
        dash: d.dash, spanGaps: true, ...(smoothed ? { points: { show: false } } : {}) });
      series.push({ label: d.label, stroke: d.color, width: 1.75, dash: d.dash, spanGaps: true, show: smoothed });
    }
    const font = "11px system-ui, sans-serif";
    const ySize = (u, values) => (values ? Math.max(...values.map((v) => String(v).length)) * 7 + 14 : 40);
    const zero = this.view.zero;
    this.u = new uPlot({
      width, height, series, legend: { show: false },
      scales: {
        x: { time },
        y: this.logOn ? { distr: 3, log: 10 }
          : { range: (u, min, max) => (min === null || max === null ? [0, 1]
            : uPlot.rangeNum(zero ? Math.min(0, min) : min, zero ? Math.max(0, max) : max, 0.1, true)) },
      },
      axes: [
        { label: time ? "wall time" : "step", stroke: ink, grid, ticks: grid, font, labelFont: font, labelSize: 16,
          ...(time ? {} : { incrs: STEP_INCRS, values: (u, splits) => splits.map(fmtTick) }) },
        { label: this.yLabel, stroke: ink, grid, ticks: grid, font, labelFont: font, labelSize: 16, size: ySize,
          values: (u, splits) => splits.map(fmtTick) },
      ],
      cursor: {
        // hover follows on every chart of the page; drag-zoom and double-click stay on this chart
        sync: { key: this.view.sync, filters: { pub: (type) => type === "mousemove" } },
        drag: { x: true, y: false, setScale: false },
        bind: { dblclick: () => (e) => { if (e.button === 0) this.resetZoom(); return null; } },
        points: { size: 7 },
      },
      hooks: {
        setSelect: [(u) => this.onSelect(u)],
        setCursor: [(u) => this.showValues(u.cursor.idx)],
        draw: [(u) => this.afterDraw(u)],
      },
    }, data, this.plot);
    const range = this.shown();
    if (range) this.u.setScale("x", { min: range.min, max: range.max });
  }

  afterDraw(u) {
    const hold = this.hold;
    this.hold = null;
    if (!hold || u.cursor.left < 0) return;
    u.setCursor({ left: u.valToPos(hold.x, "x"), top: u.cursor.top });
    if (hold.kb) this.kb = { idx: u.cursor.idx, left: u.cursor.left };
  }

  onSelect(u) {
    const { left, width } = u.select;
    if (width < 4) return;
    const min = u.posToVal(left, "x"), max = u.posToVal(left + width, "x");
    u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
    this.zoomTo(min, max);
  }

  /** Touch (Pointer Events from fingers; a mouse or pen is left to uPlot). Two fingers pinch: the x under each
      stays under it, so x zooms around their centre and follows it. One finger drags a zoomed chart sideways
      (a vertical swipe is the browser's: it scrolls the page and cancels the pointer). The scale follows the
      fingers, clamped to the run's x extent; once they lift, zoomTo() commits the range and fetches it at full
      resolution (or resetZoom(), when pinched back out to the whole run). A double tap arrives as dblclick. */
  onPointer(e) {
    if (e.pointerType !== "touch" || !this.u) return;
    const fingers = this.fingers;
    if (e.type === "pointermove") {
      if (!fingers.has(e.pointerId)) return;
      fingers.set(e.pointerId, e.clientX);
      this.follow();
      return;
    }
    if (e.type === "pointerdown") fingers.set(e.pointerId, e.clientX);
    else if (!fingers.delete(e.pointerId)) return;
    if (fingers.size) this.holdFingers();
    else this.lift();
  }

  /** Fingers came or went: the x range and where the fingers are now are what later moves are measured from. */
  holdFingers() {
    const scale = this.u.scales.x;
    const [lo, hi] = this.extent();
    this.touch = { xs: [...this.fingers.values()].slice(0, 2), min: scale.min, max: scale.max, lo, hi };
  }

  /** Fingers moved: the x range they ask for, shown at once (this.moved). */
  follow() {
    const t = this.touch, u = this.u;
    const xs = [...this.fingers.values()].slice(0, 2);
    if (!t || xs.length !== t.xs.length || !(t.hi > t.lo)) return;
    const whole = t.hi - t.lo, span = t.max - t.min;
    if (xs.length === 1 && span >= whole) return; // the whole run is shown: nothing to pan to
    const left = u.over.getBoundingClientRect().left, width = u.over.clientWidth || 1;
    const mid = (ys) => (ys.length > 1 ? (ys[0] + ys[1]) / 2 : ys[0]) - left; // px from the plot's left
    const apart = (ys) => Math.max(1, Math.abs(ys[0] - ys[1]));
    const at = t.min + (mid(t.xs) / width) * span; // the x that was under the fingers' centre
    const want = xs.length > 1 ? (span * apart(t.xs)) / apart(xs) : span;
    const newSpan = Math.min(whole, Math.max(whole * ZOOM_SPAN_MIN, want));
    const min = Math.min(Math.max(at - (mid(xs) / width) * newSpan, t.lo), t.hi - newSpan);
    const max = min + newSpan;
    if (min === u.scales.x.min && max === u.scales.x.max) return;
    if (this.zoom && this.zoom.data && (min < this.zoom.min || max > this.zoom.max)) {
      // past the range fetched at full resolution: the whole run's points, until the fingers lift
      this.zoom = { ...this.zoom, data: null };
      u.setData(this.aligned(), false);
    }
    this.moved = { min, max };
    u.setScale("x", { min, max });
  }

  /** The last finger lifted: commit the range the fingers moved to (pinched out to the whole run: reset). */
  lift() {
    const moved = this.moved, t = this.touch;
    this.moved = null;
    this.touch = null;
    if (!moved) return;
    if (moved.max - moved.min >= t.hi - t.lo) this.resetZoom();
    else this.zoomTo(moved.min, moved.max);
  }

  /** The x extent of the whole run's points: [lo, hi] (lo > hi when there are none). */
  extent() {
    const key = this.view.x === "time" ? "time" : "step";
    let lo = Infinity, hi = -Infinity;
    for (const d of this.defs) {
      for (const x of (this.full.get(d.id) || NO_COLS)[key]) {
        if (x !== null) { lo = Math.min(lo, x); hi = Math.max(hi, x); }
      }
    }
    return [lo, hi];
  }

  /** Zoom x to [min, max] (x units), then fetch that range of every series at full resolution. */
  async zoomTo(min, max) {
    const zoom = { min, max, data: null };
    this.zoom = zoom;
    this.resetBtn.hidden = false;
    this.el.dataset.zoom = `${min},${max}`;
    delete this.el.dataset.fetched;
    if (this.u) this.u.setScale("x", { min, max });
    if (!this.fetchRange) return;
    const [s0, s1] = this.stepsIn(min, max);
    const n = Math.max(50, Math.min(ZOOM_POINTS_MAX, Math.round(this.plot.clientWidth)));
    try {
      const data = await this.fetchRange(this.defs.map((d) => d.id), s0, s1, n);
      if (this.zoom !== zoom) return; // reset or zoomed again meanwhile
      zoom.data = data;
      this.el.dataset.fetched = `${s0},${s1},${n}`;
      this.schedule();
    } catch (err) { showError(err); }
  }

  /** The steps to fetch for an x range: in wall time, those of the points in it and one either side. */
  stepsIn(min, max) {
    if (this.view.x !== "time") return [Math.max(0, Math.floor(min)), Math.max(0, Math.ceil(max))];
    let lo = Infinity, hi = -Infinity;
    for (const c of this.full.values()) {
      const n = c.step.length;
      for (let i = 0; i < n; i++) {
        const t = c.time[i];
        if (t === null) continue;
        if (t >= min && t <= max) {
          lo = Math.min(lo, c.step[Math.max(0, i - 1)]);
          hi = Math.max(hi, c.step[Math.min(n - 1, i + 1)]);
        }
      }
    }
    return lo <= hi ? [lo, hi] : [0, 0];
  }

  resetZoom() {
    if (!this.zoom) return;
    this.zoom = null;
    this.resetBtn.hidden = true;
    delete this.el.dataset.zoom;
    delete this.el.dataset.fetched;
    if (this.u) this.u.setData(this.aligned(), true);
    this.schedule();
  }

  /** The legend: the x and the values under the cursor (the last values when it is away). */
  showValues(idx) {
    if (!this.legendVals) return;
    const u = this.u;
    const hovering = u && idx !== null && idx !== undefined && idx < u.data[0].length;
    const smoothed = this.view.smoothing > 0;
    const loaded = this.current();
    this.defs.forEach((d, i) => {
      let raw, sm;
      if (hovering) {
        const j = nearestValue(u.data[1 + 2 * i], idx);
        raw = j === null ? null : u.data[1 + 2 * i][j];
        sm = j === null ? null : u.data[2 + 2 * i][j];
      } else {
        const c = loaded.get(d.id) || NO_COLS;
        raw = c.last;
        const s = smooth(c.value, this.view.smoothing);
        sm = s.length ? s[s.length - 1] : null;
      }
      fill(this.legendVals[i], smoothed ? [fmtNum(sm), h("span", { class: "muted" }, ` raw ${fmtNum(raw)}`)] : fmtNum(raw));
    });
    const x = hovering ? u.data[0][idx] : null;
    this.legendX.textContent = x === null ? "" : this.view.x === "time" ? fmtWall(x) : `step ${x}`;
  }

  onKey(e) {
    const u = this.u;
    if (!u || !["ArrowLeft", "ArrowRight", "Home", "End", "Escape"].includes(e.key)) return;
    e.preventDefault();
    if (e.key === "Escape") { u.setCursor({ left: -10, top: -10 }, true, true); this.said.textContent = ""; return; }
    const xs = u.data[0];
    if (!xs.length) return;
    let lo = 0, hi = xs.length - 1;
    while (lo < hi && xs[lo] < u.scales.x.min) lo++;
    while (hi > lo && xs[hi] > u.scales.x.max) hi--;
    let cur = u.cursor.idx;
    if (this.kb && this.kb.left === u.cursor.left) cur = this.kb.idx; // as the keys left it
    const off = cur === null || cur === undefined || cur < lo || cur > hi;
    let i;
    if (e.key === "Home") i = lo;
    else if (e.key === "End") i = hi;
    else if (e.key === "ArrowRight") i = off ? lo : Math.min(hi, cur + 1);
    else i = off ? hi : Math.max(lo, cur - 1);
    const main = this.view.smoothing > 0 ? 2 : 1;
    const y = u.data[main] ? u.data[main][i] : null;
    const left = u.valToPos(xs[i], "x");
    u.setCursor({ left, top: y === null || y === undefined ? u.over.clientHeight / 2 : u.valToPos(y, "y") }, true, true);
    this.kb = { idx: i, left: u.cursor.left };
    this.said.textContent = `${this.legendX.textContent}: ${this.defs.map((d, k) => `${d.label} ${this.legendVals[k].textContent}`).join(", ")}`;
  }

  /** The chart's points as a table: step (and wall time), one column per series; the last TABLE_ROWS steps. */
  renderTable() {
    if (!this.table.open) return;
    const data = this.current();
    const time = this.view.x === "time";
    const cols = this.defs.map((d) => data.get(d.id) || NO_COLS);
    const index = cols.map((c) => new Map(c.step.map((st, i) => [st, i])));
    const steps = [...new Set(cols.flatMap((c) => c.step))].sort((a, b) => a - b);
    const rows = steps.slice(-TABLE_ROWS);
    const what = this.zoom ? "in the zoomed range" : "loaded";
    fill(this.tableBox,
      h("p", { class: "muted small", "data-testid": "chart-table-note" }, steps.length > rows.length
        ? `the last ${rows.length} of ${steps.length} steps ${what}` : `${steps.length} steps ${what}`),
      h("div", { class: "scroll table-scroll" }, h("table", { class: "table compact chart-data" },
        h("caption", { class: "sr-only" }, this.title),
        h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "step"), time ? h("th", { scope: "col" }, "wall time") : null,
          this.defs.map((d) => h("th", { scope: "col" }, d.label)))),
        h("tbody", {}, rows.map((st) => {
          const first = index.findIndex((m) => m.has(st));
          return h("tr", { "data-step": st }, h("th", { scope: "row", class: "num" }, st),
            time ? h("td", { class: "nowrap" }, fmtWall(cols[first].time[index[first].get(st)])) : null,
            cols.map((c, k) => {
              const i = index[k].get(st);
              const v = i === undefined ? null : c.value[i];
              return h("td", { class: "num", "data-value": v === null ? "" : String(v) }, fmtNum(v));
            }));
        })))));
  }
}

/** The index nearest to idx where ys has a value (series joined on x have gaps), or null. */
function nearestValue(ys, idx) {
  if (!ys) return null;
  for (let d = 0; d < ys.length; d++) {
    if (idx - d >= 0 && ys[idx - d] !== null) return idx - d;
    if (idx + d < ys.length && ys[idx + d] !== null) return idx + d;
  }
  return null;
}

/** A legend sample of a series: its colour and its dash pattern. */
function swatch(d) {
  return s("svg", { class: "swatch-line", width: 22, height: 8, viewBox: "0 0 22 8", "aria-hidden": "true" },
    s("line", { x1: 1, x2: 21, y1: 4, y2: 4, stroke: d.color, "stroke-width": 2.5,
      "stroke-dasharray": d.dash && d.dash.length ? d.dash.join(" ") : null }));
}

/* ---------- metric grouping for the run page ---------- */

// One chart per group, in this order; `each` makes one chart per matching key. Keys matching no group
// get a chart each (after these); final/* values are shown as a table, not charted. Charts are shown in
// collapsible sections (SECTIONS); a series' colour and dash come from its place in `keys`, so that
// reward/max looks the same whether or not reward/min was logged.
const SECTIONS = ["Loss and reward", "Evaluation", "Policy and KL", "Rollouts", "Optimisation", "Other"];
const GROUPS = [
  { title: "Loss", keys: ["loss"], section: 0 },
  { title: "Reward (mean, min, max)", keys: ["reward/mean", "reward/min", "reward/max"], section: 0 },
  { title: "Reward components (mean)", match: /^reward\/(?!failures$)[^/]+\/mean$/, section: 0 },
  { title: "Reward std", keys: ["reward/std"], section: 0 },
  { title: "Accuracy", keys: ["rewards/accuracy", "accuracy", "token_accuracy"], section: 0 },
  { title: "Implicit rewards", keys: ["rewards/chosen", "rewards/rejected"], section: 0 },
  { title: "Reward margin", keys: ["rewards/margin", "margin"], section: 0 },
  { title: "Log-probs", keys: ["logps/chosen", "logps/rejected"], section: 0 },
  { title: "Scores", keys: ["scores/mean", "scores/std"], section: 0 },
  { title: "Evaluation", match: /^eval\//, each: true, section: 1 },
  { title: "KL to reference", keys: ["kl/ref", "kl/seq"], section: 2 },
  { title: "Policy entropy", keys: ["policy/entropy"], section: 2 },
  { title: "Clip fraction", keys: ["policy/clipfrac"], section: 2 },
  { title: "Approx. KL (old policy)", keys: ["policy/approx_kl"], section: 2 },
  { title: "Losses", match: /^loss\//, section: 2 },
  { title: "Value", match: /^(value|critic)\//, section: 2 },
  { title: "Advantages", match: /^adv\//, section: 2 },
  { title: "KL coefficient", keys: ["kl/coef"], section: 2 },
  { title: "Sampler mismatch (|Δ log p|, KL)", keys: ["mismatch/logp_abs_diff", "mismatch/kl"], section: 2 },
  { title: "IS ratio, trainer / sampler", keys: ["mismatch/ratio_min", "mismatch/ratio_mean", "mismatch/ratio_max"], section: 2 },
  { title: "IS ratios capped", keys: ["mismatch/capped_frac"], section: 2 },
  { title: "Response length", keys: ["response/length_mean", "response/length_max"], section: 3 },
  { title: "Truncated responses", keys: ["response/truncated_frac"], section: 3 },
  { title: "Groups", match: /^groups\// , each: true, section: 3 },
  { title: "Reward failures", keys: ["reward/failures"], section: 3 },
  { title: "Grad norm", keys: ["grad_norm"], section: 4 },
  { title: "Learning rate", keys: ["lr"], section: 4 },
  { title: "Throughput", match: /^perf\//, each: true, section: 4 },
];
const OPEN_SECTIONS = 2; // with more than OPEN_ALL charts, only the first this many sections start open
const OPEN_ALL = 8;

/** [{title, keys, styles, section}] for the keys a run has, in display order. */
function groupKeys(keys) {
  const left = new Set(keys.filter((k) => !k.startsWith("final/")));
  const out = [];
  for (const g of GROUPS) {
    const hit = g.keys ? g.keys.filter((k) => left.has(k)) : [...left].filter((k) => g.match.test(k)).sort();
    if (!hit.length) continue;
    hit.forEach((k) => left.delete(k));
    if (g.each) hit.forEach((k) => out.push({ title: k, keys: [k], styles: [0], section: g.section }));
    else out.push({ title: g.title, keys: hit, styles: hit.map((k, i) => (g.keys ? g.keys.indexOf(k) : i)), section: g.section });
  }
  [...left].sort().forEach((k) => out.push({ title: k, keys: [k], styles: [0], section: SECTIONS.length - 1 }));
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
  for (const c of currentPage.charts) c.destroy();
  currentPage.charts.clear();
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
window.addEventListener("hashchange", route);
document.getElementById("key-form").addEventListener("submit", useKey);
document.getElementById("forget-key").addEventListener("click", forgetKey);
renderKeyStatus();
route();

/* ---------- runs list ---------- */


/** The key metric shown for an algorithm's runs: the one chosen (localStorage), else eval/pass@1, reward/mean
    or loss, the first of them the algorithm's runs logged. */
function defaultKeyMetric(algorithm, keys) {
  const chosen = localStorage.getItem(KEY_METRIC_ITEM + algorithm);
  if (chosen && (!keys.length || keys.includes(chosen))) return chosen;
  return KEY_METRICS.find((k) => keys.includes(k)) || keys[0] || "";
}

/** A tag chip; with `onclick` a button (filter by the tag). */
function tagChip(tag, onclick = null, attrs = {}) {
  return onclick ? h("button", { type: "button", class: "tag tag-button", "data-tag": tag, title: `show runs tagged ${tag}`,
    onclick, ...attrs }, tag) : h("span", { class: "tag", "data-tag": tag, ...attrs }, tag);
}

async function runsPage(ctx, main, params) {
  document.title = "Runs · rlrun";
  const filters = { status: params.get("status") || "", algorithm: params.get("algorithm") || "",
    flagged: ["true", "false"].includes(params.get("flagged")) ? params.get("flagged") : "",
    q: params.get("q") || "", tag: params.getAll("tag"), sort: params.get("sort") || "" };
  const selected = new Set();
  const keyMetric = new Map(); // run id -> {key, value, final}
  const algoKeys = new Map(); // algorithm -> metric keys its runs logged (a few runs' union)
  const rowCache = new Map(); // run id -> {sig, tr}
  let runs = [];
  let hasMore = false;
  let nextCursor = null;
  let loadSeq = 0; // answers to an older query (search typed on) are dropped

  const statusSel = h("select", { id: "filter-status", "data-testid": "filter-status" },
    h("option", { value: "" }, "all statuses"), STATUSES.map((st) => h("option", { value: st }, st)));
  const algoSel = h("select", { id: "filter-algorithm", "data-testid": "filter-algorithm" },
    h("option", { value: "" }, "all algorithms"), ALGORITHMS.map((a) => h("option", { value: a }, a)));
  // ?flagged= of GET /v1/runs: runs with (or without) health warnings
  const flaggedSel = h("select", { id: "filter-flagged", "data-testid": "filter-flagged" },
    h("option", { value: "" }, "with or without warnings"), h("option", { value: "true" }, "⚠ flagged: with warnings"),
    h("option", { value: "false" }, "without warnings"));
  const search = h("input", { type: "search", id: "runs-search", "data-testid": "runs-search", value: filters.q,
    placeholder: "name, algorithm, model, tag, note or id", class: "search" });
  statusSel.value = filters.status;
  algoSel.value = filters.algorithm;
  flaggedSel.value = filters.flagged;
  const compareBtn = h("button", { class: "primary", "data-testid": "compare-button", disabled: true,
    onclick: () => { location.hash = `#/compare?runs=${[...selected].map(enc).join(",")}`; } }, "Compare");
  const count = h("span", { class: "muted", "data-testid": "runs-count" });
  const tagBar = h("div", { class: "toolbar tag-filter", "data-testid": "tag-filter" });
  const keyBar = h("div", { class: "toolbar key-metrics", "data-testid": "key-metric-choice" });
  const tbody = h("tbody");
  const headRow = h("tr", {}, h("th", { class: "check" }, h("span", { class: "sr-only" }, "select")),
    ["Run", "Status", "Algorithm", "Model", "Tags", "Progress", "Key metric", "Created", "Duration"].map((t) => {
      const field = SORTABLE[t];
      if (!field) return h("th", { scope: "col" }, t);
      return h("th", { scope: "col", "data-sort": field }, h("button", { type: "button", class: "sort",
        "data-testid": `sort-${field}`, onclick: () => onSort(field) }, t, h("span", { class: "sort-mark", "aria-hidden": "true" })));
    }));
  const table = h("table", { class: "table runs", id: "runs-table", "data-testid": "runs-table" }, h("thead", {}, headRow), tbody);
  const more = h("button", { "data-testid": "load-more", hidden: true, onclick: () => load(false).catch(showError) }, "Load more");
  main.append(h("div", { class: "page-head" }, h("h1", {}, "Runs"), count),
    h("div", { class: "toolbar" },
      h("label", { class: "field" }, "Search ", search),
      h("label", { class: "field" }, "Status ", statusSel),
      h("label", { class: "field" }, "Algorithm ", algoSel),
      h("label", { class: "field" }, "Health ", flaggedSel),
      compareBtn, h("span", { class: "muted hint" }, "tick runs to compare them")),
    tagBar, keyBar,
    h("div", { class: "card flush" }, table), more);

  const syncUrl = () => history.replaceState(null, "", `#/runs${qs(filters)}`);
  const requery = () => { syncUrl(); load(true).catch(showError); };
  statusSel.addEventListener("change", () => { filters.status = statusSel.value; requery(); });
  flaggedSel.addEventListener("change", () => { filters.flagged = flaggedSel.value; requery(); });
  algoSel.addEventListener("change", () => { filters.algorithm = algoSel.value; requery(); });
  let typing = null;
  search.addEventListener("input", () => {
    clearTimeout(typing);
    typing = setTimeout(() => { if (ctx.alive && search.value.trim() !== filters.q) { filters.q = search.value.trim(); requery(); } }, 300);
  });
  ctx.cleanups.push(() => clearTimeout(typing));

  function onSort(field) {
    const cur = filters.sort || "-created_at";
    // a new column starts ascending (created: newest first); the same column flips
    filters.sort = cur === field ? `-${field}` : cur === `-${field}` ? field : field === "created_at" ? "-created_at" : field;
    requery();
  }
  function renderSortMarks() {
    const cur = filters.sort || "-created_at";
    for (const th of headRow.querySelectorAll("th[data-sort]")) {
      const f = th.dataset.sort;
      const dir = cur === f ? "ascending" : cur === `-${f}` ? "descending" : "none";
      th.setAttribute("aria-sort", dir);
      th.querySelector(".sort-mark").textContent = dir === "ascending" ? " ▲" : dir === "descending" ? " ▼" : "";
    }
  }
  function addTag(tag) {
    if (!filters.tag.includes(tag)) { filters.tag = [...filters.tag, tag]; requery(); renderTagBar(); }
  }
  function renderTagBar() {
    fill(tagBar, filters.tag.length ? [h("span", { class: "muted small" }, "Tagged:"),
      filters.tag.map((t) => h("button", { type: "button", class: "tag tag-button", "data-testid": "tag-filter-chip",
        "data-tag": t, "aria-label": `stop filtering by tag ${t}`, onclick: () => {
          filters.tag = filters.tag.filter((x) => x !== t); requery(); renderTagBar();
        } }, t, " ×"))] : null);
    tagBar.hidden = !filters.tag.length;
  }

  function updateCompare() {
    compareBtn.disabled = selected.size < 1;
    compareBtn.textContent = selected.size ? `Compare ${selected.size} run${selected.size > 1 ? "s" : ""}` : "Compare";
  }

  /** One select per algorithm in the table: which metric its runs show in the key-metric column. */
  function renderKeyBar() {
    const algos = [...algoKeys.keys()].sort();
    fill(keyBar, algos.length ? h("span", { class: "muted small" }, "Key metric:") : null, algos.map((a) => {
      const keys = algoKeys.get(a);
      const sel = h("select", { id: `key-metric-${a}`, "data-testid": "key-metric-select", "data-algorithm": a,
        onchange: (e) => { localStorage.setItem(KEY_METRIC_ITEM + a, e.target.value); refreshKeyMetrics(a); } },
      keys.length ? keys.map((k) => h("option", { value: k }, k)) : h("option", { value: "" }, "no metrics yet"));
      sel.value = defaultKeyMetric(a, keys);
      return h("label", { class: "field" }, `${a} `, sel);
    }));
  }

  function render() {
    renderSortMarks();
    const shown = runs; // every filter runs in the API
    count.textContent = `${shown.length} shown${hasMore ? " (more below)" : ""}`;
    more.hidden = !hasMore;
    if (!shown.length) {
      rowCache.clear();
      fill(tbody, h("tr", {}, h("td", { colspan: 10, class: "empty" },
        runs.length || filters.status || filters.flagged || filters.q || filters.tag.length ? "No run matches the filters."
          : "No runs yet: submit one with POST /v1/runs (see the README).")));
      return;
    }
    // rows are rebuilt only when what they show changed, so a checkbox being clicked stays in place
    const trs = shown.map((r) => {
      const km = keyMetric.get(r.id);
      const sig = JSON.stringify([r.status, r.name, r.progress, r.warnings, r.tags, km && km.key, km && km.value,
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
      onclick: (e) => { if (!e.target.closest("input,a,button")) location.hash = `#/runs/${r.id}`; } },
    h("td", { class: "check" }, box),
    h("td", {}, h("a", { href: `#/runs/${r.id}` }, runLabel(r)),
      r.name ? h("span", { class: "muted mono small" }, ` ${shortId(r.id)}`) : null,
      r.stage ? h("span", { class: "muted small" }, ` · stage ${r.stage}`) : null),
    h("td", { class: "nowrap" }, badge(r.status, { "data-testid": "status" }), " ", warningBadge(r.warnings)),
    h("td", {}, r.algorithm),
    h("td", { class: "small" }, modelRef(r.spec && r.spec.model)),
    h("td", { class: "tags", "data-testid": "run-tags" }, (r.tags || []).map((t) => tagChip(t, () => addTag(t)))),
    h("td", {}, progressView(r.progress)),
    h("td", { "data-testid": "key-metric" }, km && km.key
      ? [h("span", { class: "muted small" }, `${km.key} `), h("b", {}, fmtNum(km.value))] : "–"),
    h("td", { title: fmtTime(r.created_at) }, fmtAge(r.created_at)),
    h("td", {}, fmtDuration(runDuration(r))));
  }

  /** The metric keys of each algorithm in the table (from up to 6 of its runs), for the key-metric selects. */
  async function loadAlgoKeys() {
    const todo = [...new Set(runs.map((r) => r.algorithm))].filter((a) => !algoKeys.has(a) || !algoKeys.get(a).length);
    await pool(todo, 4, async (a) => {
      // finished runs first: a queued or cancelled one has often logged nothing
      const some = runs.filter((r) => r.algorithm === a)
        .sort((x, y) => (y.status === "succeeded") - (x.status === "succeeded")).slice(0, 6);
      const lists = await Promise.all(some.map((r) => api(`/v1/runs/${r.id}/metric-keys`).catch(() => [])));
      algoKeys.set(a, [...new Set(lists.flat())].filter((k) => !k.startsWith("final/") || KEY_METRICS.includes(k)).sort());
    });
    if (ctx.alive && todo.length) renderKeyBar();
  }

  async function loadKeyMetrics(algorithm = null) {
    const todo = runs.filter((r) => {
      if (algorithm) return r.algorithm === algorithm;
      const km = keyMetric.get(r.id);
      return !km || !km.final || km.key !== defaultKeyMetric(r.algorithm, algoKeys.get(r.algorithm) || []);
    });
    const wanted = new Map(); // run id -> its key metric
    for (const r of todo) {
      const key = defaultKeyMetric(r.algorithm, algoKeys.get(r.algorithm) || []);
      if (key) wanted.set(r.id, key); else keyMetric.set(r.id, { key: "", value: null, final: false });
    }
    // GET /v1/metrics/last per key metric with the runs that show it (at most 200 a request): the API
    // looks up every key for every run named, so mixing the keys would multiply its lookups
    const byKey = new Map();
    for (const [id, key] of wanted) byKey.set(key, [...(byKey.get(key) || []), id]);
    for (const [key, ids] of byKey) for (let i = 0; i < ids.length; i += 200) {
      const part = ids.slice(i, i + 200);
      let last;
      try { last = await api(`/v1/metrics/last${qs({ run: part, key })}`); } catch { continue; }
      for (const id of part) {
        const r = runs.find((x) => x.id === id);
        const got = (last[id] || {})[wanted.get(id)];
        keyMetric.set(id, { key: wanted.get(id), value: got ? got.value : null, final: !!r && FINISHED.has(r.status) });
      }
    }
    if (ctx.alive) render();
  }
  async function refreshKeyMetrics(algorithm) {
    try { await loadKeyMetrics(algorithm); } catch (err) { showError(err); }
  }
  async function afterLoad() {
    await loadAlgoKeys();
    await loadKeyMetrics();
  }

  const query = (extra) => `/v1/runs${qs({ status: filters.status, algorithm: filters.algorithm,
    flagged: filters.flagged, q: filters.q, tag: filters.tag, sort: filters.sort, ...extra })}`;
  async function load(reset) {
    const seq = ++loadSeq;
    const page = await api(query({ limit: 50, after: reset ? null : nextCursor }));
    if (!ctx.alive || seq !== loadSeq) return;
    runs = reset ? page.data : runs.concat(page.data);
    hasMore = page.has_more;
    nextCursor = page.next_cursor;
    render();
    afterLoad().catch(() => {});
  }

  async function refresh() {
    const seq = loadSeq;
    const limit = Math.min(200, Math.max(50, runs.length));
    try {
      const page = await api(query({ limit }));
      if (!ctx.alive || seq !== loadSeq) return;
      runs = page.data;
      hasMore = page.has_more;
      nextCursor = page.next_cursor;
      render();
      afterLoad().catch(() => {});
    } catch (err) { showError(err); }
  }

  updateCompare();
  renderTagBar();
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

  const series = new Map(); // key -> Cols (the whole run, chart-sized; the stream appends to it)
  const loadedUpTo = new Map(); // key -> last step of the downsampled load (older stream points are skipped)
  const eventIds = new Set();
  let charts = new Map(); // testid -> {chart, keys, section}
  const sections = new Map(); // section index -> {details, grid, count}
  const toggled = new Set(); // sections the user opened or closed (kept as charts come and go)
  let layoutSig = "";
  let timesLoaded = false; // whether `series` has wall times (fetched when the x axis first asks for them)
  const view = chartView();
  let liveState = FINISHED.has(run.status) ? "" : "connecting";
  let confirmCancel = false;

  const header = h("section", { class: "card run-header", "data-testid": "run-header" });
  const finalBox = h("div", { class: "final", "data-testid": "final-metrics" });
  const chartsGrid = h("div", { class: "chart-sections", "data-testid": "charts" });
  const eventsList = h("ol", { class: "events", "data-testid": "events" });
  const eventsBox = h("div", { class: "scroll" }, eventsList);
  const ckptBox = h("div", { "data-testid": "checkpoints" }, h("p", { class: "muted" }, "Loading…"));
  const samplesBox = h("div", { "data-testid": "samples" });
  const samplesCard = card("Samples", samplesBox);
  samplesCard.hidden = true;
  const pipelineBox = h("div", { class: "pipeline", "data-testid": "pipeline" });
  const metaBox = h("section", { class: "card run-meta", "data-testid": "run-meta", "aria-label": "tags and note" });
  main.append(h("p", { class: "crumbs" }, h("a", { href: "#/runs" }, "← Runs")), header, metaBox,
    card("Metrics", finalBox, chartControls(view, onView), chartsGrid),
    h("div", { class: "two-col" }, card("Events", eventsBox), card("Checkpoints", ckptBox)),
    samplesCard, specCard(run));
  renderMeta();
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

  /** Charts for the groups of keys the run has, in sections; kept as they are when their keys are the same
      (a chart is made again only when its keys change: new keys appear as a live run logs them). */
  function layoutCharts() {
    const groups = groupKeys([...series.keys()]);
    const sig = JSON.stringify(groups);
    if (sig === layoutSig) return;
    layoutSig = sig;
    const old = charts;
    charts = new Map();
    for (const g of groups) {
      const testid = `chart-${g.keys[0]}`;
      let entry = old.get(testid);
      old.delete(testid);
      if (!entry || JSON.stringify(entry.keys) !== JSON.stringify(g.keys)) {
        if (entry) { entry.chart.destroy(); ctx.charts.delete(entry.chart); }
        const chart = new Chart({ testid, title: g.title, view, fetchRange: (keys, minStep, maxStep, maxPoints) =>
          fetchColumns(runId, { keys, minStep, maxStep, maxPoints, time: view.x === "time" }) });
        chart.setSeries(g.keys.map((k, i) => ({ id: k, label: k, ...seriesStyle(g.styles[i]) })));
        entry = { chart, keys: g.keys };
      }
      entry.section = g.section;
      entry.chart.setData(new Map(g.keys.map((k) => [k, series.get(k)])));
      charts.set(testid, entry);
    }
    for (const { chart } of old.values()) { chart.destroy(); ctx.charts.delete(chart); }

    const used = SECTIONS.map((_, i) => [...charts.values()].filter((c) => c.section === i)).map((list, i) => [i, list])
      .filter(([, list]) => list.length);
    used.forEach(([i, list], rank) => {
      if (!sections.has(i)) {
        const grid = h("div", { class: "charts" });
        const count = h("span", { class: "muted small" });
        const details = h("details", { class: "chart-section", "data-testid": "chart-section", "data-section": SECTIONS[i] },
          h("summary", {}, h("span", { class: "section-title" }, SECTIONS[i]), " ", count), grid);
        // "toggle" also fires when the page sets `open`: only a user's click (on the summary) is remembered
        details.firstChild.addEventListener("click", () => toggled.add(i));
        sections.set(i, { details, grid, count });
      }
      const sec = sections.get(i);
      if (!toggled.has(i)) sec.details.open = charts.size <= OPEN_ALL || rank < OPEN_SECTIONS;
      sec.count.textContent = `${list.length} chart${list.length === 1 ? "" : "s"}`;
      fill(sec.grid, list.map((c) => c.chart.el));
    });
    fill(chartsGrid, used.map(([i]) => sections.get(i).details));
    if (!charts.size) chartsGrid.append(h("p", { class: "empty" }, FINISHED.has(run.status)
      ? "This run logged no metrics." : "No metrics yet: charts appear as the run logs them."));
  }

  function renderFinals() {
    const finals = [...series.keys()].filter((k) => k.startsWith("final/")).sort();
    fill(finalBox, finals.length ? h("h3", {}, "Final metrics") : null,
      finals.length ? h("div", { class: "tiles" }, finals.map((k) => h("div", { class: "tile", "data-key": k },
        h("span", { class: "muted small" }, k.slice(6)), h("b", {}, fmtNum(series.get(k).last))))) : null);
  }

  async function loadMetrics() {
    const time = view.x === "time";
    const cols = await fetchColumns(runId, { time });
    if (!ctx.alive) return;
    series.clear();
    for (const [k, c] of cols) {
      series.set(k, c);
      loadedUpTo.set(k, Math.max(loadedUpTo.get(k) ?? -1, c.step.length ? c.step[c.step.length - 1] : -1));
    }
    timesLoaded = time;
    layoutSig = ""; // the series are new objects: give every chart its own again
    layoutCharts();
    renderFinals();
  }

  /** The page's chart settings changed (chartControls). */
  async function onView(what) {
    if (what === "x") {
      charts.forEach(({ chart }) => chart.resetZoom());
      if (view.x === "time" && !timesLoaded) {
        try { await loadMetrics(); } catch (err) { showError(err); }
      }
    }
    ctx.charts.forEach((c) => c.schedule());
  }

  /** The run's tags and note, and an inline editor for them (PATCH /v1/runs/{id}; a 422 names its field). */
  function renderMeta(editing = false, error = null) {
    const tags = run.tags || [];
    if (!editing) {
      fill(metaBox, h("div", { class: "meta-row" },
        h("span", { class: "muted small" }, "Tags"),
        h("span", { "data-testid": "run-tags" }, tags.length ? tags.map((t) => h("a", { class: "tag", "data-tag": t,
          href: `#/runs${qs({ tag: t })}`, title: `runs tagged ${t}` }, t)) : h("span", { class: "muted" }, "none")),
        h("span", { class: "spacer" }),
        h("button", { type: "button", "data-testid": "edit-meta", onclick: () => renderMeta(true) }, "Edit tags and note")),
      run.note ? h("p", { class: "note", "data-testid": "run-note" }, run.note) : null);
      return;
    }
    const tagsIn = h("input", { type: "text", id: "edit-tags", "data-testid": "edit-tags", class: "wide mono",
      value: tags.join(", "), placeholder: "baseline, lr-sweep" });
    const noteIn = h("textarea", { id: "edit-note", "data-testid": "edit-note", rows: 3, maxlength: 4000 }, run.note || "");
    const save = async (e) => {
      e.preventDefault();
      const body = { tags: tagsIn.value.split(/[\s,]+/).filter(Boolean), note: noteIn.value };
      try {
        run = await api(base, { method: "PATCH", body: JSON.stringify(body), headers: { "Content-Type": "application/json" } });
        if (ctx.alive) renderMeta();
      } catch (err) {
        if (ctx.alive) renderMeta(true, err);
        const kept = metaBox.querySelectorAll("input, textarea"); // what was typed stays
        kept[0].value = body.tags.join(", ");
        kept[1].value = body.note;
      }
    };
    fill(metaBox, h("form", { class: "meta-form", "data-testid": "meta-form", onsubmit: save },
      h("label", { for: "edit-tags" }, "Tags (comma-separated; a-z 0-9 . _ : / + -)"), tagsIn,
      h("label", { for: "edit-note" }, "Note"), noteIn,
      error ? h("p", { class: "error-text", role: "alert", "data-testid": "meta-error" },
        `${error.field ? `${error.field}: ` : ""}${error.message}`) : null,
      h("div", { class: "toolbar" }, h("button", { type: "submit", class: "primary", "data-testid": "save-meta" }, "Save"),
        h("button", { type: "button", onclick: () => renderMeta() }, "Cancel"))));
    tagsIn.focus();
  }

  /** Add one event to the list; false if it was there already. A failure (an error event, or the status
      "failed") is marked in words and colour, with its reason written out. */
  function addEvent(e) {
    if (eventIds.has(e.id)) return false;
    eventIds.add(e.id);
    const nearBottom = eventsBox.scrollHeight - eventsBox.scrollTop - eventsBox.clientHeight < 30;
    const failed = e.kind === "error" || (e.kind === "status" && e.message === "failed");
    const reason = e.data && (e.data.error || e.data.reason);
    eventsList.append(h("li", { class: `event${failed ? " event-failed" : ""}`, "data-testid": "event",
      "data-kind": e.kind, title: e.data ? JSON.stringify(e.data) : "" },
      h("time", { title: fmtTime(e.created_at) }, fmtClock(e.created_at)),
      h("span", { class: `kind kind-${failed ? "failed" : e.kind}` }, failed ? "✖ failed" : e.kind.replace(/_/g, " ")),
      h("span", { class: "msg" }, failed && e.message === "failed" ? "" : e.message,
        reason ? h("span", { class: "reason", "data-testid": "event-reason" }, `${failed && e.message === "failed" ? "" : ": "}${reason}`) : null)));
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
  let sampleStep = null; // null: the last step; "all": every step
  let sampleQ = "";
  let sampleHits = null; // the answer to a search (across all steps), or null
  async function fetchSamples(q) {
    const all = [];
    let after = null;
    for (let i = 0; i < 10; i++) { // at most 5000 samples
      const page = await api(`${base}/samples${qs({ limit: 500, after, q: q || null })}`);
      all.push(...page.data);
      if (!page.has_more) break;
      after = page.next_cursor;
    }
    return all;
  }
  async function loadSamples() {
    samples = await fetchSamples("");
    if (sampleQ) sampleHits = await fetchSamples(sampleQ);
    renderSamples();
  }
  const sampleSearch = h("input", { type: "search", id: "sample-search", "data-testid": "sample-search",
    placeholder: "text in a prompt or completion" });
  let sampleTyping = null;
  sampleSearch.addEventListener("input", () => {
    clearTimeout(sampleTyping);
    sampleTyping = setTimeout(async () => {
      const q = sampleSearch.value.trim();
      if (q === sampleQ) return;
      sampleQ = q;
      try {
        const hits = q ? await fetchSamples(q) : null;
        if (!ctx.alive || q !== sampleQ) return;
        sampleHits = hits;
        if (q) sampleStep = "all"; // the hits are from any step: show them all, the step filter narrows them
        renderSamples();
      } catch (err) { showError(err); }
    }, 300);
  });
  ctx.cleanups.push(() => clearTimeout(sampleTyping));
  // the search box stays in place while the rest is drawn again (moving it would take its focus away)
  const stepTools = h("span", { class: "toolbar inline" });
  const sampleCount = h("span", { class: "muted", "data-testid": "sample-count" });
  const sampleList = h("div");
  samplesBox.append(h("div", { class: "toolbar" }, stepTools, h("label", { for: "sample-search" }, "Search"),
    sampleSearch, sampleCount), sampleList);
  function renderSamples() {
    samplesCard.hidden = !samples.length;
    if (!samples.length) return;
    const steps = [...new Set(samples.map((x) => x.step))].sort((a, b) => a - b);
    if (sampleStep !== "all" && (sampleStep === null || !steps.includes(sampleStep))) sampleStep = steps[steps.length - 1];
    const at = steps.indexOf(sampleStep);
    const go = (st) => { sampleStep = st; renderSamples(); };
    const sel = h("select", { id: "sample-step", "data-testid": "sample-step",
      onchange: (e) => go(e.target.value === "all" ? "all" : Number(e.target.value)) },
    h("option", { value: "all" }, "all steps"), steps.map((st) => h("option", { value: st }, `step ${st}`)));
    sel.value = String(sampleStep);
    const pool = sampleHits || samples;
    const rows = pool.filter((x) => sampleStep === "all" || x.step === sampleStep)
      .sort((a, b) => a.step - b.step || b.reward - a.reward);
    const mean = rows.length ? rows.reduce((a, x) => a + x.reward, 0) / rows.length : null;
    const withRef = rows.some((x) => x.data && known(x.data.reference));
    fill(stepTools, h("label", { for: "sample-step" }, "Step"), sel,
      h("button", { type: "button", "data-testid": "sample-prev", disabled: sampleStep === "all" || at <= 0,
        "aria-label": "previous step", onclick: () => go(steps[at - 1]) }, "◀ prev"),
      h("button", { type: "button", "data-testid": "sample-next", disabled: sampleStep === "all" || at >= steps.length - 1,
        "aria-label": "next step", onclick: () => go(steps[at + 1]) }, "next ▶"));
    sampleCount.textContent = rows.length
        ? `${rows.length} completion${rows.length === 1 ? "" : "s"}${sampleQ ? ` matching “${sampleQ}”` : ""}, mean reward ${fmtNum(mean)}`
        : `no completion${sampleQ ? ` matches “${sampleQ}”` : ""} at this step`;
    const heads = ["Step", "Reward", "Prompt", "Completion", withRef ? "Reference answer" : null, "Details"].filter(Boolean);
    fill(sampleList, h("div", { class: "scroll tall" }, h("table", { class: "table compact samples" },
      h("thead", {}, h("tr", {}, heads.map((t) => h("th", { scope: "col" }, t)))),
      h("tbody", {}, rows.map((x) => h("tr", { "data-testid": "sample-row", "data-step": x.step },
        h("td", { class: "num" }, x.step),
        h("td", { class: "num" }, h("b", {}, fmtNum(x.reward))),
        h("td", {}, h("div", { class: "text" }, visible(x.prompt))),
        h("td", {}, x.data && Array.isArray(x.data.transcript)
          ? transcriptView(x.data.transcript) : h("div", { class: "text" }, visible(x.completion))),
        withRef ? h("td", { "data-testid": "sample-reference" }, x.data && known(x.data.reference)
          ? h("div", { class: "text" }, textValue(x.data.reference)) : "–") : null,
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
      let added = false, finals = false;
      const now = Date.now() / 1000; // the stream sends no logging time: these points were logged about now
      for (const p of JSON.parse(msg.data)) {
        if (p.step <= (loadedUpTo.get(p.key) ?? -1)) continue; // already in the downsampled load
        if (!series.has(p.key)) { series.set(p.key, new Cols()); added = true; }
        series.get(p.key).add(p.step, p.value, now);
        if (p.key.startsWith("final/")) finals = true;
        else maxStep = Math.max(maxStep, p.step);
      }
      // the charts hold these Cols: appended in place, each redraws (setData) at its next frame
      if (added) layoutCharts();
      charts.forEach(({ chart }) => chart.schedule());
      if (finals || added) renderFinals();
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

  every(ctx, 5000, () => { if (!FINISHED.has(run.status)) refreshRun(); });
  every(ctx, 15000, () => { if (!FINISHED.has(run.status) && run.status === "running") loadSamples().catch(() => {}); });
}

/** A model reference; `run:<id>` and `run:<id>@<step>` link to that run. */
function modelRef(model) {
  const m = /^run:([0-9a-f-]{36})(@\d+)?$/.exec(model || "");
  if (!m) return h("span", { class: "mono" }, model);
  return h("span", { class: "mono" }, "run:", h("a", { href: `#/runs/${m[1]}`, title: m[1] }, shortId(m[1])), m[2] || "");
}

/** A multi-turn episode's turns: the model's (with the tool calls it made), then each tool's result or
    the environment's reply (an error marked as one, in words); the last model turn is the answer the
    rewards scored. */
function transcriptView(messages) {
  return h("ol", { class: "transcript", "data-testid": "sample-transcript" }, messages.map((m) => {
    const tool = m.role !== "assistant";
    const who = m.role === "assistant" ? "model" : m.role === "tool" ? `tool ${m.name || ""}`.trim() : m.role;
    const label = `${who}${m.error ? " (error)" : ""}`;
    const calls = !tool && Array.isArray(m.tool_calls) && m.tool_calls.length
      ? h("div", { class: "small muted" }, "calls " + m.tool_calls.map((c) => `${c.name}(${JSON.stringify(c.arguments)})`).join(", "))
      : null;
    return h("li", { class: tool ? (m.error ? "tool error" : "tool") : "model", "data-role": m.role },
      h("span", { class: "small muted" }, label), h("div", { class: "text" }, visible(m.content)), calls);
  }));
}

function sampleDetails(data) {
  if (!data) return "";
  const parts = [];
  if (data.components) for (const [k, v] of Object.entries(data.components)) parts.push(`${k} ${fmtNum(v)}`);
  const shown = new Set(["components", "reference", "transcript"]);
  for (const [k, v] of Object.entries(data)) if (!shown.has(k)) parts.push(`${k}: ${typeof v === "object" ? JSON.stringify(v) : v}`);
  return parts.join(" · ");
}

/* ---------- a run's spec: table, copy, clone ---------- */

/** A spec as [dotted path, value] pairs in key order: objects are walked ("hyperparameters.learning_rate"),
    lists and scalars are leaves (an empty object is a leaf too). */
function flatten(obj, prefix = "", out = []) {
  for (const [k, v] of Object.entries(obj || {})) {
    const path = prefix ? `${prefix}.${k}` : k;
    if (v && typeof v === "object" && !Array.isArray(v) && Object.keys(v).length) flatten(v, path, out);
    else out.push([path, v]);
  }
  return out;
}
function specValue(v) {
  if (v === undefined) return "—";
  return typeof v === "string" ? v : JSON.stringify(v);
}

/** Text to the clipboard: navigator.clipboard where the page may use it (a secure context), else a hidden
    textarea and execCommand("copy"). Resolves to whether it worked. */
async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    try { await navigator.clipboard.writeText(text); return true; } catch { /* fall back */ }
  }
  const ta = h("textarea", { class: "sr-only", "aria-hidden": "true", tabindex: -1, readonly: true });
  ta.value = text;
  document.body.append(ta);
  ta.select();
  let ok = false;
  try { ok = document.execCommand("copy"); } catch { ok = false; }
  ta.remove();
  return ok;
}

/** The Spec card: the stored spec as a table of dotted paths, "copy as JSON", and "clone into a new run"
    (the spec in a textarea, its name suffixed " (clone)", submitted with POST /v1/runs). */
function specCard(run) {
  const json = JSON.stringify(run.spec, null, 2);
  const copied = h("span", { class: "muted small", role: "status", "data-testid": "copy-status" });
  const cloneBox = h("div", { class: "clone", "data-testid": "clone-box", hidden: true });
  const copyBtn = h("button", { type: "button", "data-testid": "copy-spec", onclick: async () => {
    copied.textContent = (await copyText(json)) ? "copied" : "could not copy: select the JSON below";
  } }, "Copy as JSON");
  const cloneBtn = h("button", { type: "button", "data-testid": "clone-run", "aria-expanded": "false", onclick: () => {
    cloneBox.hidden = !cloneBox.hidden;
    cloneBtn.setAttribute("aria-expanded", String(!cloneBox.hidden));
    if (!cloneBox.hidden) openClone();
  } }, "Clone into a new run");

  function openClone() {
    const spec = { ...run.spec, name: `${run.spec.name || runLabel(run)} (clone)` };
    const ta = h("textarea", { id: "clone-spec", "data-testid": "clone-spec", class: "mono", rows: 16, spellcheck: "false" });
    ta.value = JSON.stringify(spec, null, 2);
    const err = h("p", { class: "error-text", role: "alert", "data-testid": "clone-error", hidden: true });
    const say = (text) => { err.textContent = text; err.hidden = !text; };
    const submit = async (e) => {
      e.preventDefault();
      let body;
      try { body = JSON.parse(ta.value); } catch (x) { say(`not JSON: ${x.message}`); return; }
      say("");
      try {
        const made = await api("/v1/runs", { method: "POST", body: JSON.stringify(body),
          headers: { "Content-Type": "application/json" } });
        location.hash = `#/runs/${made.id}`;
      } catch (x) {
        say(`${x.field ? `${x.field}: ` : ""}${x.message}`);
      }
    };
    fill(cloneBox, h("form", { onsubmit: submit, "data-testid": "clone-form" },
      h("label", { for: "clone-spec" }, "Spec of the new run (JSON; edit it before submitting)"), ta, err,
      h("div", { class: "toolbar" }, h("button", { type: "submit", class: "primary", "data-testid": "clone-submit" }, "Submit new run"))));
  }

  return h("section", { class: "card", "data-testid": "spec-card" }, h("h2", {}, "Spec"),
    h("div", { class: "toolbar" }, copyBtn, cloneBtn, copied), cloneBox,
    h("div", { class: "scroll" }, h("table", { class: "table compact spec-table", "data-testid": "spec" },
      h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "Field"), h("th", { scope: "col" }, "Value"))),
      h("tbody", {}, flatten(run.spec).map(([k, v]) => h("tr", { "data-path": k },
        h("td", { class: "mono small" }, k), h("td", { class: "mono small spec-value" }, specValue(v))))))),
    h("details", {}, h("summary", {}, "JSON"), h("pre", { class: "json", "data-testid": "spec-json" }, json)));
}

/* ---------- compare ---------- */

/** The spec fields (dotted paths) whose values are not the same in every run: [[path, [value per run]]]. A
    field a run lacks counts as different (its value undefined). */
function specDiff(runs) {
  const flat = runs.map((r) => new Map(flatten(r.spec)));
  const paths = [];
  for (const f of flat) for (const k of f.keys()) if (!paths.includes(k)) paths.push(k);
  return paths.map((k) => [k, flat.map((f) => f.get(k))])
    .filter(([, vals]) => vals.some((v) => JSON.stringify(v) !== JSON.stringify(vals[0])));
}

async function comparePage(ctx, main, params) {
  document.title = "Compare · rlrun";
  const ids = [...new Set((params.get("runs") || "").split(",").map((x) => x.trim()).filter(Boolean))];
  let keys = (params.get("keys") || params.get("key") || "").split(",").filter(Boolean);
  const go = (runIds, ks) => { location.hash = `#/compare${qs({ runs: runIds.join(","), keys: ks.join(",") })}`; };

  // add a run: a search over GET /v1/runs?q= (recent runs while the box is empty)
  const addInput = h("input", { type: "search", id: "compare-add", "data-testid": "compare-add", class: "search",
    placeholder: "search runs by name, tag, model or id" });
  const addList = h("ul", { class: "add-list", "data-testid": "compare-add-results" });
  let typing = null;
  let seq = 0;
  async function searchRuns() {
    const mine = ++seq;
    try {
      const page = await api(`/v1/runs${qs({ limit: 8, q: addInput.value.trim() || null })}`);
      if (!ctx.alive || mine !== seq) return;
      fill(addList, page.data.filter((r) => !ids.includes(r.id)).map((r) => h("li", {},
        h("button", { type: "button", class: "link", "data-testid": "compare-add-run", "data-run-id": r.id,
          onclick: () => go([...ids, r.id], keys) }, `+ ${runLabel(r)}`),
        h("span", { class: "muted small" }, ` ${r.algorithm} · ${r.status} · ${shortId(r.id)}`))));
    } catch (err) { showError(err); }
  }
  addInput.addEventListener("input", () => { clearTimeout(typing); typing = setTimeout(searchRuns, 300); });
  ctx.cleanups.push(() => clearTimeout(typing));
  const chosenBox = h("div", { class: "toolbar chosen-runs", "data-testid": "compare-runs" });
  const metricBox = h("fieldset", { class: "metric-pick", "data-testid": "compare-metrics" }, h("legend", {}, "Metrics"));
  main.append(h("div", { class: "page-head" }, h("h1", {}, "Compare runs")),
    chosenBox,
    h("details", { class: "picker", open: !ids.length }, h("summary", {}, "Add runs"),
      h("div", { class: "toolbar" }, h("label", { for: "compare-add" }, "Find a run"), addInput), addList));
  searchRuns();

  if (!ids.length) {
    main.append(h("p", { class: "empty" }, "Choose runs: tick them on the runs page or add them above."));
    return;
  }
  let runs = await Promise.all(ids.map((id) => api(`/v1/runs/${enc(id)}`).catch((err) => ({ id, missing: err }))));
  if (!ctx.alive) return;
  const missing = runs.filter((r) => r.missing);
  runs = runs.filter((r) => !r.missing);
  if (missing.length) showError(new Error(`not found: ${missing.map((r) => r.id).join(", ")}`));
  // one colour and dash per run, the same in every chart, the tables and the diff
  const defs = runs.map((r, i) => ({ id: r.id, label: `${runLabel(r)} (${r.algorithm})`, title: r.id,
    href: `#/runs/${r.id}`, ...seriesStyle(i) }));
  fill(chosenBox, h("span", { class: "muted small" }, `${runs.length} run${runs.length === 1 ? "" : "s"}:`),
    defs.map((d) => h("span", { class: "chosen", "data-run-id": d.id }, swatch(d), h("a", { href: d.href }, d.label),
      h("button", { type: "button", class: "link", "data-testid": "compare-remove", "aria-label": `remove ${d.label}`,
        onclick: () => go(ids.filter((x) => x !== d.id), keys) }, "remove"))));

  const keyLists = await Promise.all(runs.map((r) => api(`/v1/runs/${r.id}/metric-keys`).catch(() => [])));
  if (!ctx.alive) return;
  const counts = new Map();
  keyLists.flat().forEach((k) => counts.set(k, (counts.get(k) || 0) + 1));
  const common = [...counts.keys()].filter((k) => counts.get(k) === runs.length).sort();
  const partial = [...counts.keys()].filter((k) => counts.get(k) < runs.length).sort();
  if (!keys.length) {
    const first = ["eval/pass@1", "reward/mean", "eval/accuracy", "loss"].find((k) => common.includes(k)) || common[0] || partial[0];
    keys = first ? [first] : [];
  }
  const box = (k, note) => h("label", { class: "metric-choice" }, h("input", { type: "checkbox", value: k,
    "data-testid": "compare-metric", checked: keys.includes(k), onchange: (e) => {
      go(ids, e.target.checked ? [...keys, k] : keys.filter((x) => x !== k));
    } }), ` ${k}`, note ? h("span", { class: "muted small" }, ` (${note})`) : null);
  metricBox.append(h("div", { class: "metric-list" }, common.map((k) => box(k)),
    partial.map((k) => box(k, `${counts.get(k)} of ${runs.length} runs`)),
    keys.filter((k) => !counts.has(k)).map((k) => box(k, "no run has it"))));

  const view = chartView();
  const fetchKey = async (key, runIds, opts) => new Map(await Promise.all(runIds.map(async (id) =>
    [id, (await fetchColumns(id, { keys: [key], time: view.x === "time", ...opts })).get(key) || new Cols()])));
  const charts = keys.map((key) => {
    const chart = new Chart({ testid: `compare-chart-${key}`, title: key, view, height: 260,
      fetchRange: (runIds, minStep, maxStep, maxPoints) => fetchKey(key, runIds, { minStep, maxStep, maxPoints }) });
    chart.setSeries(defs);
    return chart;
  });
  const summary = h("tbody");
  main.append(metricBox,
    card(null, chartControls(view, async (what) => {
      if (what === "x") { charts.forEach((c) => c.resetZoom()); await load(); } else charts.forEach((c) => c.schedule());
    }), charts.length ? h("div", { class: "charts", "data-testid": "compare-charts" }, charts.map((c) => c.el))
      : h("p", { class: "empty" }, "No metric chosen.")),
    card("Runs", h("div", { class: "scroll-x" }, h("table", { class: "table compact", "data-testid": "compare-table" },
      h("thead", {}, h("tr", {}, ["", "Run", "Status", "Algorithm", "Model", "Progress", ...keys.map((k) => `Last ${k}`)]
        .map((t) => h("th", { scope: "col" }, t)))), summary))),
    diffCard(runs, defs));

  async function load() {
    const data = new Map(await Promise.all(runs.map(async (r) =>
      [r.id, keys.length ? await fetchColumns(r.id, { keys, time: view.x === "time" }) : new Map()])));
    if (!ctx.alive) return;
    charts.forEach((c, i) => c.setData(new Map(runs.map((r) => [r.id, data.get(r.id).get(keys[i]) || new Cols()]))));
    fill(summary, ...defs.map((d, i) => {
      const r = runs[i];
      return h("tr", { "data-run-id": r.id }, h("td", {}, swatch(d)),
        h("td", {}, h("a", { href: d.href }, runLabel(r))),
        h("td", { class: "nowrap" }, badge(r.status), " ", warningBadge(r.warnings)), h("td", {}, r.algorithm),
        h("td", { class: "mono small" }, r.spec.model),
        h("td", { class: "num", "data-testid": "compare-progress" }, progressText(r.progress)),
        keys.map((k) => h("td", { class: "num" }, fmtNum((data.get(r.id).get(k) || NO_COLS).last))));
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

/** The spec fields that differ between the runs, one column per run headed in its colour. */
function diffCard(runs, defs) {
  const rows = specDiff(runs);
  return h("section", { class: "card", "data-testid": "config-diff-card" }, h("h2", {}, "Config differences"),
    runs.length < 2 ? h("p", { class: "muted" }, "Add another run to see how their specs differ.")
      : !rows.length ? h("p", { class: "muted", "data-testid": "config-same" }, "Their specs are the same.")
        : h("div", { class: "scroll-x" }, h("table", { class: "table compact", "data-testid": "config-diff" },
          h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "Field"), defs.map((d) => h("th", { scope: "col",
            "data-run-id": d.id, "data-color": d.color, class: "diff-head", style: `border-top: 3px solid ${d.color}` }, swatch(d), " ", h("span", { class: "diff-run" }, d.label))))),
          h("tbody", {}, rows.map(([path, vals]) => h("tr", { "data-path": path, "data-testid": "diff-row" },
            h("td", { class: "mono small" }, path),
            vals.map((v) => h("td", { class: "mono small spec-value" }, specValue(v)))))))));
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
