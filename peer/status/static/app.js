"use strict";
const POLL_MS = 2000;
const FETCH_TIMEOUT_MS = 4500;  // above the server's 3 s bound on /peers
const STALE_PEER_S = 120;
const MAX_PEER_ROWS = 300;
const COLORS = { loss: "#0b7285", sent: "#e8590c", recv: "#1971c2", grid: "#e9edf2",
                 axis: "#6b7785", text: "#6b7785", others: "#ced4da" };
const SWARM_POLL_MS = 10000;  // the daemon samples the swarm every 15 s
const SWARM_COLOURED = 8;  // peers drawn in colour and named in the legend, this one first
const SWARM_LIVE_S = 60;  // a series whose last point is older than this: the peer left
// This peer's colour first, then colours far apart for the others.
const SWARM_PALETTE = ["#0b7285", "#e8590c", "#7048e8", "#2b8a3e", "#d6336c", "#1971c2",
                       "#f59f00", "#495057"];

const $ = (id) => document.getElementById(id);
const state = { status: null, peers: null, history: [], swarm: null, swarmAt: 0, lastOk: null,
                polls: 0 };

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v === undefined || v === null) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("data-") || k === "title") node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c);
  return node;
}
const isNum = (v) => typeof v === "number" && Number.isFinite(v);
function fmtNum(v, digits) {
  if (!isNum(v)) return "—";
  return v.toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: 0 });
}
function fmtLoss(v) {
  if (!isNum(v)) return "—";
  const a = Math.abs(v);
  return a !== 0 && (a < 0.001 || a >= 1e5) ? v.toExponential(3) : v.toFixed(4);
}
function fmtBytes(n) {
  if (!isNum(n)) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(n < 10 ? 2 : 1)) + " " + units[i];
}
const fmtRate = (n) => (isNum(n) ? fmtBytes(n) + "/s" : "—");
function fmtDuration(s) {
  if (!isNum(s)) return "—";
  s = Math.max(0, Math.floor(s));
  const d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600);
  const m = Math.floor(s % 3600 / 60), sec = s % 60;
  const pad = (x) => String(x).padStart(2, "0");
  if (d) return `${d}d ${h}h`;
  if (h) return `${h}h ${pad(m)}m`;
  if (m) return `${m}m ${pad(sec)}s`;
  return `${sec}s`;
}
function fmtAgo(t) {
  if (!isNum(t)) return "—";
  const s = Date.now() / 1000 - t;
  return s < 2 ? "now" : fmtDuration(s) + " ago";
}
const shortId = (id, head = 12, tail = 6) => (typeof id === "string" && id.length > head + tail + 2
  ? id.slice(0, head) + "…" + id.slice(-tail) : String(id ?? "—"));
const fmtClock = (t) => new Date(t * 1000).toLocaleTimeString("en-GB", { hour12: false });

// --- charts -------------------------------------------------------------------------------

