// OpenRL dashboard: plain JS over the JSON API under /api/openrl/v1, no libraries, nothing
// fetched from elsewhere. The API key lives in localStorage and goes in the X-API-Key header
// of every call, exactly as the CLI sends it: a tenant's key shows its own runs, the
// operator's key every tenant's. Charts are inline SVG drawn here; each chart's <svg> carries
// data-points (how many points it drew) and each point data-x / data-y, for tests and people.
// The live stream is the server-sent events route read through fetch (EventSource cannot
// send the key header); it reconnects with Last-Event-ID where the server ended it.
"use strict";

const API = "/api/openrl/v1";
const KEY = "openrl.apiKey";
const SVG = "http://www.w3.org/2000/svg";
const state = { runId: null, stream: null, refreshTimer: null, pending: null, steps: 0, runStatus: null };

const $ = (id) => document.getElementById(id);
const key = () => localStorage.getItem(KEY) || "";
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(child == null ? "" : String(child)));
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
  if (text != null) node.textContent = text;
  return node;
}

function say(text) {
  const box = $("message");
  box.textContent = text || "";
  box.hidden = !text;
}

class ApiError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
  }
}

async function api(path, options = {}) {
  const headers = Object.assign({ "X-API-Key": key() }, options.headers || {});
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  const body = options.body !== undefined ? JSON.stringify(options.body) : undefined;
  const response = await fetch(API + path, { method: options.method || "GET", headers, body, signal: options.signal });
  if (!response.ok) {
    let detail = response.statusText;
    try {
      const data = await response.json();
      detail = typeof data.detail === "string" ? data.detail : JSON.stringify(data.detail);
    } catch (_) { /* not JSON */ }
    throw new ApiError(response.status, detail);
  }
  return options.raw ? response : response.json();
}

const when = (iso) => (iso ? new Date(iso).toLocaleString() : "");
const bytes = (n) => (n >= 1 << 20 ? `${(n / (1 << 20)).toFixed(1)} MiB` : n >= 1024 ? `${(n / 1024).toFixed(1)} KiB` : `${n} B`);
function num(value) {
  if (value == null) return "–";
  const a = Math.abs(value);
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? value.toExponential(2) : String(+value.toPrecision(4));
}

// ---- runs and sessions -------------------------------------------------------------------

async function loadHome() {
  const [runs, sessions] = await Promise.all([api("/runs?limit=200"), api("/sessions?limit=100")]);
  $("runs-total").textContent = `(${runs.total})`;
  const body = $("runs-table").tBodies[0];
  body.replaceChildren(
    ...runs.runs.map((run) =>
      el("tr", { class: "link", "data-run-id": run.run_id, onclick: () => (location.hash = `#/runs/${encodeURIComponent(run.run_id)}`) },
        el("td", { class: "mono" }, run.run_id), el("td", {}, run.tenant),
        el("td", { class: "status" }, el("span", { class: `badge ${run.status}` }, run.status)),
        el("td", {}, run.base_model), el("td", {}, run.training === "lora" ? `LoRA r${run.lora_rank}` : "full"),
        el("td", { class: "steps" }, run.steps), el("td", {}, when(run.last_activity))))
  );
  $("runs-empty").hidden = runs.runs.length > 0;
  $("sessions-table").tBodies[0].replaceChildren(
    ...sessions.sessions.map((s) =>
      el("tr", { "data-session-id": s.session_id }, el("td", { class: "mono" }, s.session_id), el("td", {}, s.tenant), el("td", {}, s.status),
        el("td", {}, s.training_runs), el("td", {}, s.sampling_sessions), el("td", {}, when(s.created_at)), el("td", {}, when(s.last_heartbeat_at))))
  );
}

// ---- one run -----------------------------------------------------------------------------

const CHARTS = [
  ["loss", "loss", "loss (sum)"],
  ["grad_norm", "optim/grad_norm", "optim/grad_norm"],
  ["learning_rate", "learning_rate", "learning rate"],
  ["tokens", "tokens", "tokens per step"],
  ["step_seconds", "step_seconds", "step time (s)"],
  ["queue_wait_seconds", "queue_wait_seconds", "queue wait (s)"],
];

