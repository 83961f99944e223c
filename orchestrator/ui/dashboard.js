// The dashboard: the caller's jobs (GET /v1/jobs), one job's live events (GET /v1/jobs/{id}/events, read with
// fetch so the API key travels in a header, which EventSource cannot send) and the KV pools over time
// (GET /v1/pool). Plain DOM, no build step.
"use strict";

const state = { jobId: null, threads: new Map(), events: [], kv: [], stream: null, ratio: 1 };
const $ = (id) => document.getElementById(id);

function apiKey() { return sessionStorage.getItem("thinkpool-key") || ""; }
function headers() { const key = apiKey(); return key ? { "X-API-Key": key } : {}; }

async function getJSON(path) {
  const response = await fetch(path, { headers: headers() });
  if (!response.ok) throw new Error(`${path}: ${response.status}`);
  return response.json();
}

function setStatus(text) { $("status").textContent = text; }

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

// -- the jobs list ---------------------------------------------------------------------------------------------
async function refreshJobs() {
  try {
    const jobs = await getJSON("/v1/jobs?limit=50");
    const body = $("jobs").tBodies[0];
    body.replaceChildren();
    for (const job of jobs) {
      const row = body.insertRow();
      row.dataset.job = job.id;
      row.className = "job-row" + (job.id === state.jobId ? " selected" : "");
      cell(row, job.id, "mono");
      cell(row, job.state, "state-" + job.state);
      cell(row, `${job.samples} × ${job.task || "default"}`);
      cell(row, job.answer ?? "");
      row.onclick = () => { location.hash = "job=" + job.id; };
    }
    $("no-jobs").hidden = jobs.length > 0;
    setStatus(`${jobs.length} jobs · updated ${new Date().toLocaleTimeString()}`);
  } catch (error) {
    setStatus(String(error.message).includes("401") ? "this API key is not accepted" : String(error));
  }
}

// -- one job ---------------------------------------------------------------------------------------------------
function thread(sample) {
  if (!state.threads.has(sample)) {  // its ratio: the request's, or the controller's current round's
    state.threads.set(sample, { sample, text: "", tokens: 0, cr: state.ratio, realized: null, answer: null, done: false });
  }
  return state.threads.get(sample);
}

function onEvent(name, data) {
  if (name === "tokens") {
    const t = thread(data.sample);
    t.text += data.text;
    t.tokens = data.tokens;
  } else if (name === "thread") {
    Object.assign(thread(data.sample), { tokens: data.tokens, cr: data.cr, realized: data.realized_cr, answer: data.answer, done: true });
  } else if (["plan", "replan", "round", "escalation"].includes(name)) {
    state.events.push({ name, ...data });
    if (name === "round") state.ratio = data.cr;
  } else if (name === "votes") {
    $("answer").textContent = "answer: " + (data.answer ?? "none");
  } else if (name === "state" || name === "done") {
    $("job-state").textContent = data.state;
    $("job-state").className = "state-" + data.state;
  }
  scheduleRender();
}

let renderPending = false;
function scheduleRender() {
  if (!renderPending) { renderPending = true; requestAnimationFrame(() => { renderPending = false; renderJob(); }); }
}

function renderJob() {
  const body = $("threads").tBodies[0];
  body.replaceChildren();
  const threads = [...state.threads.values()].sort((a, b) => a.sample - b.sample);
  for (const t of threads) {
    const row = body.insertRow();
    row.className = "thread-row" + (t.done ? " finished" : " decoding");
    row.dataset.sample = t.sample;
    row.dataset.tokens = t.tokens;
    cell(row, t.sample);
    cell(row, t.cr == null ? "" : `${t.cr}x`);
    cell(row, t.tokens, "tokens");
    cell(row, t.realized == null ? "" : `${t.realized.toFixed(2)}x`);
    cell(row, t.done ? (t.answer ?? "none") : "…", "answer");
    cell(row, t.text.slice(-80), "mono tail");
  }
  const finished = threads.filter((t) => t.done);
  $("thread-count").textContent = `${finished.length} finished, ${threads.length - finished.length} decoding`;
  renderVotes(finished);
  $("events").replaceChildren(...state.events.map((e) => {
    const li = document.createElement("li");
    li.className = "event-" + e.name;
    const detail = e.name === "escalation" ? (e.cr ? `to ${e.cr}x, ` : "") + `${e.more_threads} more threads`
      : `${e.threads} thread(s) at ${e.cr}x${e.greedy ? ", greedy" : ""}` + (e.signal != null ? `, signal ${e.signal}` : "");
    li.textContent = `${e.name}: ${detail}`;
    return li;
  }));
}

