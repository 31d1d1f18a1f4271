// kvproxy status page: polls api/status, draws tables and small SVG charts, sends admin actions.
// Vanilla JS, no dependencies. The admin token lives in sessionStorage (this tab only) and goes
// in the Authorization header, never in a URL.
"use strict";

const REFRESH_MS = 3000;
const TOKEN_KEY = "kvproxy.adminToken";
const OUTCOMES = ["hit", "restored", "base", "miss"];
const RESTORE_CHECK_RESET = "api/sessions/restore-check/reset";
const ROWS_STEP = 200;  // session rows drawn at first; laying out a thousand rows takes a while

const $ = (id) => document.getElementById(id);
const state = {
  token: sessionStorage.getItem(TOKEN_KEY) || "",
  tokenRequired: document.body.dataset.tokenRequired === "true",
  data: null,
  sortKey: "last_used",
  sortDir: -1,
  filter: "",
  rowsShown: ROWS_STEP,
  rendered: {},  // section -> JSON last drawn, so unchanged sections are not redrawn
  timer: null,
  runs: 0,  // a refresh started later wins; an older one neither draws nor reschedules
  offline: false,  // the message shows that kvproxy did not answer; cleared when it does
};

class NeedToken extends Error {}

// -- formatting ----------------------------------------------------------------
const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const esc = (value) => String(value ?? "").replace(/[&<>"']/g, (c) => ESCAPES[c]);

function bytes(n) {
  if (n == null) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i && n < 10 ? 1 : 0)} ${units[i]}`;
}
const NUMBER = new Intl.NumberFormat();
const num = (n) => (n == null ? "–" : NUMBER.format(n));
const pct = (r) => (r == null ? "–" : `${(r * 100).toFixed(1)}%`);

function ago(iso) {
  if (!iso) return "–";
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

function showMessage(text, isError) {
  state.offline = false;
  const box = $("message");
  box.textContent = text;
  box.className = isError ? "error" : "";
  box.hidden = !text;
}

// -- talking to kvproxy --------------------------------------------------------
async function api(method, path) {
  const headers = state.token ? { Authorization: `Bearer ${state.token}` } : {};
  const options = { method, headers, cache: "no-store", credentials: "omit" };
  if (method === "POST") {  // kvproxy takes admin POSTs as JSON only
    headers["Content-Type"] = "application/json";
    options.body = "{}";
  }
  const response = await fetch(path, options);
  if (response.status === 401) {
    forgetToken();
    throw new NeedToken("the admin token is missing or wrong");
  }
  return response;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.message || body.error || `HTTP ${response.status}`;
  } catch (_) {
    return `HTTP ${response.status}`;
  }
}

function askForToken(reason) {
  $("board").hidden = state.data == null;
  $("token-form").hidden = false;
  $("forget-token").hidden = true;
  if (reason) showMessage(reason, true);
  $("token").focus();
}

function forgetToken() {
  state.token = "";
  sessionStorage.removeItem(TOKEN_KEY);
}

async function refresh() {
  clearTimeout(state.timer);
  const run = ++state.runs;
  if (state.tokenRequired && !state.token) {
    askForToken("");
    return;
  }
  try {
    const response = await api("GET", "api/status");
    if (!response.ok) throw new Error(await errorText(response));
    const data = await response.json();
    if (run !== state.runs) return;
    state.data = data;
    $("token-form").hidden = true;
    $("forget-token").hidden = !state.token;
    $("board").hidden = false;
    if (state.offline) showMessage("");
    state.offline = false;
    render(state.data);
  } catch (err) {
    if (run !== state.runs) return;
    if (err instanceof NeedToken) { askForToken(err.message); return; }
    showMessage(`kvproxy did not answer: ${err.message}`, true);
    state.offline = true;
  }
  state.timer = setTimeout(refresh, REFRESH_MS);
}

async function act(method, path, done) {
  try {
    const response = await api(method, path);
    if (!response.ok) throw new Error(await errorText(response));
    showMessage(done, false);
  } catch (err) {
    if (err instanceof NeedToken) { askForToken(err.message); return; }
    showMessage(err.message, true);
  }
  refresh();
}

// -- drawing -------------------------------------------------------------------
function changed(section, value) {
  const json = JSON.stringify(value);
  if (state.rendered[section] === json) return false;
  state.rendered[section] = json;
  return true;
}

function render(data) {
  const llama = data.llama_server;
  const badge = $("llama");
  badge.textContent = `llama-server ${llama.status}`;
  badge.className = `badge ${llama.status === "ok" ? "ok" : "bad"}`;
  badge.title = llama.error || llama.url;
  $("model").textContent = [llama.model, llama.n_ctx && `ctx ${llama.n_ctx}`, llama.build]
    .filter(Boolean).join(" · ");
  $("updated").textContent = `updated ${new Date(data.generated_at).toLocaleTimeString()}`;
  if (changed("slots", data.slots)) renderSlots(data.slots);
  renderStats(data.stats);
  renderDisk(data.disk, data.store);
  renderRestoreCheck(data.restore_check);
  if (changed("timeline", data.timeline)) renderCharts(data.timeline);
  if (changed("swaps", data.swaps)) renderSwaps(data.swaps);
  if (changed("sessions", [data.sessions, state.sortKey, state.sortDir, state.filter, state.rowsShown])) {
    renderSessions(data.sessions || []);
  }
  if (changed("bases", data.bases)) renderBases(data.bases || []);
}

function renderSlots(slots) {
  $("slots").tBodies[0].innerHTML = slots.map((s) => `<tr data-slot="${s.id}">
    <td>${s.id}</td><td class="id session">${esc(s.session_id)}</td>
    <td><span class="badge ${s.busy ? "busy" : "idle"}">${s.busy ? "busy" : "idle"}</span></td>
    <td class="num">${num(s.tokens)}${s.n_ctx ? ` / ${num(s.n_ctx)}` : ""}</td>
    <td class="opt">${esc(ago(s.busy && s.busy_since ? s.busy_since : (s.last_used_at || s.since)))}</td>
    <td><button type="button" data-action="clear">Clear</button></td></tr>`).join("");
}

function figures(id, pairs) {
  $(id).innerHTML = pairs.map(([k, v]) => `<dt>${esc(k)}</dt><dd>${esc(v)}</dd>`).join("");
}

function renderStats(stats) {
  const o = stats.outcomes;
  figures("stats", [
    ["requests", `${num(stats.requests)} since ${new Date(stats.since).toLocaleString()}`],
    ["hit ratio", pct(stats.hit_ratio)],
    ["hit · restored", `${num(o.hit)} · ${num(o.restored)}`],
    ["base · miss", `${num(o.base)} · ${num(o.miss)}`],
    ["tokens reused", num(stats.tokens.reused)],
    ["tokens computed", num(stats.tokens.computed)],
    ["reuse", pct(stats.reuse_ratio)],
  ]);
}

function renderDisk(disk, store) {
  const share = disk.bound_bytes ? disk.used_bytes / disk.bound_bytes : 0;
  const fill = $("disk-fill");
  fill.style.width = `${Math.min(100, share * 100).toFixed(1)}%`;
  fill.classList.toggle("high", share > 0.9);
  $("disk-meter").hidden = !disk.bound_bytes;
  figures("disk", [
    ["slot files", `${bytes(disk.used_bytes)} in ${num(disk.files)} files`],
    ["stored as", disk.chunks ? `${num(disk.chunks)} shared chunks: ${bytes(disk.used_bytes)} for ` +
      `${bytes(disk.logical_bytes)} of sessions (${num(Math.round(disk.stored_ratio * 100))}%)` : "whole files"],
    ["written per save", disk.written_per_save == null ? "no save as chunks yet" :
      `${bytes(disk.written_per_save)} for ${bytes(disk.logical_per_save)} files (${num(disk.chunked_saves)} saves)`],
    ["bound", disk.bound_bytes ? `${bytes(disk.bound_bytes)} (${pct(share)} used)` : "none"],
    ["free", `${bytes(disk.free_bytes)} of ${bytes(disk.total_bytes)}`],
    ["kept free", disk.kept_free_bytes == null ? "none" : bytes(disk.kept_free_bytes)],
    ["saves dropped", num(disk.saves_dropped || 0)],
    ["problem", disk.problem || "none"],
    ["shared store", store ? `${store.url}: ${num(store.uploaded)} uploads (${bytes(store.uploaded_bytes)}), ` +
      `${num(store.waiting)} waiting, ${num(store.dropped)} dropped; ${num(store.fetched)} fetched, ` +
      `${num(store.fetch_failures)} failed` : "off"],
    ...(store && store.problem ? [["store problem", store.problem]] : []),
  ]);
}

function renderRestoreCheck(check) {
  let text;
  if (check.restoring_off) {
    text = `Restoring is switched off for this model since ${new Date(check.off_since).toLocaleString()}`
      + (check.off_until ? `, until ${new Date(check.off_until).toLocaleString()}.` : ".")
      + (check.cause ? ` Why: ${check.cause}.` : "");
  } else if (check.restoring_off == null) {
    text = "llama-server did not say which model runs.";
  } else {
    text = `Restoring is on: ${num(check.misses_in_a_row)} unhonoured restores in a row (switches off at ${check.limit || "never"}).`;
  }
  if (check.models_off && !check.restoring_off) text += ` Switched off for ${check.models_off} other model(s).`;
  $("restore-check").textContent = text;
}

function renderSwaps(swaps) {
  $("swaps").tBodies[0].innerHTML = swaps.length ? swaps.map((s) => `<tr>
    <td>${esc(new Date(s.at).toLocaleTimeString())}</td><td class="num">${num(s.slot)}</td>
    <td class="id">${esc(s.session_id)}</td>
    <td class="outcome-${esc(s.cache)}">${esc(s.cache)}</td><td class="num">${s.ms.toFixed(1)}</td>
    <td class="num opt">${num(s.restored_tokens)}</td></tr>`).join("")
    : `<tr><td colspan="6" class="muted">No swaps since kvproxy started.</td></tr>`;
}

function sortedSessions(rows) {
  const key = state.sortKey, dir = state.sortDir;
  const filter = state.filter.toLowerCase();
  const shown = filter ? rows.filter((r) => String(r.id).toLowerCase().includes(filter)) : rows.slice();
  shown.sort((a, b) => {
    const x = a[key] ?? "", y = b[key] ?? "";
    return (typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y))) * dir;
  });
  return shown;
}

function renderSessions(rows) {
  const matching = sortedSessions(rows);
  const shown = matching.slice(0, state.rowsShown);
  $("session-count").textContent = matching.length === rows.length ? `(${rows.length})` : `(${matching.length} of ${rows.length})`;
  const more = $("more-sessions");
  more.hidden = matching.length <= shown.length;
  more.textContent = `Show ${Math.min(ROWS_STEP, matching.length - shown.length)} more of ${matching.length - shown.length}`;
  for (const th of document.querySelectorAll("#sessions th[data-key]")) {
    th.classList.toggle("asc", th.dataset.key === state.sortKey && state.sortDir > 0);
    th.classList.toggle("desc", th.dataset.key === state.sortKey && state.sortDir < 0);
  }
  // One string, one innerHTML: a thousand rows draw in milliseconds.
  $("sessions").tBodies[0].innerHTML = shown.map((r) => `<tr>
    <td class="id" title="${esc(r.file)}">${esc(r.id)}${r.refused ? " ⚠" : ""}</td>
    <td class="num opt">${bytes(r.bytes)}</td><td class="num">${num(r.tokens)}</td>
    <td title="${esc(r.last_used)}">${esc(ago(r.last_used))}</td><td class="num opt">${num(r.hits)}</td>
    <td class="num opt">${num(r.restores)}</td><td class="opt outcome-${esc(r.last_cache)}">${esc(r.last_cache || "–")}</td>
    <td><button type="button" class="danger" data-action="delete" data-id="${esc(r.id)}">Delete</button></td>
    </tr>`).join("") || `<tr><td colspan="8" class="muted">No saved sessions.</td></tr>`;
}

function renderBases(rows) {
  $("base-count").textContent = `(${rows.length})`;
  $("bases").tBodies[0].innerHTML = rows.map((r) => `<tr><td class="id" title="${esc(r.file)}">${esc(r.system_hash)}</td>
    <td class="num opt">${bytes(r.bytes)}</td><td class="num">${num(r.tokens)}</td>
    <td>${esc(ago(r.last_used))}</td><td class="num">${num(r.restores)}</td></tr>`).join("")
    || `<tr><td colspan="5" class="muted">No base snapshots.</td></tr>`;
}

// A stacked bar per minute, drawn as SVG rectangles coloured by CSS class.
function barChart(buckets, series, unit) {
  const W = 600, H = 100, top = 6, bottom = 1, gap = 2;
  const max = Math.max(1, ...buckets.map((b) => series.reduce((t, k) => t + b[k], 0)));
  const width = W / buckets.length;
  let bars = "";
  buckets.forEach((b, i) => {
    let y = H - bottom;
    for (const k of series) {
      const h = (b[k] / max) * (H - top - bottom);
      if (h > 0) {
        y -= h;
        bars += `<rect class="c-${k}" x="${(i * width + gap / 2).toFixed(1)}" y="${y.toFixed(1)}" width="${(width - gap).toFixed(1)}" height="${h.toFixed(1)}"><title>${esc(new Date(b.t).toLocaleTimeString())} ${esc(k)}: ${b[k]}</title></rect>`;
      }
    }
  });
  const first = buckets.length ? new Date(buckets[0].t).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" }) : "";
  const legend = series.map((k) => `<span><span class="swatch c-${k}"></span>${esc(k)} ${num(buckets.reduce((t, b) => t + b[k], 0))}</span>`).join("");
  // The bars stretch to the card's width; the axis labels stay HTML so the text is not stretched.
  return `<div class="legend">${legend}<span>max ${num(max)} ${esc(unit)}/min</span></div>
    <svg viewBox="0 0 ${W} ${H}" preserveAspectRatio="none" role="img" aria-label="${esc(series.join(", "))} per minute">
    <line class="axis" x1="0" y1="${H - bottom}" x2="${W}" y2="${H - bottom}"/>${bars}</svg>
    <div class="axis-labels"><span>${esc(first)}</span><span>now</span></div>`;
}

function renderCharts(timeline) {
  $("outcome-chart").innerHTML = barChart(timeline, OUTCOMES, "requests");
  $("token-chart").innerHTML = barChart(timeline, ["reused", "computed"], "tokens");
}

// -- events ----------------------------------------------------------------------
function wire() {
  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    state.token = $("token").value;
    sessionStorage.setItem(TOKEN_KEY, state.token);
    $("token").value = "";
    showMessage("");
    refresh();
  });
  $("forget-token").addEventListener("click", () => { forgetToken(); state.data = null; $("board").hidden = true; refresh(); });
  $("filter").addEventListener("input", (event) => {
    state.filter = event.target.value;
    state.rowsShown = ROWS_STEP;
    if (state.data) render(state.data);
  });
  $("more-sessions").addEventListener("click", () => {
    state.rowsShown += ROWS_STEP;
    if (state.data) render(state.data);
  });
  document.querySelector("#sessions thead").addEventListener("click", (event) => {
    const key = event.target.dataset && event.target.dataset.key;
    if (!key) return;
    state.sortDir = key === state.sortKey ? -state.sortDir : (key === "id" ? 1 : -1);
    state.sortKey = key;
    if (state.data) render(state.data);
  });
  $("sessions").addEventListener("click", (event) => {
    const button = event.target.closest("button[data-action=delete]");
    if (!button) return;
    const id = button.dataset.id;
    if (!confirm(`Delete the saved session "${id}"? Its cache is lost.`)) return;
    act("DELETE", `api/sessions/${encodeURIComponent(id)}`, `Deleted session ${id}.`);
  });
  $("slots").addEventListener("click", (event) => {
    const button = event.target.closest("button[data-action=clear]");
    if (!button) return;
    const slot = Number(button.closest("tr").dataset.slot);
    if (!Number.isInteger(slot)) return;
    if (!confirm(`Clear slot ${slot}? The session it holds is saved first.`)) return;
    act("POST", `api/sessions/clear?slot=${slot}`, `Slot ${slot} cleared.`);
  });
  $("reset-restore-check").addEventListener("click", () => act("POST", RESTORE_CHECK_RESET, "Restore check reset."));
  document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(); });
}

wire();
refresh();
