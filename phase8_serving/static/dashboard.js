/*
 * mini-vllm's dashboard: draws the engine's state, one frame at a time.
 *
 * A frame is one engine snapshot (phase8_serving/snapshot.py describes its fields): the
 * requests and their progress, the last step's batch, the KV cache's map, and, live, the
 * serving numbers of the last minute. Frames come from one of two places:
 *   - live (`mini-vllm serve`): server-sent events from /dashboard/events, a few a second;
 *   - replay (`mini-vllm replay TRACE.json`): every step of a recorded trace from
 *     /dashboard/frames, shown one at a time with a slider (?step=N opens at step N).
 * GET /dashboard/info says which. Everything is drawn from the current frame alone, except
 * the history strip and the preemption log, which remember earlier frames.
 *
 * The KV map has two kinds (the lesson of phases 4 and 5):
 *   - "slot" (phase 4): each sequence holds one contiguous region of token slots, partly used;
 *     the gaps between regions are free but may be too small for anyone (fragmentation);
 *   - "block" (phase 5 on): fixed-size blocks, run-length encoded as
 *     [count, owner seq_id or null, ref_cnt, cached]; a block with ref_cnt > 1 is shared by
 *     several requests (a common prompt prefix), a free block with cached = 1 still holds a
 *     prefix-cache entry until it is evicted for reuse.
 * Plain DOM and canvas, no libraries.
 */
"use strict";

const HISTORY_LENGTH = 120;  // steps in the history strip
const REPLAY_FRAME_MS = 80;  // replay speed when playing
const COLORS = { free: "#e9ecf2", cached: "#c4c9d4", shared: "#6b3fa0",
                 prefill: "#3b7dd8", decode: "#2ea66b" };

const $ = (id) => document.getElementById(id);
const stepHistory = [];    // [{prefill, decode, budget, total}] of recent frames
let preemptionLog = [];    // [{step, count, ids}]
let previousPreemptions = null;

// One color per request, stable across frames: hues a golden angle apart.
function requestColor(seqId, alpha = 1) {
  return `hsla(${(seqId * 137.508) % 360}, 62%, 52%, ${alpha})`;
}

function formatSeconds(s) {
  if (s === null || s === undefined) return "–";
  return s < 1 ? `${(s * 1000).toFixed(1)} ms` : `${s.toFixed(2)} s`;
}

// Sets a card's text, and its raw value as data-value (what the browser test reads).
function setValue(id, text, raw) {
  const el = $(id);
  el.textContent = text;
  el.dataset.value = raw === null || raw === undefined ? "" : String(raw);
}

function render(frame) {
  setValue("step", String(frame.step), frame.step);
  setValue("num-running", String(frame.num_running), frame.num_running);
  setValue("num-waiting", String(frame.num_waiting), frame.num_waiting);
  setValue("num-swapped", String(frame.num_swapped), frame.num_swapped);
  setValue("kv-usage", `${(100 * frame.kv_usage).toFixed(1)}%`, frame.kv_usage);
  setValue("preemptions", String(frame.num_preemptions), frame.num_preemptions);
  const slots = frame.state_slots;  // a hybrid model's DeltaNet state pool; null for others
  setValue("state-slots", slots ? `${slots.held} / ${slots.total}` : "–", slots && slots.held);
  const cache = frame.prefix_cache;  // prompt tokens looked up and found, since the start
  const hitRate = cache && cache.queries ? cache.hits / cache.queries : null;
  setValue("prefix-hits", hitRate === null ? "–" : `${(100 * hitRate).toFixed(1)}%`, hitRate);
  const serving = frame.serving;  // live only: a trace records no latencies
  setValue("tok-s", serving ? serving.output_tok_s.toFixed(1) : "–", serving && serving.output_tok_s);
  setValue("ttft", formatSeconds(serving && serving.ttft_s), serving && serving.ttft_s);
  setValue("tpot", formatSeconds(serving && serving.tpot_s), serving && serving.tpot_s);
  setValue("generated", serving ? String(serving.generation_tokens) : "–",
           serving && serving.generation_tokens);
  renderBatch(frame.batch);
  renderKvMap(frame.kv);
  renderRequests(frame);
}