async function loadRun(runId) {
  const [shown, metricsText, sampling, timeline] = await Promise.all([
    api(`/runs/${encodeURIComponent(runId)}`),
    api(`/runs/${encodeURIComponent(runId)}/metrics`, { raw: true }).then((r) => r.text()),
    api(`/runs/${encodeURIComponent(runId)}/sampling`),
    api("/timeline?since=" + Math.floor(Date.now() / 1000 - 600)).catch(() => ({ available: false })),
  ]);
  if (runId !== state.runId) return;
  const run = shown.run;
  state.runStatus = run.status;
  $("run-id").textContent = run.run_id;
  $("run-status").textContent = run.status;
  $("run-status").className = `badge ${run.status}`;
  $("run-facts").textContent = [
    `tenant ${run.tenant}`, run.base_model, run.training === "lora" ? `LoRA rank ${run.lora_rank}` : "full fine-tuning",
    `${run.steps} steps`, `${shown.pending_requests} pending requests`, `created ${when(run.created_at)}`,
    `last activity ${when(run.last_activity)}`,
  ].join(" · ");
  $("run-cancel").disabled = !["active", "creating", "finished"].includes(run.status);
  const steps = metricsText.split("\n").filter((line) => line.trim()).map((line) => JSON.parse(line));
  state.steps = steps.length;
  if ($("fork-step").value === "") $("fork-step").value = String(steps.length);
  const charts = $("charts");
  charts.replaceChildren(
    ...CHARTS.map(([id, field, title]) => chart(id, title, steps.map((s) => ({ x: s.step, y: s[field] })), "step")),
    chart("sampling", "sampling tokens/s per step", (sampling.steps || []).map((s) => ({ x: s.step, y: s.tokens_per_second })), "step"),
    chart("sampling_requests", "sampling tokens/s per request", sampling.samples.map((s, i) => ({ x: i + 1, y: s.tokens_per_second })), "request")
  );
  $("checkpoints-table").tBodies[0].replaceChildren(
    ...shown.checkpoints.map((c) =>
      el("tr", {}, el("td", { class: "mono" }, c.tinker_path), el("td", {}, c.kind), el("td", {}, bytes(c.size_bytes)), el("td", {}, when(c.created_at)),
        el("td", {}, el("button", { type: "button", class: "download", onclick: () => download(c) }, "Download"))))
  );
  $("samplers-table").tBodies[0].replaceChildren(
    ...shown.sampling_sessions.map((s) => el("tr", {}, el("td", { class: "mono" }, s.sampling_session_id), el("td", {}, when(s.created_at)), el("td", {}, when(s.closed_at))))
  );
  drawTimeline(timeline, runId);
}

function chart(id, title, all, xName) {
  const points = all.filter((p) => typeof p.y === "number" && isFinite(p.y));
  const W = 320, H = 140, L = 46, R = 8, T = 8, B = 20;
  const box = svg("svg", { viewBox: `0 0 ${W} ${H}`, "data-chart": id, "data-points": points.length, role: "img", "aria-label": title });
  box.append(svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }), svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
  const last = points.length ? points[points.length - 1].y : null;
  if (!points.length) {
    box.append(svg("text", { x: L + 8, y: H / 2 }, all.length ? "not reported" : "no data yet"));
  } else {
    const xs = points.map((p) => p.x), ys = points.map((p) => p.y);
    let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
    const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R), sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
    box.append(svg("polyline", { class: "line", points: points.map((p) => `${sx(p.x).toFixed(1)},${sy(p.y).toFixed(1)}`).join(" ") }));
    for (const p of points) {
      const dot = svg("circle", { class: "pt", cx: sx(p.x).toFixed(1), cy: sy(p.y).toFixed(1), r: 2.5, "data-x": p.x, "data-y": p.y });
      dot.append(svg("title", {}, `${xName} ${p.x}: ${num(p.y)}`));
      box.append(dot);
    }
    box.append(svg("text", { x: 2, y: T + 8 }, num(y1)), svg("text", { x: 2, y: H - B }, num(y0)),
      svg("text", { x: L, y: H - 5 }, `${xName} ${x0}`), svg("text", { x: W - R, y: H - 5, "text-anchor": "end" }, `${x1}`));
  }
  return el("div", { class: "chart", id: `chart-${id}` }, el("h4", {}, el("span", {}, title), el("span", { class: "muted" }, num(last))), box);
}