function niceStep(span, count) {
  const raw = span / Math.max(1, count);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const norm = raw / mag;
  return (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
}
function ticks(lo, hi, count) {
  if (!(hi > lo)) return [lo];
  const step = niceStep(hi - lo, count);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(v);
  return out;
}

// series: [{points: [[x, y], ...], color, fill}]; returns the number of points drawn.
function drawChart(canvas, series, opts) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr)) canvas.width = Math.round(w * dpr);
  if (canvas.height !== Math.round(h * dpr)) canvas.height = Math.round(h * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "11px system-ui, sans-serif";
  const all = series.flatMap((s) => s.points);
  if (all.length < 1) {
    ctx.fillStyle = COLORS.text;
    ctx.textAlign = "center";
    ctx.fillText(opts.empty, w / 2, h / 2);
    return 0;
  }
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (opts.zeroBased) y0 = Math.min(0, y0);
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
  else { const pad = (y1 - y0) * 0.06; y1 += pad; if (!opts.zeroBased) y0 -= pad; }
  const yAxis = opts.yAxis ? opts.yAxis(y0, y1) : { ticks: ticks(y0, y1, 5), format: fmtAxis };
  const yTicks = yAxis.ticks, yFormat = yAxis.format;
  const left = 12 + Math.max(...yTicks.map((v) => ctx.measureText(yFormat(v)).width));
  const right = 12, top = 10, bottom = 24;
  const px = (x) => left + (x - x0) / (x1 - x0) * (w - left - right);
  const py = (y) => top + (1 - (y - y0) / (y1 - y0)) * (h - top - bottom);

  ctx.lineWidth = 1;
  ctx.strokeStyle = COLORS.grid;
  ctx.fillStyle = COLORS.text;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const v of yTicks) {
    if (v < y0 || v > y1) continue;
    const y = Math.round(py(v)) + 0.5;
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(w - right, y); ctx.stroke();
    ctx.fillText(yFormat(v), left - 6, y);
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  const xTicks = ticks(x0, x1, Math.max(2, Math.floor((w - left) / 90)));
  for (const v of xTicks) {
    if (v < x0 || v > x1) continue;
    const x = Math.round(px(v)) + 0.5;
    ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, h - bottom); ctx.stroke();
    const label = opts.xFormat(v), half = ctx.measureText(label).width / 2;
    if (x - half >= 0 && x + half <= w) ctx.fillText(label, x, h - bottom + 6);
  }
  ctx.strokeStyle = COLORS.axis;
  ctx.beginPath(); ctx.moveTo(left, h - bottom + 0.5); ctx.lineTo(w - right, h - bottom + 0.5);
  ctx.stroke();

  let drawn = 0;
  for (const s of series) {
    if (!s.points.length) continue;
    ctx.lineJoin = "round";
    if (s.fill) {
      ctx.beginPath();
      ctx.moveTo(px(s.points[0][0]), py(Math.max(y0, 0)));
      for (const [x, y] of s.points) ctx.lineTo(px(x), py(y));
      ctx.lineTo(px(s.points[s.points.length - 1][0]), py(Math.max(y0, 0)));
      ctx.closePath();
      ctx.fillStyle = s.fill;
      ctx.fill();
    }
    ctx.strokeStyle = s.color;
    ctx.lineWidth = s.width ?? 2;
    ctx.setLineDash(s.dash ?? []);
    ctx.beginPath();
    s.points.forEach(([x, y], i) => (i ? ctx.lineTo(px(x), py(y)) : ctx.moveTo(px(x), py(y))));
    ctx.stroke();
    ctx.setLineDash([]);
    if (s.markers || s.points.length === 1) {  // a single point: a dot, or nothing would show
      const r = s.markers ? s.markers : 3;
      for (const [x, y] of s.markers ? s.points : s.points.slice(0, 1)) {
        ctx.beginPath(); ctx.arc(px(x), py(y), r, 0, 2 * Math.PI);
        ctx.fillStyle = s.color; ctx.fill();
        if (s.markers) { ctx.lineWidth = 1.5; ctx.strokeStyle = "#fff"; ctx.stroke(); }
      }
    }
    drawn += s.points.length;
  }
  return drawn;
}

function lossPoints(history) {
  const withLoss = history.filter((p) => isNum(p.loss));
  const byStep = withLoss.length > 0 && withLoss.every((p) => isNum(p.step));
  return { byStep, points: withLoss.map((p) => [byStep ? p.step : p.t, p.loss]) };
}

// Bytes/s between consecutive samples; a counter going down means the daemon restarted.
function bandwidthPoints(history) {
  const sent = [], recv = [];
  for (let i = 1; i < history.length; i++) {
    const a = history[i - 1], b = history[i], dt = b.t - a.t;
    if (!(dt > 0)) continue;
    const ds = b.bytes_sent - a.bytes_sent, dr = b.bytes_received - a.bytes_received;
    if (isNum(ds) && ds >= 0) sent.push([b.t, ds / dt]);
    if (isNum(dr) && dr >= 0) recv.push([b.t, dr / dt]);
  }
  return { sent, recv };
}

function drawCharts() {
  const history = state.history;
  const loss = lossPoints(history);
  const lossCanvas = $("loss-curve");
  $("loss-axis").textContent = loss.byStep || !loss.points.length ? "by step" : "by time";
  lossCanvas.dataset.points = drawChart(
    lossCanvas,
    [{ points: loss.points, color: COLORS.loss, fill: "rgba(11, 114, 133, 0.08)" }],
    { empty: "waiting for the first training step…",
      xFormat: loss.byStep ? (v) => fmtNum(v, 0) : fmtClock });
  const bw = bandwidthPoints(history);
  const bwCanvas = $("bandwidth");
  bwCanvas.dataset.points = drawChart(
    bwCanvas,
    [{ points: bw.sent, color: COLORS.sent }, { points: bw.recv, color: COLORS.recv }],
    { empty: "waiting for two samples…", zeroBased: true, yAxis: rateAxis,
      xFormat: fmtClock });
  setText("rate-sent", fmtRate(bw.sent.at(-1)?.[1]));
  setText("rate-received", fmtRate(bw.recv.at(-1)?.[1]));
  if (loss.points.length >= 2) {
    const first = loss.points[0][1], last = loss.points.at(-1)[1];
    $("loss-sub").textContent = `${last <= first ? "▼" : "▲"} from ${fmtLoss(first)}`;
  }
}
// /swarm as one entry per peer: its training loss and validation loss over time (a
// validation loss is repeated in every report until the next: drawn where it changed).
function swarmPeers(swarm) {
  const series = swarm && swarm.peers && typeof swarm.peers === "object" ? swarm.peers : {};
  const self = swarm ? String(swarm.self) : "";
  const peers = Object.entries(series).filter(([, pts]) => Array.isArray(pts)).map(([id, pts]) => {
    const train = [], val = [];
    let lastVal = null, lastT = -Infinity, lastStep = null;
    for (const p of pts) {
      if (!p || !isNum(p.t)) continue;
      lastT = Math.max(lastT, p.t);
      if (isNum(p.step)) lastStep = p.step;
      if (isNum(p.loss)) train.push([p.t, p.loss]);
      if (isNum(p.val_loss) && p.val_loss !== lastVal) val.push([p.t, p.val_loss]);
      if (isNum(p.val_loss)) lastVal = p.val_loss;
    }
    return { id, self: id === self, train, val, lastT, step: lastStep,
             loss: train.at(-1)?.[1], valLoss: lastVal };
  });
  const newest = Math.max(-Infinity, ...peers.map((p) => p.lastT));
  for (const p of peers) p.left = !p.self && newest - p.lastT > SWARM_LIVE_S;
  // This peer, then the peers still reporting, furthest trained first: a stable order.
  peers.sort((a, b) => (b.self - a.self) || (a.left - b.left)
    || (isNum(b.step) ? b.step : -1) - (isNum(a.step) ? a.step : -1) || a.id.localeCompare(b.id));
  return peers;
}

