"""The status page itself (ops/statuspage.py serves it): one HTML file with its style and
script inline, nothing loaded from elsewhere. The script polls `api/status` every 0.5 s
and redraws; while the daemon does not answer it says so and keeps asking, so a page left
open shows the next daemon on the same address. Every value goes in as text, never HTML.
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>dynamod</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1em 2em; color: #222; }
h1 { font-size: 1.3em; margin: 0 0 .2em; } h2 { font-size: 1.1em; margin: 1.2em 0 .3em; }
table { border-collapse: collapse; } td, th { padding: 2px 10px 2px 0; text-align: left;
  vertical-align: top; } th { border-bottom: 1px solid #999; font-weight: 600; }
td.name { font-family: monospace; white-space: pre; } td.detail, td.text { color: #555; }
#conn { padding: 2px 8px; border-radius: 3px; }
#conn.live { background: #e8f5e9; } #conn.lost { background: #ffcdd2; font-weight: 600; }
.state { font-weight: 600; }
.s-ready, .s-up { color: #2e7d32; } .s-completed { color: #66bb6a; }
.s-starting, .s-inactive { color: #1565c0; } .s-held, .s-degraded { color: #ef6c00; }
.s-backoff, .s-failed, .s-stopping, .s-stopped { color: #c62828; }
.muted { color: #888; }
</style></head>
<body data-conn="connecting">
<h1 id="stack">dynamod</h1>
<div><span id="conn">connecting</span> <span id="daemon" class="muted"></span></div>
<div id="degraded"></div>
<h2>Units</h2>
<table><thead><tr><th>unit</th><th>state</th><th>pid</th><th>uptime</th><th>restarts</th>
<th>last exit</th><th>policy</th><th>detail</th></tr></thead><tbody id="units"></tbody></table>
<h2>Last events</h2>
<table><thead><tr><th>time</th><th>unit</th><th>what happened</th></tr></thead>
<tbody id="events"></tbody></table>
<h2>Chaos runs</h2>
<div id="chaos" class="muted">none in the state dir's chaos-runs/</div>
<script>
"use strict";
const token = new URLSearchParams(location.search).get("token");
const withToken = (path) => token ? path + "?token=" + encodeURIComponent(token) : path;
let failingSince = null;

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}
function clock(seconds) {
  const d = new Date(seconds * 1000);
  return d.toLocaleTimeString([], {hour12: false}) + "." +
    String(d.getMilliseconds()).padStart(3, "0");
}
function duration(s) {
  if (s === null || s === undefined) return "-";
  if (s < 60) return s.toFixed(1) + "s";
  const m = Math.floor(s / 60);
  return m < 60 ? m + "m" + String(Math.floor(s % 60)).padStart(2, "0") + "s"
    : Math.floor(m / 60) + "h" + String(m % 60).padStart(2, "0") + "m";
}
function policyText(u) {
  const parts = [];
  if (u.policy) {
    const p = u.policy;
    parts.push("v" + (p.version ?? "-") + " / ledger " + (p.current ?? "-"));
    if (!p.admitted) parts.push("held");
    if (p.last_error) parts.push(p.last_error);
  } else if ("policy_version" in u) {
    parts.push("v" + (u.policy_version ?? "-"));
  }
  if (u.spare && u.spare.role) parts.push(u.spare.role + (u.spare.sleeping ? " (asleep)" : ""));
  return parts.join(", ");
}
function tree(units) {
  // Units nothing depends on first, each followed by its dependencies, as `status` prints.
  const byName = new Map(units.map((u) => [u.name, u]));
  const needed = new Set(units.flatMap((u) => Object.keys(u.depends_on || {})));
  const out = [], shown = new Set();
  const walk = (u, depth) => {
    const again = shown.has(u.name);
    out.push([u, depth, again]);
    if (again) return;
    shown.add(u.name);
    for (const dep of Object.keys(u.depends_on || {})) {
      if (byName.has(dep)) walk(byName.get(dep), depth + 1);
    }
  };
  units.filter((u) => !needed.has(u.name)).forEach((u) => walk(u, 0));
  units.filter((u) => !shown.has(u.name)).forEach((u) => walk(u, 0));
  return out;
}
function renderUnits(units) {
  const body = document.getElementById("units");
  body.replaceChildren();
  for (const [u, depth, again] of tree(units)) {
    const row = el("tr");
    if (!again) row.dataset.unit = u.name;
    row.append(el("td", "  ".repeat(depth) + (depth ? "└ " : "") + u.name + (again ? " ^" : ""),
                  "name"),
               el("td", u.state, "state s-" + u.state));
    if (!again) {
      row.append(el("td", u.pid ?? "-", "pid"), el("td", duration(u.uptime_s), "uptime"),
                 el("td", u.restarts, "restarts"), el("td", u.last_exit ?? "-", "last-exit"),
                 el("td", policyText(u), "policy"),
                 el("td", (u.detail || "").split("\\n")[0], "detail"));
    }
    body.append(row);
  }
}
function renderEvents(events) {
  const body = document.getElementById("events");
  body.replaceChildren();
  for (const e of events.slice().reverse()) {
    const row = el("tr");
    row.dataset.kind = e.kind;
    row.append(el("td", clock(e.time)), el("td", e.unit || "-"), el("td", e.text, "text"));
    body.append(row);
  }
}
function renderChaos(runs) {
  const box = document.getElementById("chaos");
  if (!runs.length) return;
  box.replaceChildren();
  box.className = "";
  const list = el("ul");
  for (const r of runs) {
    const item = el("li");
    item.append(el("b", r.name), " " + r.start + " ",
                el("span", r.verdict, r.passed ? "s-ready" : "s-failed"), " ");
    for (const [file, label] of [["timeline.png", "timeline"], ["journal.json", "journal"]]) {
      if (file === "timeline.png" && !r.timeline) continue;
      const link = el("a", label);
      link.href = withToken("chaos/" + encodeURIComponent(r.run) + "/" + file);
      item.append(link, " ");
    }
    list.append(item);
  }
  box.append(list);
}
function render(data) {
  const s = data.status;
  document.title = "dynamod: " + s.stack + " (" + s.phase + ")";
  const head = document.getElementById("stack");
  head.replaceChildren("stack " + s.stack + " ", el("span", s.phase, "state s-" + s.phase));
  document.getElementById("daemon").textContent = "daemon pid " + s.daemon_pid + ", run " +
    s.run_id + ", up " + duration(s.uptime_s) + ", state dir " + s.state_dir;
  document.body.dataset.runId = s.run_id;
  document.body.dataset.daemonPid = s.daemon_pid;
  const degraded = Object.entries(s.degraded || {});
  document.getElementById("degraded").textContent = degraded.length ?
    "degraded: " + degraded.map(([u, why]) => u + " " + why).join("; ") : "";
  renderUnits(s.units);
  renderEvents(data.events);
  renderChaos(data.chaos);
}
function connection(live, text) {
  const conn = document.getElementById("conn");
  conn.textContent = text;
  conn.className = live ? "live" : "lost";
  document.body.dataset.conn = live ? "live" : "lost";
}
async function poll() {
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), 2000);
  try {
    const resp = await fetch(withToken("api/status"), {cache: "no-store", signal: abort.signal});
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    render(await resp.json());
    failingSince = null;
    connection(true, "live, updated " + new Date().toLocaleTimeString([], {hour12: false}));
  } catch (err) {
    failingSince = failingSince || new Date();
    connection(false, "the daemon has not answered since " +
      failingSince.toLocaleTimeString([], {hour12: false}) + " (" + err.message +
      "); still asking, what follows is its last answer");
  } finally {
    clearTimeout(timer);
    setTimeout(poll, 500);
  }
}
poll();
</script></body></html>
"""