function drawTimeline(timeline, runId) {
  const panel = $("timeline-panel");
  panel.hidden = !timeline.available;
  if (!timeline.available) return;
  const devices = Object.entries(timeline.devices);
  const now = Date.now() / 1000;
  const entries = devices.flatMap(([, items]) => items);
  const t0 = entries.length ? Math.min(...entries.map((e) => e.start)) : now - 60;
  const W = 900, row = 22, L = 70, H = devices.length * row + 18;
  const box = svg("svg", { viewBox: `0 0 ${W} ${H}`, "data-devices": devices.length });
  const sx = (t) => L + ((t - t0) / Math.max(now - t0, 1)) * (W - L - 6);
  devices.forEach(([device, items], i) => {
    box.append(svg("text", { x: 2, y: i * row + 15 }, device));
    for (const e of items) {
      const kind = e.kind !== "lease" ? e.kind : e.run_id === runId ? "this" : e.holder === "shared" || e.holder === "other" ? e.holder : "own";
      const rect = svg("rect", { class: kind, x: sx(e.start).toFixed(1), y: i * row + 4, width: Math.max(sx(e.end) - sx(e.start), 1).toFixed(1), height: row - 8 });
      rect.append(svg("title", {}, `${e.kind} ${e.run_id || e.job || e.holder} ${(e.end - e.start).toFixed(3)} s${e.reason ? " (" + e.reason + ")" : ""}`));
      box.append(rect);
    }
  });
  box.append(svg("text", { x: L, y: H - 3 }, new Date(t0 * 1000).toLocaleTimeString()), svg("text", { x: W - 6, y: H - 3, "text-anchor": "end" }, "now"));
  $("timeline").replaceChildren(box);
}

async function download(checkpoint) {
  try {
    const response = await api(`/checkpoints/archive?path=${encodeURIComponent(checkpoint.tinker_path)}`, { raw: true });
    const match = /filename="([^"]+)"/.exec(response.headers.get("Content-Disposition") || "");
    const url = URL.createObjectURL(await response.blob());
    const link = el("a", { href: url, download: match ? match[1] : "checkpoint.tar" });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
  } catch (error) {
    say(`Download failed: ${error.message}`);
  }
}

// ---- live events -------------------------------------------------------------------------

function showEvent(event) {
  const list = $("events");
  const phase = event.name.split(".").pop();
  const fields = Object.entries(event.fields).filter(([name]) => name !== "request_id")
    .map(([name, value]) => `${name}=${typeof value === "object" ? JSON.stringify(value) : value}`).join(" ");
  // Keys are the run or one of its sampling sessions: "<session>:train:0", "<session>:sample:1".
  const where = (event.key || "").split(":").slice(-2).join(":");
  const item = el("li", { class: phase, "data-position": event.position, "data-name": event.name, title: `${event.type} ${event.key || ""} ${fields}` },
    `${new Date(event.time).toLocaleTimeString()} `, el("span", { class: "name" }, event.name), ` ${where} ${fields}`);
  list.prepend(item);
  while (list.children.length > 500) list.lastElementChild.remove();
  if (/optim_step\.completed|run\.cancelled|checkpoint|sample\.completed|save_weights/.test(event.name)) refreshSoon();
}

function refreshSoon() {
  clearTimeout(state.pending);
  state.pending = setTimeout(() => state.runId && loadRun(state.runId).catch(report), 300);
}

async function follow(runId, signal) {
  let last = null;
  const live = $("live");
  while (!signal.aborted) {
    try {
      const headers = { "X-API-Key": key(), Accept: "text/event-stream" };
      if (last !== null) headers["Last-Event-ID"] = String(last);
      const response = await fetch(`${API}/runs/${encodeURIComponent(runId)}/events?history=100`, { headers, signal });
      if (!response.ok) {
        live.textContent = `○ offline (HTTP ${response.status})`;
        if (response.status >= 400 && response.status < 500) return;
      } else {
        live.textContent = "● live";
        live.className = "live on";
        const reader = response.body.getReader();
        const decoder = new TextDecoder();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += decoder.decode(value, { stream: true });
          let end;
          while ((end = buffer.indexOf("\n\n")) >= 0) {
            const block = buffer.slice(0, end);
            buffer = buffer.slice(end + 2);
            let data = "";
            for (const line of block.split("\n")) {
              if (line.startsWith("id:")) last = line.slice(3).trim();
              else if (line.startsWith("data:")) data += line.slice(5).trim();
            }
            if (data) showEvent(JSON.parse(data));
          }
        }
      }
    } catch (error) {
      if (signal.aborted) return;
    }
    live.textContent = "○ reconnecting";
    live.className = "live";
    await sleep(1000);
  }
}