function drawSwarm() {
  const peers = swarmPeers(state.swarm);
  const coloured = peers.slice(0, SWARM_COLOURED);
  const others = peers.slice(SWARM_COLOURED);
  let palette = 1;
  for (const p of coloured) p.color = p.self ? SWARM_PALETTE[0] : SWARM_PALETTE[palette++];
  for (const p of others) p.color = COLORS.others;
  // Drawn bottom up: the others in grey, the named peers, this peer; validation on top.
  const order = [...others, ...coloured.filter((p) => !p.self), ...coloured.filter((p) => p.self)];
  const series = [
    ...order.map((p) => ({ points: p.train, color: p.color, width: p.self ? 3 : 1.5 })),
    ...order.map((p) => ({ points: p.val, color: p.color, dash: [5, 4], width: 1.5,
                           markers: p.self ? 4.5 : 3.5 })),
  ];
  const canvas = $("swarm-curve");
  drawChart(canvas, series, { empty: "waiting for the swarm's reports (sampled every 15 s)…",
                              xFormat: fmtClock });
  canvas.dataset.peers = String(peers.filter((p) => p.train.length || p.val.length).length);
  canvas.dataset.points = String(peers.reduce((n, p) => n + p.train.length, 0));
  canvas.dataset.valPoints = String(peers.reduce((n, p) => n + p.val.length, 0));
  const items = coloured.map((p) => {
    const swatch = el("i");
    swatch.style.background = p.color;
    const item = el("li", { "data-peer-id": p.id,
                            title: p.id + (p.left ? " (stopped reporting)" : ""),
                            class: [p.self ? "self" : "", p.left ? "left" : ""].join(" ").trim() },
      swatch, el("span", { class: "mono", text: p.self ? "this peer" : peerTail(p.id) }),
      " ", el("b", { text: fmtLoss(p.loss) }));
    if (isNum(p.valLoss)) item.append(" · val ", el("b", { text: fmtLoss(p.valLoss) }));
    if (p.left) item.append(" · left");
    return item;
  });
  if (others.length) {
    const swatch = el("i");
    swatch.style.background = COLORS.others;
    items.push(el("li", { class: "others", "data-count": String(others.length),
                          title: others.map((p) => p.id).join("\n") },
      swatch, `+${others.length} other peer${others.length > 1 ? "s" : ""}`));
  }
  $("swarm-legend").replaceChildren(...items);
  const live = peers.filter((p) => !p.left).length;
  setText("swarm-aside", peers.length
    ? `${live} reporting` + (peers.length > live ? `, ${peers.length - live} left` : "")
    : "every peer's reports over time");
}

// Ticks at round numbers of KiB/MiB/..., not at round numbers of bytes (976.6 KiB/s).
function byteUnit(v) {
  let unit = 1;
  while (Math.abs(v) >= 1024 * unit && unit < 1024 ** 4) unit *= 1024;
  return unit;
}
const UNIT_NAMES = { 1: "B", 1024: "KiB", [1024 ** 2]: "MiB", [1024 ** 3]: "GiB",
                     [1024 ** 4]: "TiB" };
function rateAxis(lo, hi) {  // every label in the unit of the largest value
  const unit = byteUnit(hi);
  return { ticks: ticks(lo / unit, hi / unit, 4).map((v) => v * unit),
           format: (v) => `${fmtAxis(v / unit)} ${UNIT_NAMES[unit]}/s` };
}
function fmtAxis(v) {
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 1e4 || a < 1e-3) return v.toExponential(1);
  return String(Number(v.toPrecision(4)));
}

// --- sections -----------------------------------------------------------------------------

function setText(id, text) { $(id).textContent = text; }