// -- the last step's batch -----------------------------------------------------------------

function renderBatch(batch) {
  // A trace does not record the budget: scale to the largest step seen instead.
  const budget = batch.token_budget || Math.max(1, ...stepHistory.map((h) => h.total),
                                                batch.prefill_tokens + batch.decode_tokens);
  const [prefillDiv, decodeDiv] = $("budget-bar").children;
  prefillDiv.style.width = `${(100 * batch.prefill_tokens) / budget}%`;
  decodeDiv.style.width = `${(100 * batch.decode_tokens) / budget}%`;
  $("batch-text").textContent =
    `${batch.prefill_tokens} prefill + ${batch.decode_tokens} decode tokens` +
    (batch.token_budget ? ` of a ${batch.token_budget}-token budget` : "") +
    `, ${batch.num_seqs} sequences`;
  $("budget-bar").dataset.prefill = batch.prefill_tokens;
  $("budget-bar").dataset.decode = batch.decode_tokens;
}

function drawHistory() {
  const canvas = $("history");
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const top = Math.max(1, ...stepHistory.map((h) => h.budget || h.total));
  const width = canvas.width / HISTORY_LENGTH;
  stepHistory.forEach((h, i) => {
    const x = i * width;
    const prefill = (canvas.height * h.prefill) / top;
    const decode = (canvas.height * h.decode) / top;
    ctx.fillStyle = COLORS.decode;
    ctx.fillRect(x, canvas.height - decode, width - 1, decode);
    ctx.fillStyle = COLORS.prefill;
    ctx.fillRect(x, canvas.height - decode - prefill, width - 1, prefill);
  });
}

function remember(frame) {
  const b = frame.batch;
  stepHistory.push({ prefill: b.prefill_tokens, decode: b.decode_tokens, budget: b.token_budget,
                 total: b.prefill_tokens + b.decode_tokens });
  if (stepHistory.length > HISTORY_LENGTH) stepHistory.shift();
  // Frames may skip steps (live, a few a second): count preemptions from the running total.
  if (previousPreemptions !== null && frame.num_preemptions > previousPreemptions) {
    preemptionLog.push({ step: frame.step, count: frame.num_preemptions - previousPreemptions,
                         ids: frame.preempted });
  }
  previousPreemptions = frame.num_preemptions;
  drawHistory();
  renderPreemptions();
}

function renderPreemptions() {
  const list = $("preemption-log");
  list.replaceChildren(...preemptionLog.slice(-50).reverse().map((p) => {
    const li = document.createElement("li");
    const who = p.ids.length ? `: ${p.ids.map(shortId).join(", ")}` : "";
    li.textContent = `step ${p.step}: ${p.count} preempted${who}`;
    return li;
  }));
  if (!preemptionLog.length) list.innerHTML = "<li>none yet</li>";
}

// -- the KV cache map ----------------------------------------------------------------------

// One entry per cell: {kind, color, text, ...} (text is what hovering over the cell says).
function kvCells(kv) {
  const cells = [];
  if (kv.unit === "slot") {  // phase 4: contiguous regions of token slots
    let cursor = 0;
    const free = (n) => {
      for (let i = 0; i < n; i++) cells.push({ kind: "free", color: COLORS.free, text: "free slot" });
    };
    for (const [seqId, start, capacity, used] of kv.regions) {
      free(start - cursor);
      for (let i = 0; i < capacity; i++) {
        const inUse = i < used;
        cells.push({ kind: inUse ? "used" : "reserved", owner: seqId,
                     color: requestColor(seqId, inUse ? 1 : 0.3),
                     text: `slot ${start + i}: request ${seqId}, ` +
                       (inUse ? "holds a token" : "reserved, still empty") });
      }
      cursor = start + capacity;
    }
    free(kv.num_slots - cursor);
    return cells;
  }
  let blockId = 0;  // phase 5 on: blocks, run-length encoded
  for (const [count, owner, refCnt, cached] of kv.runs) {
    for (let i = 0; i < count; i++, blockId += kv.stride) {
      const where = `block ${blockId}${cached ? ", in the prefix cache" : ""}`;
      if (refCnt === 0) {
        cells.push({ kind: cached ? "cached" : "free", color: cached ? COLORS.cached : COLORS.free,
                     text: `${where}: free${cached ? " (evictable, can still be hit)" : ""}` });
      } else if (refCnt > 1) {
        cells.push({ kind: "shared", ref: refCnt, color: COLORS.shared,
                     text: `${where}: shared by ${refCnt} requests` });
      } else {
        cells.push({ kind: "held", owner, cached, color: requestColor(owner),
                     text: `${where}: request ${owner}` });
      }
    }
  }
  return cells;
}

