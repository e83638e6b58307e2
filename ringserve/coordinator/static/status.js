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
      el("td", {class: "host"}, m.host),
      el("td", {class: "mono address"}, m.address),
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

// The edges are the links the view's traffic uses now (statusview.py: those that sent within a
// few seconds of its newest traffic), one per direction. A pair used both ways (halving-doubling,
// a world of 2) is two arcs bowed to either side of its chord, each with its own arrow and label;
// a pair used one way (a ring) bows gently outward. Every line is drawn before any label, and each
// label sits on an opaque plate above the lines and the nodes, so no line runs through its text.
// A label takes the first place that overlaps no other label and no node: on its arc, from the
// middle out, else beside it (outside the circle first); one that finds none is left out, its
// rate still in the arc's tooltip, and the drawing says how many.
const VIEW = 400, CENTRE = 200, PLACES = [0.5, 0.42, 0.58, 0.34, 0.66, 0.26, 0.74, 0.18, 0.82];

function ring(s) {
  const svg = document.getElementById("ring");
  svg.replaceChildren();
  const defs = el("svg:defs");
  for (const lane of ["lane-shm", "lane-stream", "lane-other", "lane-none"]) {
    const marker = el("svg:marker", {id: `arrow-${lane}`, viewBox: "0 0 10 10", refX: 10, refY: 5,
      markerWidth: 6, markerHeight: 6, orient: "auto-start-reverse", class: lane});
    marker.append(el("svg:path", {d: "M 0 0 L 10 5 L 0 10 z"}));
    defs.append(marker);
  }
  svg.append(defs);
  const n = s.members.length;
  if (!n) {
    svg.append(el("svg:text", {x: CENTRE, y: CENTRE, "text-anchor": "middle", class: "muted"}, "no view yet"));
    return;
  }
  // Past 8 ranks, a smaller circle leaves room outside it for the labels of neighbours' arcs.
  const r = n > 32 ? 5 : 16, radius = n > 8 ? 128 : 150;
  const at = (rank) => {
    const a = -Math.PI / 2 + (2 * Math.PI * rank) / n;
    return [CENTRE + radius * Math.cos(a), CENTRE + radius * Math.sin(a)];
  };
  const byRank = new Map(s.members.map((m) => [m.rank, m]));
  const edges = s.edges.filter((e) => byRank.has(e.from) && byRank.has(e.to) && e.from !== e.to);
  const directed = new Set(edges.map((e) => `${e.from}>${e.to}`));
  const lines = el("svg:g", {class: "edges"}), nodes = el("svg:g", {class: "nodes"});
  const labels = el("svg:g", {class: "labels"});
  svg.append(lines, nodes, labels);
  const arcs = [];
  for (const e of edges) {
    const [x1, y1] = at(e.from), [x2, y2] = at(e.to);
    const len = Math.hypot(x2 - x1, y2 - y1) || 1;
    const mx = (x1 + x2) / 2, my = (y1 + y2) / 2;
    let cx, cy;
    if (directed.has(`${e.to}>${e.from}`)) {
      // Both ways: the lower rank's arc on one side of the chord, the other's on the other side,
      // its apex a seventh of the chord away (the control point is twice as far as the apex).
      const sign = e.from < e.to ? 1 : -1;
      const [ax, ay] = e.from < e.to ? [x1, y1] : [x2, y2], [bx, by] = e.from < e.to ? [x2, y2] : [x1, y1];
      const nx = -(by - ay) / len, ny = (bx - ax) / len;
      const bow = 2 * Math.max(14, len / 7);
      cx = mx + sign * nx * bow; cy = my + sign * ny * bow;
    } else {
      cx = mx + (mx - CENTRE) * 0.24; cy = my + (my - CENTRE) * 0.24;
    }
    const from = toward([x1, y1], [cx, cy], r), to = toward([x2, y2], [cx, cy], r);
    const lane = laneClass(e.lane);
    const rate = e.bytes_per_s === null ? "…" : `${bytes(e.bytes_per_s)}/s`;
    const g = el("svg:g", {class: `edge ${lane}`, "data-from": e.from, "data-to": e.to, "data-rate": rate});
    g.append(el("svg:path", {
      d: `M ${from[0]} ${from[1]} Q ${cx} ${cy} ${to[0]} ${to[1]}`, "marker-end": `url(#arrow-${lane})`,
    }));
    g.append(el("svg:title", {}, `rank ${e.from} → rank ${e.to}: ${e.lane}, ` +
      (e.bytes_per_s === null ? "rate not known yet" : `${bytes(e.bytes_per_s)}/s`)));
    lines.append(g);
    arcs.push({e, lane, rate, p0: [x1, y1], q: [cx, cy], p2: [x2, y2]});
  }
  const taken = [];
  for (const m of s.members) {
    const [x, y] = at(m.rank);
    const state = health(m, s);
    const g = el("svg:g", {class: `node ${state}`, "data-rank": m.rank});
    g.append(el("svg:circle", {cx: x, cy: y, r}));
    if (n <= 32) g.append(el("svg:text", {x, y: y + 4, "text-anchor": "middle"}, String(m.rank)));
    g.append(el("svg:title", {}, `rank ${m.rank} on ${m.host} (${m.address}), heartbeat ${duration(m.heartbeat_age_s)} ago`));
    nodes.append(g);
    taken.push({x0: x - r - 2, y0: y - r - 2, x1: x + r + 2, y1: y + r + 2});
  }
  if (n > 16) return;
  let left = 0;
  for (const a of arcs) {
    const g = el("svg:g", {class: `label ${a.lane}`, "data-from": a.e.from, "data-to": a.e.to});
    const plate = el("svg:rect", {rx: 3});
    const text = el("svg:text", {"text-anchor": "middle", class: "rate"}, a.rate);
    g.append(plate, text);
    labels.append(g);
    const w = (text.getComputedTextLength() || 6.2 * a.rate.length) + 8, h = 15;
    const box = [0, 1, -1].flatMap((side) => PLACES.map((t) => {
      let [x, y] = bezier(a.p0, a.q, a.p2, t);
      if (side) {  // beside the arc: along its normal, away from the centre first, clear of the line
        const [dx, dy] = tangent(a.p0, a.q, a.p2, t), len = Math.hypot(dx, dy) || 1;
        let nx = -dy / len, ny = dx / len;
        if (nx * (x - CENTRE) + ny * (y - CENTRE) < 0) { nx = -nx; ny = -ny; }
        const shift = side * (Math.abs(nx) * w / 2 + Math.abs(ny) * h / 2 + 3);
        x += nx * shift; y += ny * shift;
      }
      return {x0: x - w / 2, y0: y - h / 2, x1: x + w / 2, y1: y + h / 2};
    })).find((b) => b.x0 >= 1 && b.y0 >= 1 && b.x1 <= VIEW - 1 && b.y1 <= VIEW - 1 &&
      !taken.some((o) => b.x0 < o.x1 + 1 && o.x0 < b.x1 + 1 && b.y0 < o.y1 + 1 && o.y0 < b.y1 + 1));
    if (!box) { g.remove(); left++; continue; }
    taken.push(box);
    plate.setAttribute("x", box.x0); plate.setAttribute("y", box.y0);
    plate.setAttribute("width", w); plate.setAttribute("height", h);
    text.setAttribute("x", (box.x0 + box.x1) / 2); text.setAttribute("y", box.y1 - 4);
  }
  if (left) {
    svg.append(el("svg:text", {x: 6, y: VIEW - 6, class: "tick"},
      `${left} rate${left > 1 ? "s" : ""} not shown for want of room: hover an edge`));
  }
}

// The point ``d`` along from ``p`` toward ``q`` (an arc leaves a node's circle toward its control point).
function toward(p, q, d) {
  const len = Math.hypot(q[0] - p[0], q[1] - p[1]) || 1;
  return [p[0] + ((q[0] - p[0]) / len) * d, p[1] + ((q[1] - p[1]) / len) * d];
}

function tangent(p0, q, p2, t) {
  return [2 * (1 - t) * (q[0] - p0[0]) + 2 * t * (p2[0] - q[0]), 2 * (1 - t) * (q[1] - p0[1]) + 2 * t * (p2[1] - q[1])];
}

function bezier(p0, q, p2, t) {
  const u = 1 - t;
  return [u * u * p0[0] + 2 * u * t * q[0] + t * t * p2[0], u * u * p0[1] + 2 * u * t * q[1] + t * t * p2[1]];
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