// "cuda · NVIDIA A100 · 9.1 GiB of 80 GiB · MFU 41%": where this peer trains.
function deviceText(s) {
  const d = s.device;
  if (!d || typeof d !== "object") return "this peer";
  const parts = [d.kind, d.name];
  if (d.kind !== "cpu" && typeof d.memory_total_bytes === "number") {
    parts.push(`${fmtBytes(d.memory_used_bytes)} of ${fmtBytes(d.memory_total_bytes)}`);
  }
  if (typeof s.mfu === "number") parts.push(`MFU ${(100 * s.mfu).toFixed(1)}%`);
  return parts.filter((x) => typeof x === "string" && x).join(" · ");
}

// "round 12 · committed 8 s ago": where the swarm's shared state is, and when it moved.
function swarmRound(s) {
  if (!isNum(s.outer_step)) return "";
  const ago = isNum(s.last_commit_at)
    ? ` · committed ${fmtDuration(Math.max(0, Date.now() / 1000 - s.last_commit_at))} ago` : "";
  return `round ${fmtNum(s.outer_step, 0)}${ago}`;
}

// Audits this peer ran, who is banned (with the accusers), and whether we are on probation.
function renderVerification(v) {
  const box = $("verification");
  box.hidden = !v || typeof v !== "object";
  if (box.hidden) return;
  const audits = v.enabled
    ? `${fmtNum(v.audits_done ?? 0, 0)} audits · ${fmtNum(v.audits_failed ?? 0, 0)} failed`
      + (v.probation ? " · on probation" : "")
    : "off for this experiment";
  setText("audits", audits);
  $("self-convicted").hidden = !v.convicted_self;
  const convictions = Array.isArray(v.convictions) ? v.convictions : [];
  $("bans").tBodies[0].replaceChildren(...convictions.map((c) =>
    el("tr", { "data-peer-id": String(c.peer) },
      el("td", { class: "mono peer", title: String(c.peer), text: shortId(String(c.peer), 8, 4) }),
      el("td", { class: "num", text: fmtNum(c.round, 0) }),
      el("td", { class: "mono", text: (Array.isArray(c.accusers) ? c.accusers : [])
        .map((a) => shortId(String(a), 4, 4)).join(", ") }))));
  $("bans-empty").hidden = convictions.length > 0;
}

// What this peer found wrong with its own machine, with what to do about it.
const CLOCK_LIMIT_S = 30;
function renderAttention(s) {
  const problems = [];
  if (isNum(s.clock_skew_s) && Math.abs(s.clock_skew_s) > CLOCK_LIMIT_S) {
    const off = `${s.clock_skew_s > 0 ? "+" : ""}${fmtNum(s.clock_skew_s, 0)} s`;
    problems.push(["clock", `This machine's clock is ${off} off its peers': rounds and DHT`
      + ` records need clocks within ${CLOCK_LIMIT_S} s. Enable time synchronization`
      + " (NTP, e.g. timedatectl set-ntp true)."]);
  }
  if (typeof s.checkpoint_error === "string" && s.checkpoint_error) {
    problems.push(["checkpoint", "Checkpoints are not written (training goes on, the last"
      + ` good one is kept): ${s.checkpoint_error}`]);
  }
  $("attention").hidden = problems.length === 0;
  $("attention-list").replaceChildren(...problems.map(([kind, text]) =>
    el("li", { "data-problem": kind, text })));
}

// Peers refused for an incompatible protocol version, and what to do about them.
function renderVersions(s) {
  const seen = Array.isArray(s.version_mismatches) ? s.version_mismatches : [];
  const box = $("version-mismatches");
  box.hidden = seen.length === 0;
  if (box.hidden) return;
  const refused = s.version_mismatches_total;
  setText("version-mismatches-count", `this peer speaks protocol ${s.protocol_version ?? "?"}`
    + ` · ${fmtNum(refused, 0)} connection${refused === 1 ? "" : "s"} refused`);
  const upgrade = seen.some((m) => String(m.action ?? "").startsWith("upgrade this peer"));
  setText("version-advice", upgrade
    ? "Peers run a newer shoal that this one cannot talk to: upgrade this peer"
      + " (pip install -U shoal) and restart it."
    : "Peers run an older shoal that cannot talk to this one: they must upgrade;"
      + " nothing to do here.");
  const now = Date.now() / 1000;
  $("mismatches").tBodies[0].replaceChildren(...seen.map((m) =>
    el("tr", { "data-peer-id": String(m.peer_id) },
      el("td", { class: "mono peer", title: String(m.peer_id),
                 text: shortId(String(m.peer_id), 8, 4) }),
      el("td", { text: String(m.theirs ?? "?") }),
      el("td", { text: String(m.software ?? "") }),
      el("td", { class: "num", text: fmtNum(m.count, 0) }),
      el("td", { class: "num", text: isNum(m.last_seen)
        ? fmtDuration(Math.max(0, now - m.last_seen)) + " ago" : "—" }),
      el("td", { text: String(m.action ?? "") }))));
}