let hoverCells = [];
let cellSize = 10;
let columns = 1;

function renderKvMap(kv) {
  const cells = kvCells(kv);
  const canvas = $("kv-map");
  columns = cells.length <= 64 ? cells.length : cells.length <= 1024 ? 64 : 128;
  cellSize = Math.max(4, Math.min(28, Math.floor(canvas.width / columns)));
  canvas.height = Math.ceil(cells.length / columns) * cellSize;
  const ctx = canvas.getContext("2d");
  cells.forEach((cell, i) => {
    const x = (i % columns) * cellSize, y = Math.floor(i / columns) * cellSize;
    ctx.fillStyle = cell.color;
    ctx.fillRect(x, y, cellSize - 1, cellSize - 1);
    if (cell.kind === "shared" && cellSize >= 12) {  // the ref count, where it fits
      ctx.fillStyle = "#fff";
      ctx.font = `${cellSize - 4}px sans-serif`;
      ctx.fillText(String(cell.ref), x + 2, y + cellSize - 3);
    }
    if (cell.kind === "held" && cell.cached) {  // a corner mark: also in the prefix cache
      ctx.fillStyle = "rgba(255,255,255,.8)";
      ctx.fillRect(x, y, Math.max(2, cellSize / 4), Math.max(2, cellSize / 4));
    }
  });
  hoverCells = cells;
  renderKvLegend(kv, cells);
}

function renderKvLegend(kv, cells) {
  const counts = {};
  for (const c of cells) counts[c.kind] = (counts[c.kind] || 0) + 1;
  const legend = $("kv-legend");
  const entry = (kind, color, label) =>
    `<span data-kind="${kind}" data-count="${counts[kind] || 0}"><span class="swatch" ` +
    `style="background:${color}"></span>${label}: ${counts[kind] || 0}</span>`;
  if (kv.unit === "slot") {
    legend.innerHTML = entry("used", requestColor(1), "slots holding a token") +
      entry("reserved", requestColor(1, 0.3), "reserved, empty") +
      entry("free", COLORS.free, "free") +
      `<span>${kv.num_slots} token slots, one contiguous region per request</span>`;
    return;
  }
  const sampled = kv.stride > 1 ? ` (every ${kv.stride}th block shown)` : "";
  legend.innerHTML = entry("held", requestColor(1), "held by one request") +
    entry("shared", COLORS.shared, "shared (number: ref_cnt)") +
    entry("cached", COLORS.cached, "free, still cached") +
    entry("free", COLORS.free, "free") +
    `<span>${kv.num_blocks} blocks of ${kv.block_size} tokens${sampled}</span>`;
}

$("kv-map").addEventListener("mousemove", (event) => {
  const rect = event.target.getBoundingClientRect();
  const col = Math.floor((event.clientX - rect.left) / cellSize);
  const row = Math.floor((event.clientY - rect.top) / cellSize);
  const cell = col < columns ? hoverCells[row * columns + col] : undefined;
  $("kv-hover").textContent = cell ? cell.text : "\u00a0";
});

// -- requests ------------------------------------------------------------------------------

function shortId(id) {  // "chatcmpl-3f2a…9c1d-0" keeps both ends of a long id
  return id.length > 18 ? `${id.slice(0, 12)}…${id.slice(-5)}` : id;
}

