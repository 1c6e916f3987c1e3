// Ember dashboard. Plain JS, no build step; plots with the vendored uPlot.
// Every string from the API is put in the page as text (textContent / text nodes), never
// as HTML: model names, tenants and errors are untrusted.
"use strict";

(function () {
  const KEY = "ember.key";
  const TENANT = "ember.tenant";
  const POLL_MS = 2000;
  const $ = (id) => document.getElementById(id);

  // --- DOM helpers (text only) -----------------------------------------------------------

  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") el.className = v;
      else if (k === "text") el.textContent = v;
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else el.setAttribute(k, String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  }

  function clear(el) {
    while (el.firstChild) el.removeChild(el.firstChild);
    return el;
  }

  const dash = "\u2014";
  function num(x, digits) {
    if (x === null || x === undefined || Number.isNaN(x)) return dash;
    return Number(x).toLocaleString(undefined, { maximumFractionDigits: digits ?? 2 });
  }
  function pct(x) {
    return x === null || x === undefined ? dash : `${(100 * x).toFixed(1)} %`;
  }
  function bytes(n) {
    if (n === null || n === undefined) return dash;
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    let v = Number(n);
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return `${v.toFixed(i ? 1 : 0)} ${units[i]}`;
  }
  function when(x) {
    if (x === null || x === undefined) return dash;
    const d = typeof x === "number" ? new Date(x * 1000) : new Date(x);
    return Number.isNaN(d.getTime()) ? dash : d.toLocaleString();
  }
  function badge(text) {
    return h("span", { class: `badge ${String(text).replace(/[^a-z_-]/gi, "")}` }, text);
  }

  // --- the API ---------------------------------------------------------------------------

  class Refused extends Error {}

  async function api(path) {
    const key = sessionStorage.getItem(KEY);
    const headers = { Authorization: `Bearer ${key}`, Accept: "application/json" };
    const tenant = sessionStorage.getItem(TENANT);
    if (tenant) headers["X-Ember-Tenant"] = tenant;
    const response = await fetch(path, { headers, credentials: "omit", cache: "no-store" });
    let body = null;
    try { body = await response.json(); } catch (e) { body = null; }
    if (response.status === 401) {
      signOut("Your key was refused (unknown or revoked): sign in again.");
      throw new Refused("signed out");
    }
    return { ok: response.ok, status: response.status, body,
             retryAfter: response.headers.get("Retry-After") };
  }

  async function must(path) {
    const r = await api(path);
    if (!r.ok) {
      const detail = (r.body && (r.body.detail || r.body.title)) || `HTTP ${r.status}`;
      const err = new Error(detail);
      err.status = r.status;
      err.retryAfter = Number(r.retryAfter) || 0;
      throw err;
    }
    return r.body;
  }

  async function maybe(path) {  // an optional endpoint: null when it does not answer
    try {
      const r = await api(path);
      return r.ok ? r.body : null;
    } catch (e) {
      if (e instanceof Refused) throw e;
      return null;
    }
  }

  const q = encodeURIComponent;

  // --- sortable tables -------------------------------------------------------------------

  const sortState = {};

  // columns: [{key, label, value: row => sortable, cell: row => node|text, num: bool}]
  function table(id, columns, rows, empty) {
    const state = sortState[id] || (sortState[id] = { key: null, dir: 1 });
    const sorted = rows.slice();
    if (state.key !== null) {
      const col = columns.find((c) => c.key === state.key);
      if (col) {
        const val = col.value || ((r) => r[col.key]);
        sorted.sort((a, b) => {
          const x = val(a);
          const y = val(b);
          if (x === y) return 0;
          if (x === null || x === undefined) return 1;
          if (y === null || y === undefined) return -1;
          return (x < y ? -1 : 1) * state.dir;
        });
      }
    }
    const head = h("tr", {}, columns.map((c) => h("th", {
      "data-key": c.key,
      class: state.key === c.key ? (state.dir > 0 ? "asc" : "desc") : null,
      onclick: () => {
        state.dir = state.key === c.key ? -state.dir : 1;
        state.key = c.key;
        const fresh = table(id, columns, rows, empty);
        const old = document.getElementById(id);
        if (old) old.replaceWith(fresh);
      },
    }, c.label)));
    const body = sorted.map((r) => h("tr", { "data-row": r._row ?? null }, columns.map((c) => {
      const v = c.cell ? c.cell(r) : r[c.key];
      return h("td", { class: c.num ? "num" : null }, v === null || v === undefined ? dash : v);
    })));
    if (!rows.length) {
      body.push(h("tr", {}, h("td", { colspan: columns.length, class: "muted" }, empty || "None")));
    }
    return h("table", { id, "data-rows": rows.length }, h("thead", {}, head), h("tbody", {}, body));
  }

  function put(container, id, node) {  // replace the element with this id, or append it
    const old = document.getElementById(id);
    if (old && container.contains(old)) old.replaceWith(node);
    else container.append(node);
  }

  // --- plots -----------------------------------------------------------------------------

  const COLORS = { hot: "#e8590c", warm: "#f59f00", standby: "#4dabf7", starting: "#adb5bd" };
  const FORECAST = ["#7048e8", "#1098ad", "#37b24d", "#f783ac"];

  function plotWidth(el) {
    return Math.max(320, (el.clientWidth || 600) - 8);
  }

  // One uPlot per container, kept across refreshes (setData) while the series stay alike.
  function plot(el, signature, makeOpts, data) {
    if (el._plot && el._signature === signature) {
      el._plot.setData(data);
      return el._plot;
    }
    if (el._plot) el._plot.destroy();
    clear(el);
    el._signature = signature;
    el._plot = new uPlot(makeOpts(plotWidth(el)), data, el);
    return el._plot;
  }

  function dropPlots(root) {
    for (const el of root.querySelectorAll(".plot")) {
      if (el._plot) el._plot.destroy();
      el._plot = null;
    }
  }

  window.addEventListener("resize", () => {
    for (const el of document.querySelectorAll(".plot")) {
      if (el._plot) el._plot.setSize({ width: plotWidth(el), height: el._plot.height });
    }
  });

  function tierPlot(el, samples) {
    const tiers = ["hot", "warm", "standby", "starting"];
    const xs = samples.map((s) => s.t);
    // Stacked: each band is drawn from zero to the running total, the widest first.
    const stacked = [];
    let run = samples.map(() => 0);
    for (const t of tiers) {
      run = run.map((v, i) => v + (samples[i].replicas[t] || 0));
      stacked.push(run.slice());
    }
    const order = tiers.map((t, i) => i).reverse();
    const data = [xs, ...order.map((i) => stacked[i])];
    const series = order.map((i) => ({
      label: tiers[i],
      stroke: COLORS[tiers[i]],
      fill: COLORS[tiers[i]],
      paths: uPlot.paths.stepped({ align: 1 }),
      value: (u, v, si, di) => (di === null || di === undefined ? dash :
        String(samples[di].replicas[tiers[i]] || 0)),
    }));
    el.dataset.points = String(samples.length);
    el.dataset.last = samples.length ? JSON.stringify(samples[samples.length - 1].replicas) : "";
    return plot(el, "tiers", (width) => ({
      width, height: 220, title: "Replicas by tier",
      scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, Math.max(2, hi + 1)] } },
      axes: [{}, { label: "replicas" }],
      series: [{}, ...series],
    }), data);
  }

  // Each forecast is drawn at the time it is for (made at t for t + its horizon), so it
  // lines up with the demand that then arrived.
  function demandPlot(el, samples) {
    const tiers = [];
    for (const s of samples) for (const f of s.forecast || []) {
      if (!tiers.includes(f.tier)) tiers.push(f.tier);
    }
    const points = new Map();  // time -> [arrived, admitted, ...forecast per tier]
    const at = (t) => {
      const key = Math.round(t * 1000) / 1000;
      let row = points.get(key);
      if (!row) points.set(key, (row = new Array(2 + tiers.length).fill(null)));
      return row;
    };
    for (const s of samples) {
      const row = at(s.t);
      row[0] = s.arrived_units_per_s;
      row[1] = s.admitted_units_per_s;
      for (const f of s.forecast || []) {
        if (f.units_per_s === null || f.horizon_s === null) continue;
        at(s.t + f.horizon_s)[2 + tiers.indexOf(f.tier)] = f.units_per_s;
      }
    }
    const xs = [...points.keys()].sort((a, b) => a - b);
    const columns = [xs, ...Array.from({ length: 2 + tiers.length }, (_, i) =>
      xs.map((x) => points.get(x)[i]))];
    const arrived = samples.map((s) => s.arrived_units_per_s).filter((v) => v !== null);
    el.dataset.points = String(samples.length);
    el.dataset.peak = String(Math.max(0, ...arrived));
    const horizon = {};
    for (const s of samples) for (const f of s.forecast || []) horizon[f.tier] = f.horizon_s;
    const series = [
      { label: "arrived", stroke: "#1d2125", width: 2, spanGaps: true },
      { label: "admitted", stroke: "#2f9e44", width: 1, dash: [4, 2], spanGaps: true },
      ...tiers.map((t, i) => ({
        label: `forecast ${t} (made ${num(horizon[t], 1)} s ahead)`,
        stroke: FORECAST[i % FORECAST.length], width: 1.5, spanGaps: true,
      })),
    ];
    return plot(el, `demand:${tiers.join(",")}`, (width) => ({
      width, height: 220, title: "Demand vs forecast (model units/s)",
      scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, Math.max(1, hi * 1.1)] } },
      axes: [{}, { label: "units/s" }],
      series: [{}, ...series],
    }), columns);
  }

  // --- pages -----------------------------------------------------------------------------

  let timer = null;
  let generation = 0;

  function countTiers(replicas) {
    const c = { hot: 0, warm: 0, standby: 0, starting: 0 };
    for (const r of replicas) {
      if (r.state === "ready" && r.tier === "hot") c.hot++;
      else if (r.state === "ready" && r.tier === "warm") c.warm++;
      else if (r.state === "standby") c.standby++;
      else if (["starting", "promoting", "queued"].includes(r.state)) c.starting++;
    }
    return c;
  }

  function traffic(d) {
    return Object.entries(d.traffic || {})
      .sort((a, b) => b[1] - a[1])
      .map(([v, w]) => `${v}: ${w} %`).join(", ");
  }

  async function deploymentsPage(view) {
    const page = await must("/v1/deployments?limit=500");
    const rows = await Promise.all(page.items.map(async (d) => {
      const r = await maybe(`/v1/deployments/${q(d.name)}/replicas`);
      const c = countTiers(r ? r.replicas : []);
      const production = Object.entries(d.traffic || {}).sort((a, b) => b[1] - a[1])[0];
      return { _row: d.name, name: d.name, model: d.model, production: production ? production[0] : null,
               traffic: traffic(d), ...c, min_hot: d.min_hot, max_replicas: d.max_replicas };
    }));
    put(view, "title", h("h1", { id: "title" }, "Deployments"));
    put(view, "deployments", table("deployments", [
      { key: "name", label: "Deployment",
        cell: (r) => h("a", { href: `#/deployments/${q(r.name)}`, class: "deployment-link" }, r.name) },
      { key: "model", label: "Model" },
      { key: "production", label: "Production" },
      { key: "traffic", label: "Traffic split" },
      { key: "hot", label: "Hot", num: true },
      { key: "warm", label: "Warm", num: true },
      { key: "starting", label: "Starting", num: true },
      { key: "min_hot", label: "Min hot", num: true },
      { key: "max_replicas", label: "Max", num: true },
    ], rows, "No deployments in this tenant"));
  }

  function costCell(cost, version, which) {
    const v = cost && cost.versions && cost.versions[version];
    if (!v) return dash;
    const x = which === "lifetime" ? v.lifetime : (v.window || {})[which];
    return x === null || x === undefined ? dash : num(x, 4);
  }

  async function deploymentPage(view, name) {
    const base = `/v1/deployments/${q(name)}`;
    const d = await must(base);
    const [reps, scaler, hist, answers, cost] = await Promise.all([
      maybe(`${base}/replicas`), maybe(`${base}/autoscaler`), maybe(`${base}/history`),
      maybe(`${base}/answers`), maybe(`${base}/cost`),
    ]);
    const replicas = reps ? reps.replicas : [];
    const events = reps ? reps.events : [];
    const tiers = countTiers(replicas);
    if (hist && hist.samples.length) tiers.standby = hist.samples[hist.samples.length - 1].replicas.standby;

    put(view, "title", h("h1", { id: "title" }, "Deployment ", h("span", { id: "deployment-name" }, d.name),
      h("span", { class: "muted" }, ` \u00b7 model ${d.model}`)));
    put(view, "replicas-now", h("div", { id: "replicas-now", class: "tiers card" },
      ["hot", "warm", "standby", "starting"].map((t) =>
        h("span", { class: `tier ${t}`, "data-tier": t }, t, h("b", {}, String(tiers[t]))))));

    // versions: traffic split, serving figures, cost per success
    const stats = (answers && answers.versions) || {};
    const versions = new Set([...Object.keys(d.traffic || {}), ...Object.keys(stats),
      ...(d.fallback || []), ...replicas.map((r) => r.version)]);
    const vrows = [...versions].map((v) => {
      const s = stats[v] || {};
      const rungs = Object.entries(s.rungs || {}).map(([k, n]) => `${k}: ${n}`).join(", ");
      return {
        _row: v, version: v, traffic: (d.traffic || {})[v] ?? 0,
        aliases: Object.entries(d.aliases || {}).filter(([, x]) => x === v).map(([a]) => a).join(", "),
        hot: replicas.filter((r) => r.version === v && r.state === "ready" && r.tier === "hot").length,
        requests: s.requests ?? null, p50: s.p50_ms ?? null, p99: s.p99_ms ?? null,
        errors: s.error_rate ?? null, rungs,
        c5m: costCell(cost, v, "5m"), c1h: costCell(cost, v, "1h"), c24h: costCell(cost, v, "24h"),
        clife: costCell(cost, v, "lifetime"),
      };
    });
    put(view, "h-versions", h("h2", { id: "h-versions" }, "Versions"));
    put(view, "versions", table("versions", [
      { key: "version", label: "Version" },
      { key: "traffic", label: "Traffic %", num: true },
      { key: "aliases", label: "Aliases" },
      { key: "hot", label: "Hot", num: true },
      { key: "requests", label: "Answers (5 min)", num: true },
      { key: "p50", label: "p50 ms", num: true, cell: (r) => num(r.p50, 1) },
      { key: "p99", label: "p99 ms", num: true, cell: (r) => num(r.p99, 1) },
      { key: "errors", label: "Errors", num: true, cell: (r) => pct(r.errors) },
      { key: "rungs", label: "Ladder rungs" },
      { key: "c5m", label: "Cost/success 5m", num: true },
      { key: "c1h", label: "1h", num: true },
      { key: "c24h", label: "24h", num: true },
      { key: "clife", label: "Lifetime", num: true },
    ], vrows));

    // plots
    let plots = document.getElementById("plots");
    if (!plots) {
      plots = h("div", { id: "plots", class: "grid" },
        h("div", { id: "plot-tiers", class: "plot card" }), h("div", { id: "plot-demand", class: "plot card" }));
      view.append(plots);
    }
    const samples = hist ? hist.samples : [];
    tierPlot($("plot-tiers"), samples);
    demandPlot($("plot-demand"), samples);

    // autoscaler
    const box = h("div", { id: "autoscaler", class: "card" }, h("h2", {}, "Autoscaler"));
    if (!scaler || !scaler.config) {
      box.append(h("p", { class: "muted" }, "No autoscaler decision yet."));
    } else {
      const want = scaler.desired || {};
      box.append(h("p", {}, `Version ${scaler.version} wants hot ${want.hot}, warm ${want.warm}, `
        + `standby ${want.standby}` + (scaler.acting ? "" : " (as the leading controller decided)")));
      box.append(h("ul", { class: "reasons", id: "reasons" }, (scaler.reasons || []).map((r) => h("li", {}, r))));
      box.append(table("forecast", [
        { key: "tier", label: "Tier" }, { key: "from", label: "From" },
        { key: "horizon_s", label: "Horizon s", num: true, cell: (r) => num(r.horizon_s, 1) },
        { key: "units_per_s", label: "Forecast units/s", num: true, cell: (r) => num(r.units_per_s, 3) },
        { key: "replicas", label: "Replicas", num: true },
      ], scaler.forecast || []));
      box.append(h("h2", {}, "Decisions"));
      const decisions = (scaler.decisions || []).slice().reverse();
      box.append(table("decisions", [
        { key: "at", label: "At", cell: (r) => when(r.at) },
        { key: "arrived_units_per_s", label: "Arrived units/s", num: true, cell: (r) => num(r.arrived_units_per_s, 3) },
        { key: "ready_hot", label: "Ready hot", num: true, value: (r) => r.ready.hot, cell: (r) => r.ready.hot },
        { key: "hot", label: "Want hot", num: true }, { key: "warm", label: "Want warm", num: true },
        { key: "standby", label: "Want standby", num: true },
      ], decisions));
    }
    put(view, "autoscaler", box);

    // replicas now
    put(view, "h-replicas", h("h2", { id: "h-replicas" }, "Replicas"));
    put(view, "replicas", table("replicas", [
      { key: "replica_id", label: "Replica", cell: (r) => h("code", {}, r.replica_id) },
      { key: "version", label: "Version" },
      { key: "state", label: "State", cell: (r) => badge(r.state) },
      { key: "tier", label: "Tier", cell: (r) => badge(r.tier) },
      { key: "inflight_units", label: "In flight", num: true, cell: (r) => num(r.inflight_units, 2) },
      { key: "uptime_s", label: "Up s", num: true, cell: (r) => num(r.uptime_s, 0) },
      { key: "reason", label: "Reason" },
    ], replicas.map((r) => ({ ...r, _row: r.replica_id })), "No replicas"));

    // cold starts (ready events) with their stages, and the other events
    const firsts = (answers && answers.first_answers) || {};
    const starts = events.filter((e) => e.event === "ready").reverse().map((e) => ({
      ...e, _row: e.replica_id,
      first_answer_s: firsts[e.replica_id] !== undefined ? Math.max(0, firsts[e.replica_id] - e.at) : null,
    }));
    put(view, "h-coldstarts", h("h2", { id: "h-coldstarts" }, "Cold starts"));
    put(view, "coldstarts", table("coldstarts", [
      { key: "at", label: "At", cell: (r) => when(r.at) },
      { key: "replica_id", label: "Replica", cell: (r) => h("code", {}, r.replica_id) },
      { key: "version", label: "Version" },
      { key: "startup_s", label: "To ready s", num: true, cell: (r) => num(r.startup_s, 2) },
      { key: "stages", label: "Stages (s)", value: (r) => (r.load || []).length,
        cell: (r) => (r.load || []).map((s) => `${s.name} ${num(s.seconds, 3)}`).join(" \u00b7 ") || dash },
      { key: "first_answer_s", label: "First answer after ready s", num: true,
        cell: (r) => num(r.first_answer_s, 2) },
    ], starts, "No cold start recorded by this API process"));
    const others = events.filter((e) => e.event !== "ready").reverse();
    put(view, "h-events", h("h2", { id: "h-events" }, "Replica events"));
    put(view, "events", table("events", [
      { key: "at", label: "At", cell: (r) => when(r.at) },
      { key: "event", label: "Event" },
      { key: "replica_id", label: "Replica", cell: (r) => h("code", {}, r.replica_id) },
      { key: "version", label: "Version" },
      { key: "reason", label: "Reason" },
    ], others, "No events"));
  }

  async function jobsPage(view) {
    const data = await must("/v1/dashboard/jobs");
    put(view, "title", h("h1", { id: "title" }, "Jobs"));
    put(view, "h-queue", h("h2", { id: "h-queue" }, "Queue depth"));
    put(view, "queue", table("queue", [
      { key: "deployment", label: "Deployment" },
      { key: "priority", label: "Priority", num: true },
      { key: "status", label: "State", cell: (r) => badge(r.status) },
      { key: "jobs", label: "Jobs", num: true },
      { key: "units", label: "Model units", num: true, cell: (r) => num(r.units, 1) },
    ], data.queue, "Nothing queued"));
    put(view, "h-recent", h("h2", { id: "h-recent" }, "Recent jobs"));
    put(view, "jobs", table("jobs", [
      { key: "id", label: "Job", cell: (r) => h("code", {}, r.id) },
      { key: "deployment", label: "Deployment" },
      { key: "version", label: "Version" },
      { key: "status", label: "Status", cell: (r) => badge(r.status) },
      { key: "priority", label: "Priority", num: true },
      { key: "instances", label: "Instances", num: true },
      { key: "attempt_count", label: "Attempts", num: true },
      { key: "created_at", label: "Created", cell: (r) => when(r.created_at) },
      { key: "finished_at", label: "Finished", cell: (r) => when(r.finished_at) },
      { key: "error", label: "Error" },
    ], data.recent.map((j) => ({ ...j, _row: j.id })), "No jobs"));
  }

  async function batchPage(view) {
    const data = await must("/v1/dashboard/batch");
    put(view, "title", h("h1", { id: "title" }, "Batch"));
    put(view, "h-schedules", h("h2", { id: "h-schedules" }, "Schedules"));
    put(view, "schedules", table("schedules", [
      { key: "name", label: "Schedule" },
      { key: "cron", label: "Cron", cell: (r) => h("code", {}, r.cron) },
      { key: "timezone", label: "Time zone" },
      { key: "paused", label: "Paused", cell: (r) => (r.paused ? "paused" : "active") },
      { key: "next_fire_at", label: "Next fire", cell: (r) => when(r.next_fire_at) },
      { key: "last_fired_at", label: "Last fired", cell: (r) => when(r.last_fired_at) },
    ], data.schedules.map((s) => ({ ...s, _row: s.name })), "No schedules"));
    put(view, "h-runs", h("h2", { id: "h-runs" }, "Runs"));
    put(view, "runs", table("runs", [
      { key: "id", label: "Run", cell: (r) => h("code", {}, r.id) },
      { key: "schedule", label: "Schedule" },
      { key: "status", label: "Status", cell: (r) => badge(r.status) },
      { key: "model", label: "Model", cell: (r) => `${r.model}:${r.version}` },
      { key: "progress", label: "Progress", value: (r) => r.progress.rows_scored,
        cell: (r) => h("span", {}, h("progress", { max: Math.max(1, r.progress.rows_total), value: r.progress.rows_scored }),
          ` ${r.progress.rows_scored} / ${r.progress.rows_total} rows`) },
      { key: "shards", label: "Shards", value: (r) => r.progress.shards_done,
        cell: (r) => `${r.progress.shards_done} / ${r.progress.shards_total}` },
      { key: "rows_per_s", label: "Rows/s", num: true, value: (r) => r.progress.rows_per_s,
        cell: (r) => num(r.progress.rows_per_s, 1) },
      { key: "eta_s", label: "ETA s", num: true, value: (r) => r.progress.eta_s, cell: (r) => num(r.progress.eta_s, 0) },
      { key: "errors", label: "Shard errors", num: true, value: (r) => r.shard_errors.length,
        cell: (r) => String(r.shard_errors.length) },
      { key: "created_at", label: "Created", cell: (r) => when(r.created_at) },
    ], data.runs.map((r) => ({ ...r, _row: r.id })), "No runs"));
  }

  async function allPages(path) {
    const items = [];
    let cursor = null;
    for (let i = 0; i < 20; i++) {
      const page = await must(`${path}${path.includes("?") ? "&" : "?"}limit=500${cursor ? `&cursor=${q(cursor)}` : ""}`);
      items.push(...page.items);
      cursor = page.next_cursor;
      if (!cursor) break;
    }
    return items;
  }

  async function modelsPage(view, selected) {
    const models = await allPages("/v1/models");
    const deps = await allPages("/v1/deployments");
    const held = {};  // "model:version" -> where it is loaded
    await Promise.all(deps.map(async (d) => {
      const r = await maybe(`/v1/deployments/${q(d.name)}/replicas`);
      for (const rep of r ? r.replicas : []) {
        const k = `${rep.model}:${rep.version}`;
        (held[k] = held[k] || []).push(`${rep.tier} replica ${rep.replica_id} (${rep.state})`);
      }
    }));
    const versions = [];
    for (const m of models) {
      for (const v of await allPages(`/v1/models/${q(m.name)}/versions`)) {
        versions.push({ ...v, description: m.description });
      }
    }
    put(view, "title", h("h1", { id: "title" }, "Models"));
    put(view, "models", table("models", [
      { key: "model", label: "Model" },
      { key: "version", label: "Version",
        cell: (r) => h("a", { href: `#/models/${q(r.model)}/${q(r.version)}` }, r.version) },
      { key: "description", label: "Description" },
      { key: "status", label: "Status", cell: (r) => badge(r.status) },
      { key: "engine", label: "Engine" },
      { key: "size_bytes", label: "Size", num: true, cell: (r) => bytes(r.size_bytes) },
      { key: "files", label: "Files", num: true, value: (r) => (r.files || []).length,
        cell: (r) => String((r.files || []).length || 1) },
      { key: "sha256", label: "sha256", cell: (r) => h("code", { title: r.sha256 || "" }, (r.sha256 || dash).slice(0, 16)) },
      { key: "cached", label: "Loaded in", value: (r) => (held[`${r.model}:${r.version}`] || []).length,
        cell: (r) => (held[`${r.model}:${r.version}`] || []).join("; ") || dash },
    ], versions.map((v) => ({ ...v, _row: `${v.model}:${v.version}` })), "No models"));
    const detail = h("div", { id: "manifest", class: "card" });
    const chosen = selected && versions.find((v) => v.model === selected[0] && v.version === selected[1]);
    if (chosen) {
      detail.append(h("h2", {}, `Manifest of ${chosen.model}:${chosen.version}`),
        h("p", {}, "Artifact ", h("code", {}, chosen.artifact_uri)),
        chosen.status_reason ? h("p", { class: "error" }, chosen.status_reason) : "",
        table("files", [
          { key: "path", label: "File", cell: (r) => h("code", {}, r.path) },
          { key: "size", label: "Size", num: true, cell: (r) => bytes(r.size) },
          { key: "sha256", label: "sha256", cell: (r) => h("code", {}, r.sha256 || dash) },
        ], (chosen.files || [{ path: chosen.artifact_uri.split("/").pop(), size: chosen.size_bytes, sha256: chosen.sha256 }])
          .map((f) => ({ ...f, _row: f.path }))));
    } else {
      detail.append(h("p", { class: "muted" }, "Pick a version to see its manifest."));
    }
    put(view, "manifest", detail);
  }

  // --- routing, polling, sign-in ---------------------------------------------------------

  function route() {
    const parts = (location.hash || "#/deployments").slice(2).split("/").map(decodeURIComponent);
    return parts;
  }

  async function render() {
    const mine = ++generation;
    if (timer) clearTimeout(timer);
    const view = $("view");
    let backoff = 0;
    const parts = route();
    const page = parts[0] || "deployments";
    for (const a of document.querySelectorAll("#nav a")) {
      a.classList.toggle("current", a.dataset.page === page);
    }
    if (view.dataset.route !== parts.join("/")) {
      dropPlots(view);
      clear(view);
      view.dataset.route = parts.join("/");
    }
    try {
      if (page === "deployments" && parts[1]) await deploymentPage(view, parts[1]);
      else if (page === "deployments") await deploymentsPage(view);
      else if (page === "jobs") await jobsPage(view);
      else if (page === "batch") await batchPage(view);
      else if (page === "models") await modelsPage(view, parts[1] ? [parts[1], parts[2]] : null);
      else throw Object.assign(new Error("No such page"), { status: 404 });
      if (mine !== generation) return;
      $("error").hidden = true;
      view.dataset.updated = String(Date.now());
    } catch (e) {
      if (e instanceof Refused || mine !== generation) return;
      if (e.status === 429) backoff = 1000 * Math.min(60, Math.max(2, e.retryAfter || 5));
      const msg = e.status === 404 ? `Not found: ${e.message}` :
        e.status === 403 ? `Refused: ${e.message}` :
        e.status === 429 ? `Slowing down (rate limited): ${e.message}` :
        `Could not load this page: ${e.message}`;
      $("error").textContent = msg;
      $("error").hidden = false;
      if (e.status === 404 || e.status === 403) clear(view);
    }
    if (mine === generation && sessionStorage.getItem(KEY)) {
      // the models page changes seldom and costs a request per model: polled slower
      timer = setTimeout(render, backoff || (page === "models" ? 5 * POLL_MS : POLL_MS));
    }
  }

  function signOut(message) {
    sessionStorage.removeItem(KEY);
    sessionStorage.removeItem(TENANT);
    if (timer) clearTimeout(timer);
    generation++;
    $("nav").hidden = true;
    dropPlots($("view"));
    clear($("view")).dataset.route = "";
    $("view").hidden = true;
    $("error").hidden = true;
    $("signout").hidden = true;
    $("tenant-pick").hidden = true;
    $("who").textContent = "";
    $("signin").hidden = false;
    $("signin-error").textContent = message || "";
  }

  async function signedIn() {
    const who = await api("/v1/whoami");
    if (!who.ok) {
      const detail = (who.body && who.body.detail) || `HTTP ${who.status}`;
      signOut(`This key may not use the dashboard: ${detail}`);
      return;
    }
    $("signin").hidden = true;
    $("nav").hidden = false;
    $("view").hidden = false;
    $("signout").hidden = false;
    $("who").textContent = `${who.body.tenant} \u00b7 ${who.body.scope}`;
    $("who").dataset.scope = who.body.scope;
    if (who.body.scope === "admin") {
      const tenants = await maybe("/v1/tenants?limit=500");
      const pick = clear($("tenant"));
      const current = sessionStorage.getItem(TENANT) || who.body.tenant;
      for (const t of tenants ? tenants.items : []) {
        pick.append(h("option", { value: t.name, selected: t.name === current ? "selected" : null }, t.name));
      }
      $("tenant-pick").hidden = !(tenants && tenants.items.length > 1);
    }
    render();
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("signin-form").addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const key = $("key").value.trim();
      $("key").value = "";
      if (!key) return;
      sessionStorage.setItem(KEY, key);
      sessionStorage.removeItem(TENANT);
      try {
        const who = await api("/v1/whoami");
        if (!who.ok) {
          signOut(`That key was refused: ${(who.body && who.body.detail) || `HTTP ${who.status}`}`);
          return;
        }
      } catch (e) {
        if (e instanceof Refused) {
          signOut("That API key was refused: it is unknown or revoked.");
          return;
        }
        signOut(`Could not reach the API: ${e.message}`);
        return;
      }
      signedIn();
    });
    $("signout").addEventListener("click", () => signOut(""));
    $("tenant").addEventListener("change", (ev) => {
      sessionStorage.setItem(TENANT, ev.target.value);
      dropPlots($("view"));
      clear($("view"));
      $("view").dataset.route = "";
      render();
    });
    window.addEventListener("hashchange", render);
    if (sessionStorage.getItem(KEY)) signedIn();
    else signOut("");
  });
})();