// A pipelined experiment: each stage, its peers (ours marked) and what they can take,
// drawn as columns of peer boxes; links between them move with the microbatch flow.
function renderPipeline(p, self, convicted) {
  const box = $("pipeline");
  box.hidden = !p || typeof p !== "object";
  if (box.hidden) return;
  const role = [p.stage === null || p.stage === undefined ? null : `serving stage ${p.stage}`,
    p.trainer ? "training" : null].filter(Boolean).join(" · ");
  setText("pipeline-role", p.role === "monitor" ? "monitor: serves no stage, drives no microbatch"
    : `${role} · ${fmtNum(p.microbatches ?? 0, 0)} microbatches`);
  const stages = Array.isArray(p.stages) ? p.stages : [];
  $("stages").tBodies[0].replaceChildren(...stages.map((st) => {
    const ids = Array.isArray(st.peer_ids) ? st.peer_ids.map(String) : [];
    return el("tr", { "data-stage": String(st.stage) },
      el("td", { class: "num", text: fmtNum(st.stage, 0) }),
      el("td", { class: "num", text: fmtNum(st.peers, 0) }),
      el("td", { class: "num", text: fmtNum(st.throughput, 1) }),
      el("td", { class: "mono", text: ids.map((id) => shortId(id, 4, 4)
        + (id === self ? " (this peer)" : "")).join(", ") || "nobody" }),
      stageState(st));
  }));
  drawPipeline(p, stages, self, convicted);
}

// A stage that lost its state (`lost`: every peer gone, no checkpoint restored it) or
// came back from a checkpoint (`restored`): pipeline/stage_losses.py.
function stageState(st) {
  const lost = st.lost && typeof st.lost === "object" ? st.lost : null;
  const back = st.restored && typeof st.restored === "object" ? st.restored : null;
  if (lost) {
    return el("td", { class: "stage-state", "data-lost": String(lost.version) },
      el("span", { class: "badge bad", text: `lost at version ${fmtNum(lost.version, 0)}` }),
      ` · ${fmtAgo(lost.since)}`);
  }
  if (back) {
    const gone = isNum(back.lost_version) && back.lost_version > back.version
      ? ` (steps ${fmtNum(back.version, 0)}–${fmtNum(back.lost_version - 1, 0)} lost)` : "";
    return el("td", { class: "stage-state", "data-restored": String(back.version) },
      el("span", { class: "badge warn", text: `restored at version ${fmtNum(back.version, 0)}` }),
      gone);
  }
  return el("td", { class: "stage-state", text: "" });
}

const STALE_RECORD_S = 35;  // a stage record is refreshed every 15 s

function flowLink(rate) {  // forward dots left to right, backward right to left
  const link = el("div", { class: "pipe-link", title: isNum(rate)
    ? `${fmtNum(rate, 1)} requests/s (forward and backward)` : "no flow measured here" });
  for (const dir of ["fwd", "back"]) {
    const lane = el("i", { class: dir + (isNum(rate) && rate > 0 ? " live" : "") });
    // Faster with more flow: 2.4 s per dot at 1 request/s, 0.3 s at 64.
    if (isNum(rate) && rate > 0) {
      lane.style.animationDuration = `${Math.min(3, Math.max(0.3, 2.4 / Math.sqrt(rate)))}s`;
    }
    link.append(lane);
  }
  return link;
}

// Peer IDs all start alike (12D3KooW...): their ends tell them apart, as in the logs.
const peerTail = (id) => (id.length > 10 ? "…" + id.slice(-8) : id);

function peerBox(srv, self, convicted, maxFlow) {
  const id = String(srv.peer_id);
  const stale = !isNum(srv.age_s) || srv.age_s > STALE_RECORD_S;
  const classes = ["peer-box", srv.self || id === self ? "self" : "", stale ? "stale" : "",
    srv.banned ? "banned" : "", convicted.has(id) ? "convicted" : ""];
  const head = el("div", { class: "id", title: id, text: peerTail(id) });
  if (srv.self || id === self) head.append(el("span", { class: "badge you", text: "this peer" }));
  if (convicted.has(id)) head.append(el("span", { class: "badge bad", text: "convicted" }));
  if (srv.banned) {
    head.append(el("span", { class: "badge warn", text: `banned ${fmtNum(srv.ban_s, 0)} s`,
                             title: "a request to it failed: this trainer routes around it" }));
  }
  if (stale) head.append(el("span", { class: "badge", text: "silent" }));
  const row = (label, value, title) => el("div", { class: "row", title },
    el("span", { text: label }), el("b", { text: value }));
  const measured = isNum(srv.measured) ? ` (${fmtNum(srv.measured, 0)} here)` : "";
  const queue = fmtNum(srv.queue, 0) + (isNum(srv.in_flight) ? ` · ${srv.in_flight} ours` : "");
  const share = isNum(srv.flow) && maxFlow > 0 ? Math.round(100 * srv.flow / maxFlow) : 0;
  const bar = el("div", { class: "bar" }, el("span"));
  bar.firstChild.style.width = `${share}%`;
  return el("div", { class: classes.filter(Boolean).join(" "), "data-peer-id": id,
                     "data-flow": isNum(srv.flow) ? srv.flow.toFixed(2) : null },
    head,
    row("samples/s", fmtNum(srv.throughput, 0) + measured,
        "training samples/s the peer measures on its work (what this trainer measures)"),
    row("queue", queue, "requests waiting at the peer (this trainer's in flight to it)"),
    row("version", fmtNum(srv.version, 0), "optimizer steps of the stage it serves"),
    row("flow", isNum(srv.flow) ? `${fmtNum(srv.flow, 1)} req/s` : "—",
        "forward and backward requests per second between it and this peer"),
    bar);
}

