// The ringserve status page: polls /status.json once a second and redraws. Everything it shows
// comes from that snapshot of the coordinator's Status (ringserve/coordinator/statusview.py).
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const POLL_MS = 1000;

function el(tag, attrs, text) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(n < 10 && i ? 1 : 0)} ${units[i]}`;
}

function duration(s) {
  if (s < 60) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.floor(s % 60)} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

function laneClass(lane) {
  if (lane === "shared memory") return "lane-shm";
  if (lane === "stream") return "lane-stream";
  return lane ? "lane-other" : "lane-none";
}

// ok: heard from lately; late: past two heartbeat intervals; dead: past half the heartbeat
// timeout (the coordinator declares it dead at the timeout, and it then leaves the view).
function health(member, s) {
  const age = member.heartbeat_age_s;
  if (age >= s.heartbeat_timeout_s / 2) return "dead";
  if (age >= 2 * s.heartbeat_interval_s) return "late";
  return "ok";
}

function summary(s) {
  const set = (id, text) => { document.getElementById(id).textContent = text; };
  set("view-id", s.view_id ? String(s.view_id) : "none yet");
  set("view-size", String(s.view_size));
  set("bounds", `${s.min_workers} / ${s.max_workers}`);
  set("pending", String(s.pending_workers));
  set("mark", s.mark ? `step ${s.mark.step}` + (s.mark.lineage ? ` (lineage ${s.mark.lineage})` : "") : "–");
  set("views-formed", String(s.views_formed));
  set("uptime", duration(s.uptime_s));
  set("listed", s.listed < s.view_size ? `(the first ${s.listed} of ${s.view_size})` : "");
}

function members(s) {
  const body = document.querySelector("#members tbody");
  body.replaceChildren();
  for (const m of s.members) {
    const state = health(m, s);
    const row = el("tr", {"data-rank": m.rank, "data-worker": m.worker_id, "data-health": state, class: state});
    row.append(
      el("td", {}, String(m.rank)),
      el("td", {}, m.host),
      el("td", {class: "mono"}, m.address),
      el("td", {class: laneClass(m.lane)}, m.lane || "–"),
      el("td", {}, m.committed_step === null ? "–" : String(m.committed_step)),
      el("td", {class: `age ${state}`}, duration(m.heartbeat_age_s)),
      el("td", {}, String(m.collectives)),
      el("td", {}, bytes(m.bytes_sent)),
    );
    body.append(row);
  }
  if (!s.members.length) {
    const row = el("tr");
    row.append(el("td", {colspan: 8, class: "muted"}, "no view has formed yet"));
    body.append(row);
  }
}

function ring(s) {
  const svg = document.getElementById("ring");
  svg.replaceChildren();
  const defs = el("svg:defs");
  for (const lane of ["lane-shm", "lane-stream", "lane-other"]) {
    const marker = el("svg:marker", {id: `arrow-${lane}`, viewBox: "0 0 10 10", refX: 10, refY: 5,
      markerWidth: 6, markerHeight: 6, orient: "auto-start-reverse", class: lane});
    marker.append(el("svg:path", {d: "M 0 0 L 10 5 L 0 10 z"}));
    defs.append(marker);
  }
  svg.append(defs);
  const n = s.members.length;
  if (!n) {
    svg.append(el("svg:text", {x: 200, y: 200, "text-anchor": "middle", class: "muted"}, "no view yet"));
    return;
  }
  const R = 150, C = 200, r = n > 32 ? 5 : 16;
  const at = (rank) => {
    const a = -Math.PI / 2 + (2 * Math.PI * rank) / n;
    return [C + R * Math.cos(a), C + R * Math.sin(a)];
  };
  const byRank = new Map(s.members.map((m) => [m.rank, m]));
  for (const e of s.edges) {
    if (!byRank.has(e.to) || e.from === e.to) continue;
    const [x1, y1] = at(e.from), [x2, y2] = at(e.to);
    const len = Math.hypot(x2 - x1, y2 - y1) || 1;
    const ux = (x2 - x1) / len, uy = (y2 - y1) / len;
    // A gentle outward bow, so that the two directions of a world of 2 do not overlap.
    const mx = (x1 + x2) / 2 + (n === 2 ? -uy * 30 : (((x1 + x2) / 2 - C) * 0.12));
    const my = (y1 + y2) / 2 + (n === 2 ? ux * 30 : (((y1 + y2) / 2 - C) * 0.12));
    const lane = laneClass(e.lane);
    const g = el("svg:g", {class: `edge ${lane}`, "data-from": e.from, "data-to": e.to});
    g.append(el("svg:path", {
      d: `M ${x1 + ux * r} ${y1 + uy * r} Q ${mx} ${my} ${x2 - ux * r} ${y2 - uy * r}`,
      "marker-end": `url(#arrow-${lane})`,
    }));
    if (n <= 16) {
      g.append(el("svg:text", {x: mx, y: my, "text-anchor": "middle", class: "rate"},
        e.bytes_per_s === null ? "…" : `${bytes(e.bytes_per_s)}/s`));
    }
    g.append(el("svg:title", {}, `rank ${e.from} → rank ${e.to}: ${e.lane}, ` +
      (e.bytes_per_s === null ? "rate not known yet" : `${bytes(e.bytes_per_s)}/s`)));
    svg.append(g);
  }
  for (const m of s.members) {
    const [x, y] = at(m.rank);
    const state = health(m, s);
    const g = el("svg:g", {class: `node ${state}`, "data-rank": m.rank});
    g.append(el("svg:circle", {cx: x, cy: y, r}));
    if (n <= 32) g.append(el("svg:text", {x, y: y + 4, "text-anchor": "middle"}, String(m.rank)));
    g.append(el("svg:title", {}, `rank ${m.rank} on ${m.host} (${m.address}), heartbeat ${duration(m.heartbeat_age_s)} ago`));
    svg.append(g);
  }
}