function progress(done, total, color) {
  const pct = total ? Math.min(100, (100 * done) / total) : 0;
  return `<span class="progress"><div style="width:${pct}%;background:${color}"></div></span> ` +
    `${done} / ${total}`;
}

function renderRequests(frame) {
  const rows = frame.requests.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.status = r.status;
    tr.dataset.seqId = r.seq_id;
    const promptDone = Math.min(r.computed_tokens, r.prompt_tokens);
    tr.innerHTML =
      `<td title="${r.id}"><span class="swatch" style="background:${requestColor(r.seq_id)}"></span>` +
      `${shortId(r.id)}</td><td class="status-${r.status}">${r.status}</td>` +
      `<td class="num">${progress(promptDone, r.prompt_tokens, COLORS.prefill)}</td>` +
      `<td class="num">${progress(r.output_tokens, r.max_tokens, COLORS.decode)}</td>` +
      `<td class="num">${r.kv_held}</td>`;
    return tr;
  });
  $("requests").replaceChildren(...rows);
  const total = frame.num_running + frame.num_swapped + frame.num_waiting;
  $("requests-note").textContent = total > rows.length
    ? `${rows.length} of ${total} requests listed` : "";
}

// -- where frames come from ----------------------------------------------------------------

// The page's own path, so that behind a proxy's prefix (--root-path /llm: /llm/dashboard) its
// requests go where it came from.
const BASE = location.pathname.replace(/\/+$/, "");

function startLive(info) {
  $("source").textContent = `live: ${info.model}`;
  const events = new EventSource(`${BASE}/events`);
  events.onopen = () => { $("status").textContent = "live"; };
  events.onerror = () => { $("status").textContent = "disconnected, retrying…"; };
  events.onmessage = (message) => {
    const frame = JSON.parse(message.data);
    remember(frame);
    render(frame);
  };
}

async function startReplay(info) {
  $("source").textContent = `replay: ${info.trace}`;
  document.body.classList.add("replay");  // a trace records no latencies: hide those cards
  const frames = await (await fetch(`${BASE}/frames`)).json();
  const slider = $("slider");
  $("replay-controls").style.display = "flex";
  slider.max = String(frames.length - 1);
  // The history and the log show the frames up to the one on screen.
  const show = (i) => {
    stepHistory.length = 0;
    preemptionLog = [];
    previousPreemptions = null;
    frames.slice(Math.max(0, i - HISTORY_LENGTH * 4), i + 1).forEach(remember);
    render(frames[i]);
    slider.value = String(i);
    $("slider-label").textContent = `step ${frames[i].step} of ${frames[frames.length - 1].step}`;
  };
  slider.addEventListener("input", () => show(Number(slider.value)));
  let timer = null;
  $("play").addEventListener("click", () => {
    if (timer !== null) {
      clearInterval(timer);
      timer = null;
      $("play").textContent = "▶ play";
      return;
    }
    $("play").textContent = "❚❚ pause";
    timer = setInterval(() => {
      const next = Number(slider.value) + 1;
      if (next >= frames.length) { $("play").click(); return; }
      show(next);
    }, REPLAY_FRAME_MS);
  });
  const asked = Number(new URLSearchParams(location.search).get("step"));
  const start = frames.findIndex((f) => f.step >= asked);
  show(start >= 0 ? start : frames.length - 1);
  $("status").textContent = `${frames.length} steps recorded`;
}

async function main() {
  const info = await (await fetch(`${BASE}/info`)).json();
  // The key, if one was given in the address, now lives in a cookie: drop it from the bar.
  const params = new URLSearchParams(location.search);
  if (params.has("key")) {
    params.delete("key");
    const rest = params.toString();
    window.history.replaceState(null, "", location.pathname + (rest ? `?${rest}` : ""));
  }
  if (info.mode === "replay") await startReplay(info); else startLive(info);
}

main().catch((error) => { $("status").textContent = `error: ${error}`; });