function drawPipeline(p, stages, self, convicted) {
  const drawing = $("pipeline-drawing");
  const flow = p.flow && typeof p.flow === "object" ? p.flow : {};
  const stageFlow = new Map((Array.isArray(flow.stages) ? flow.stages : [])
    .map((f) => [f.stage, f.requests_per_s]));
  const parts = [];
  let peers = 0;
  if (p.trainer) {
    parts.push(el("div", { class: "pipe-col ends" },
      el("h3", { text: "this trainer" }),
      el("div", { class: "peer-box self" },
        el("div", { class: "row" }, el("span", { text: "microbatches/s" }),
          el("b", { text: fmtNum(flow.microbatches_per_s, 1) })),
        el("div", { class: "row" }, el("span", { text: "samples/s" }),
          el("b", { text: fmtNum(flow.samples_per_s, 1) })))));
  }
  stages.forEach((st, i) => {
    const servers = Array.isArray(st.servers) ? st.servers : [];
    const flows = servers.map((s) => (isNum(s.flow) ? s.flow : 0));
    const maxFlow = Math.max(0, ...flows);
    let rate = stageFlow.get(st.stage);
    if (!isNum(rate) && servers.some((s) => isNum(s.flow))) rate = flows.reduce((a, b) => a + b, 0);
    if (p.trainer || i > 0) parts.push(flowLink(rate));
    const col = el("div", { class: "pipe-col stage-column", "data-stage": String(st.stage) },
      el("h3", { text: `stage ${fmtNum(st.stage, 0)}` },
        el("small", { text: `${fmtNum(st.peers, 0)} peers · ${fmtNum(st.throughput, 0)} samples/s`
          + (isNum(st.version) ? ` · v${st.version}` : "") })));
    const ids = Array.isArray(st.peer_ids) ? st.peer_ids : [];
    const shown = servers.length ? servers
      : ids.map((id) => ({ peer_id: id, self: id === self, age_s: 0 }));
    for (const srv of shown) col.append(peerBox(srv, self, convicted, maxFlow));
    if (!shown.length) col.append(el("div", { class: "pipe-empty", text: "nobody serves it" }));
    peers += shown.length;
    parts.push(col);
  });
  if (p.trainer && stages.length) parts.push(flowLink(stageFlow.get(stages.at(-1).stage)));
  if (p.trainer) {
    parts.push(el("div", { class: "pipe-col ends" }, el("h3", { text: "loss" }),
      el("div", { class: "peer-box self" }, el("div", { class: "row" },
        el("span", { text: "this trainer" }), el("b", { text: fmtLoss(state.status?.loss) })))));
  }
  drawing.replaceChildren(...parts);
  drawing.dataset.stages = String(stages.length);
  drawing.dataset.peers = String(peers);
  setText("pipeline-flow", isNum(flow.microbatches_per_s)
    ? `${fmtNum(flow.microbatches_per_s, 1)} microbatches/s over the last `
      + `${fmtNum(flow.window_s, 0)} s`
    : p.trainer || isNum(p.stage) ? "" : "the stages' records only: trainers and stage peers "
      + "show the flow through them");
  const bans = Array.isArray(p.bans) ? p.bans : [];
  const inPipeline = new Set(stages.flatMap((st) => (Array.isArray(st.servers) ? st.servers : [])
    .map((s) => String(s.peer_id))));
  const convictedHere = [...convicted].filter((id) => inPipeline.has(id));
  $("pipeline-bans").replaceChildren(
    ...bans.map((b) => el("li", { "data-peer-id": String(b.peer_id), class: "routing" },
      "routing around ", el("span", { class: "mono", title: String(b.peer_id),
                                      text: peerTail(String(b.peer_id)) }),
      ` (stage ${fmtNum(b.stage, 0)}) for ${fmtNum(b.ban_s, 0)} s more: a request to it failed`)),
    ...convictedHere.map((id) => el("li", { "data-peer-id": id, class: "convicted" },
      el("span", { class: "mono", title: id, text: peerTail(id) }),
      " is convicted (verification): banned")));
}