// The commit rate when the job commits (elastic training), else the collective rate, over the
// last five minutes (or since the page's samples began).
function chart(s) {
  const svg = document.getElementById("chart");
  svg.replaceChildren();
  const W = 400, H = 140, left = 40, bottom = 18, top = 10;
  const commits = s.chart.some((p) => p.commits_per_s !== null);
  const key = commits ? "commits_per_s" : "collectives_per_s";
  const pts = s.chart.filter((p) => p[key] !== null);
  document.getElementById("chart-what").textContent = commits ? "commits/s" : "collectives/s";
  document.getElementById("chart-what").className = commits ? "line-commits" : "line-collectives";
  svg.append(el("svg:line", {x1: left, y1: H - bottom, x2: W - 4, y2: H - bottom, class: "axis"}));
  if (pts.length < 2) {
    svg.append(el("svg:text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "muted"}, "collecting samples…"));
    return;
  }
  const t1 = pts[pts.length - 1].t, t0 = Math.max(pts[0].t, t1 - 300);
  const span = Math.max(t1 - t0, 1e-9);
  const max = Math.max(1e-9, ...pts.map((p) => p[key]));
  const x = (t) => left + ((t - t0) / span) * (W - 4 - left);
  const y = (v) => H - bottom - (v / max) * (H - bottom - top);
  const line = pts.filter((p) => p.t >= t0).map((p) => `${x(p.t).toFixed(1)},${y(p[key]).toFixed(1)}`);
  svg.append(el("svg:polyline", {points: line.join(" "), class: commits ? "line-commits" : "line-collectives"}));
  const fmt = (v) => (v >= 100 ? v.toFixed(0) : v.toFixed(1));
  svg.append(el("svg:text", {x: left - 4, y: top + 4, "text-anchor": "end", class: "tick"}, fmt(max)));
  svg.append(el("svg:text", {x: left - 4, y: H - bottom, "text-anchor": "end", class: "tick"}, "0"));
  svg.append(el("svg:text", {x: left, y: H - 4, class: "tick"}, `−${duration(span)}`));
  svg.append(el("svg:text", {x: W - 4, y: H - 4, "text-anchor": "end", class: "tick"},
    `now: ${fmt(pts[pts.length - 1][key])}/s`));
}

function stalls(s) {
  const list = document.getElementById("stalls");
  list.replaceChildren();
  if (!s.stalls.length) list.append(el("li", {class: "muted"}, "none"));
  for (const text of s.stalls) list.append(el("li", {class: "stall"}, text));
}

function history(s) {
  const list = document.getElementById("history");
  list.replaceChildren();
  for (const e of [...s.history].reverse().slice(0, 60)) {
    const item = el("li", {class: `event ${e.kind}`});
    item.append(el("span", {class: "when"}, `${duration(Math.max(0, s.uptime_s - e.at_s))} ago`),
      el("span", {class: `kind ${e.kind}`}, e.kind), el("span", {class: "text"}, e.text));
    list.append(item);
  }
}

async function poll() {
  const note = document.getElementById("connection");
  try {
    const answer = await fetch("/status.json", {credentials: "same-origin", cache: "no-store"});
    if (answer.status === 401) { window.location.assign("/login"); return; }
    if (!answer.ok) {
      let why = `HTTP ${answer.status}`;
      try { why = (await answer.json()).error || why; } catch (_) { /* not JSON: the status code says it */ }
      throw new Error(why);
    }
    const s = await answer.json();
    summary(s); members(s); ring(s); chart(s); stalls(s); history(s);
    note.textContent = `updated ${new Date().toLocaleTimeString()}`;
    note.className = "connection ok";
  } catch (err) {
    note.textContent = `cannot reach the coordinator (${err.message}); retrying`;
    note.className = "connection lost";
  }
  setTimeout(poll, POLL_MS);
}

poll();