// ---- actions -----------------------------------------------------------------------------

function actionSay(...parts) { $("action-message").replaceChildren(...parts); }

let confirmUntil = 0;
async function cancelRun() {
  const button = $("run-cancel");
  if (Date.now() > confirmUntil) {
    confirmUntil = Date.now() + 5000;
    button.textContent = "Really cancel?";
    setTimeout(() => { if (Date.now() > confirmUntil) button.textContent = "Cancel run"; }, 5100);
    return;
  }
  confirmUntil = 0;
  button.textContent = "Cancel run";
  try {
    const answer = await api(`/runs/${encodeURIComponent(state.runId)}/cancel`, { method: "POST", body: { reason: "cancelled from the dashboard" } });
    actionSay(`Cancelled: ${answer.cancelled_requests} pending requests failed, ${answer.closed_sampling_sessions.length} sampling sessions closed.`);
  } catch (error) {
    actionSay(`Cancel refused (HTTP ${error.status}): ${error.message}`);
  }
  await loadRun(state.runId).catch(report);
}

async function forkRun() {
  const step = Number($("fork-step").value);
  if (!Number.isInteger(step) || step < 0) return actionSay("Fork: the step must be a whole number, 0 or more.");
  try {
    const answer = await api(`/runs/${encodeURIComponent(state.runId)}/fork`, { method: "POST", body: { step } });
    const failed = answer.error ? `, failed: ${answer.error}` : "";
    actionSay(`Forked at step ${step}: `, el("a", { id: "fork-run", class: "mono", href: `#/runs/${encodeURIComponent(answer.run_id)}` }, answer.run_id),
      ` (${answer.status}${failed}); its state: `, el("span", { id: "fork-path", class: "mono" }, answer.tinker_path));
    loadHome().catch(report);
  } catch (error) {
    actionSay(`Fork refused (HTTP ${error.status}): ${error.message}`);
  }
}

// ---- navigation --------------------------------------------------------------------------

function report(error) {
  if (error instanceof ApiError && error.status === 401) {
    say(`The server refused the API key: ${error.message}. Enter a tenant's key, or the operator's.`);
    $("api-key").focus();
  } else {
    say(`Error: ${error.message}`);
  }
}

function stopRun() {
  if (state.stream) state.stream.abort();
  clearInterval(state.refreshTimer);
  state.stream = null;
  state.runId = null;
}

async function route() {
  stopRun();
  const match = /^#\/runs\/(.+)$/.exec(location.hash);
  if (!key()) {
    say("Enter an API key to see your runs (a tenant's key shows its own; the operator's key shows every tenant's).");
    return;
  }
  say("");
  $("home").hidden = !!match;
  $("run").hidden = !match;
  if (!match) {
    state.refreshTimer = setInterval(() => loadHome().catch(report), 5000);
    return loadHome().catch(report);
  }
  state.runId = decodeURIComponent(match[1]);
  $("events").replaceChildren();
  $("fork-step").value = "";
  actionSay("");
  const controller = new AbortController();
  state.stream = controller;
  state.refreshTimer = setInterval(() => loadRun(state.runId).catch(report), 10000);
  try {
    await loadRun(state.runId);
  } catch (error) {
    report(error);
    return;
  }
  follow(state.runId, controller.signal);
}

document.addEventListener("DOMContentLoaded", () => {
  $("api-key").value = key();
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    localStorage.setItem(KEY, $("api-key").value.trim());
    route();
  });
  $("key-forget").addEventListener("click", () => {
    localStorage.removeItem(KEY);
    $("api-key").value = "";
    route();
  });
  $("run-cancel").addEventListener("click", cancelRun);
  $("run-fork").addEventListener("click", forkRun);
  window.addEventListener("hashchange", route);
  route();
});