function renderStatus(s) {
  setText("peer-id", s.peer_id ?? "—");
  setText("experiment", s.experiment ?? "none yet");
  setText("version", [s.strategy, s.task].filter((x) => typeof x === "string").join(" · ")
    || (s.experiment ? "" : "join or host one with shoal run"));
  setText("shoal-version", [s.version ? "v" + s.version : "",
    s.protocol_version ? `protocol ${s.protocol_version}` : ""].filter(Boolean).join(" · "));
  renderVersions(s);
  renderAttention(s);
  setText("swarm-round", swarmRound(s));
  const join = typeof s.join_command === "string" ? s.join_command : "";
  $("join-box").hidden = !join;
  setText("join-command", join);
  setText("step", fmtNum(s.step, 0));
  setText("loss", fmtLoss(s.loss));
  setText("val-loss", isNum(s.val_loss) ? `validation ${fmtLoss(s.val_loss)}`
    : s.pipeline || !s.experiment ? "" : "validation after the first round");
  setText("tokens-per-s", fmtNum(s.tokens_per_s, 1));
  setText("device", deviceText(s));
  setText("reachability", s.reachability ?? "unknown");
  setText("dht-peers", `${fmtNum(s.dht_peers, 0)} peers in the DHT`);
  const access = s.access || {};
  setText("access", !access.mode || access.mode === "open" ? "open swarm"
    : `private (${access.mode}), ${fmtNum(access.refusals, 0)} refused`);
  setText("total-sent", `(${fmtBytes(s.bytes_sent)} in all)`);
  setText("total-received", `(${fmtBytes(s.bytes_received)} in all)`);
  setText("uptime", fmtDuration(s.uptime_s));
  document.title = `shoal · step ${fmtNum(s.step, 0)} · ${shortId(s.peer_id)}`;

  const conns = Array.isArray(s.connections) ? s.connections : [];
  const tbody = $("connections").tBodies[0];
  tbody.replaceChildren(...conns.map((c) => el("tr", { "data-peer-id": c.peer_id },
    el("td", { class: "mono peer", title: c.peer_id, text: shortId(c.peer_id, 8, 4) }),
    el("td", {}, el("span", { class: "badge " + String(c.kind), text: String(c.kind) })),
    el("td", { class: "num", text: fmtBytes(c.bytes_sent) }),
    el("td", { class: "num", text: fmtBytes(c.bytes_received) }))));
  $("connections-empty").hidden = conns.length > 0;
  setText("connections-count", conns.length ? String(conns.length) : "");

  const addrs = Array.isArray(s.addresses) ? s.addresses : [];
  $("addresses").replaceChildren(...(addrs.length
    ? addrs.map((a) => el("li", { text: String(a) }))
    : [el("li", { class: "empty", text: "none yet" })]));

  renderVerification(s.verification);
  const v = s.verification;
  const convicted = new Set(v && Array.isArray(v.banned) ? v.banned.map(String) : []);
  const audits = s.pipeline && s.pipeline.audits;  // stage peers this trainer's audits convicted
  for (const id of audits && Array.isArray(audits.convicted) ? audits.convicted : [])
    convicted.add(String(id));
  renderPipeline(s.pipeline, s.peer_id, convicted);

  const box = $("last-round");
  const r = s.last_round;
  const title = el("h2", { text: "Last averaging round" });
  if (!r) {
    box.replaceChildren(title, el("div", { class: "empty", text: "no round yet" }));
  } else {
    const good = r.outcome === "committed";
    title.append(el("span", { class: "badge " + (good ? "good" : "bad"),
                              text: String(r.outcome ?? "?") }));
    box.replaceChildren(title, el("dl", { class: "kv" },
      el("dt", { text: "group" }), el("dd", { text: `${fmtNum(r.group_size, 0)} peers` }),
      el("dt", { text: "duration" }), el("dd", { text: `${fmtNum(r.duration_s, 2)} s` }),
      el("dt", { text: "fingerprint" }),
      el("dd", { class: "mono", text: r.fingerprint ?? "—" })));
  }

  const config = s.config && typeof s.config === "object" ? Object.entries(s.config) : [];
  $("config-box").hidden = config.length === 0;
  $("config").replaceChildren(...config.flatMap(([k, v]) =>
    [el("dt", { text: k }), el("dd", { text: String(v) })]));
}

// A multiaddr may wrap after a "/" only (<wbr> is not copied with the text).
const breakable = (text) => text.split(/(?<=\/)/).flatMap((part) => [part, el("wbr")]);