function renderVotes(finished) {
  const counts = new Map();
  for (const t of finished) if (t.answer != null) counts.set(t.answer, (counts.get(t.answer) || 0) + 1);
  const total = Math.max(1, ...counts.values());
  const body = $("votes").tBodies[0];
  body.replaceChildren();
  for (const [answer, count] of [...counts].sort((a, b) => b[1] - a[1])) {
    const row = body.insertRow();
    row.className = "vote-row";
    row.dataset.answer = answer;
    cell(row, answer, "mono");
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.style.width = `${(100 * count) / total}%`;
    row.insertCell().append(bar);
    cell(row, count);
  }
}

async function follow(jobId) {
  if (state.stream) state.stream.abort();
  Object.assign(state, { jobId, threads: new Map(), events: [], ratio: 1 });
  $("no-job").hidden = !!jobId;
  $("job-body").hidden = !jobId;
  $("job-id").textContent = jobId || "";
  $("answer").textContent = "";
  if (!jobId) return;
  try {
    const job = await getJSON(`/v1/jobs/${jobId}`);
    $("job-prompt").textContent = job.request.prompt;
    state.ratio = job.request.cr ?? 1;
    onEvent("state", { state: job.state });
  } catch (error) { setStatus(String(error)); return; }
  const controller = new AbortController();
  state.stream = controller;
  readEvents(jobId, controller.signal).catch((error) => { if (!controller.signal.aborted) setStatus(String(error)); });
}

async function readEvents(jobId, signal) {
  const response = await fetch(`/v1/jobs/${jobId}/events`, { headers: headers(), signal });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {  // one server-sent event per blank-line-terminated block
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) name = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (data) onEvent(name, JSON.parse(data));
    }
  }
}

// -- the KV pools over time ------------------------------------------------------------------------------------
async function sampleKV() {
  try {
    const pool = await getJSON("/v1/pool");
    state.kv = [...state.kv, pool].slice(-180);
    drawKV();
  } catch (error) { /* the jobs list reports access problems */ }
}

function drawKV() {
  const canvas = $("kv");
  canvas.dataset.samples = state.kv.length;
  const g = canvas.getContext("2d");
  const { width, height } = canvas;
  g.clearRect(0, 0, width, height);
  if (!state.kv.length) return;
  const capacity = Math.max(...state.kv.map((p) => p.pool_bytes), 1);
  const x = (i) => (i / Math.max(1, state.kv.length - 1)) * (width - 2) + 1;
  const y = (bytes) => height - 1 - (bytes / capacity) * (height - 2);
  for (const [field, color] of [["pool_peak_bytes", "#c0392b"], ["pool_used_bytes", "#2f6fd6"]]) {
    g.beginPath();
    state.kv.forEach((p, i) => (i ? g.lineTo(x(i), y(p[field])) : g.moveTo(x(i), y(p[field]))));
    g.strokeStyle = color;
    g.lineWidth = 2;
    g.stroke();
  }
  const last = state.kv[state.kv.length - 1];
  const mb = (bytes) => (bytes / 1e6).toFixed(2) + " MB";
  $("kv-now").textContent = `in use ${mb(last.pool_used_bytes)} · peak ${mb(last.pool_peak_bytes)} · pool ${mb(last.pool_bytes)}`;
}

// -- wiring ----------------------------------------------------------------------------------------------------
function fromHash() {
  const match = location.hash.match(/job=([\w-]+)/);
  follow(match ? match[1] : null);
  refreshJobs();
}

$("key").value = apiKey();
$("key").onchange = () => { sessionStorage.setItem("thinkpool-key", $("key").value.trim()); fromHash(); };
window.addEventListener("hashchange", fromHash);
fromHash();
setInterval(refreshJobs, 2000);
setInterval(sampleKV, 500);
sampleKV();