function renderPeers(peers) {
  const rows = [...peers].sort((a, b) => (b.self === true) - (a.self === true)
    || (isNum(b.step) ? b.step : -1) - (isNum(a.step) ? a.step : -1)
    || String(a.peer_id).localeCompare(String(b.peer_id)));
  const now = Date.now() / 1000;
  $("peers").tBodies[0].replaceChildren(...rows.slice(0, MAX_PEER_ROWS).map((p) => {
    const addrs = Array.isArray(p.addresses) ? p.addresses.map(String) : [];
    // The ID is in the first column already; the full addresses are in the tooltip.
    const suffix = "/p2p/" + p.peer_id;
    const shown = addrs.map((a) => (a.endsWith(suffix) ? a.slice(0, -suffix.length) : a));
    const stale = isNum(p.updated_at) && now - p.updated_at > STALE_PEER_S;
    const peerCell = el("td", { class: "mono peer", title: p.peer_id, text: shortId(p.peer_id) });
    if (p.self === true) peerCell.append(el("span", { class: "badge you", text: "this peer" }));
    const addrCell = el("td", { class: "addr", title: addrs.join("\n") },
      ...breakable(shown[0] ?? "—"), shown.length > 1 ? ` (+${shown.length - 1} more)` : "");
    return el("tr", { "data-peer-id": p.peer_id,
                      class: [p.self === true ? "self" : "", stale ? "stale" : ""].join(" ") },
      peerCell,
      el("td", { class: "num", text: fmtNum(p.step, 0) }),
      el("td", { class: "num", text: fmtLoss(p.loss) }),
      el("td", { class: "num", text: fmtLoss(p.val_loss) }),
      el("td", { class: "num", text: fmtNum(p.tokens_per_s, 1) }),
      el("td", { class: "num", text: fmtAgo(p.updated_at) }),
      addrCell);
  }));
  $("peers-empty").hidden = peers.length > 0;
  setText("peers-count", peers.length > MAX_PEER_ROWS
    ? `showing ${MAX_PEER_ROWS} of ${peers.length}` : `${peers.length} known`);
}

// --- polling ------------------------------------------------------------------------------

async function getJSON(path) {
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), FETCH_TIMEOUT_MS);
  try {
    const response = await fetch(path, { signal: abort.signal, cache: "no-store" });
    let body = null;
    try { body = await response.json(); } catch (e) { /* not JSON: reported below */ }
    if (!response.ok || body === null) {
      throw new Error(body && body.error ? body.error : `HTTP ${response.status}`);
    }
    return body;
  } catch (e) {
    const why = e.name === "AbortError" ? "no answer in time" : e.message || String(e);
    throw new Error(`${path}: ${why}`);
  } finally {
    clearTimeout(timer);
  }
}

function showErrors(errors, asked) {
  const banner = $("error");
  const pill = $("connection-state");
  if (errors.length) {
    const allDown = errors.length === asked;
    banner.textContent = (allDown
      ? "Cannot reach this peer: is its shoal run still running? Retrying every 2 s. "
      : "Some data could not be refreshed. ") + "Details: " + errors.join("; ");
    if (state.lastOk) banner.textContent += `. Last update ${fmtClock(state.lastOk)}.`;
    banner.classList.add("shown");
    pill.className = "pill " + (allDown ? "down" : "live");
    pill.textContent = allDown ? "reconnecting…" : "partly live";
  } else {
    banner.classList.remove("shown");
    banner.textContent = "";
    pill.className = "pill live";
    pill.textContent = "live";
  }
}

async function poll() {
  // The swarm's history changes every 15 s and may be large: fetched every 10 s only.
  const swarmDue = Date.now() - state.swarmAt >= SWARM_POLL_MS;
  const [status, peers, history, swarm] = await Promise.allSettled(
    [getJSON("status"), getJSON("peers"), getJSON("history"),
     swarmDue ? getJSON("swarm") : Promise.resolve(null)]);
  const asked = swarmDue ? 4 : 3;
  const errors = [];
  const apply = (result, render) => {
    if (result.status !== "fulfilled") { errors.push(result.reason.message); return; }
    try { render(result.value); }
    catch (e) { errors.push("cannot show the data: " + e); }
  };
  apply(status, (s) => { state.status = s; renderStatus(s); });
  apply(peers, (p) => { state.peers = p; renderPeers(Array.isArray(p) ? p : []); });
  apply(history, (h) => { state.history = Array.isArray(h) ? h : []; drawCharts(); });
  if (swarmDue) {
    apply(swarm, (w) => { state.swarm = w; state.swarmAt = Date.now(); drawSwarm(); });
  }
  if (errors.length < asked) {
    state.lastOk = Date.now() / 1000;
    setText("updated", "updated " + fmtClock(state.lastOk));
  }
  if (!errors.length) document.body.dataset.polls = String(++state.polls);
  showErrors(errors, asked);
}

async function loop() {
  try { await poll(); }
  catch (e) { showErrors(["unexpected: " + e], 0); }
  finally { setTimeout(loop, POLL_MS); }
}

let resizeTimer = null;
window.addEventListener("resize", () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(() => { drawCharts(); drawSwarm(); }, 100);
});
loop();
