// The dipaco dashboard: reads the coordinator's REST API (../v1/...) with a bearer token and redraws every
// POLL_MS without reloading. Nothing here talks to any other origin; every value from the server is put into
// the page as text (textContent), never as HTML.
"use strict";

(function () {
  const POLL_MS = 3000;
  const PAGE = 1000; // the API's largest `limit`
  const EVENTS_KEPT = 200;
  const TOKEN_KEY = "dipaco.token";
  const RUN_KEY = "dipaco.run";
  // 20 distinct colours (Tableau 10 and its light/dark companions): one per path, repeating past 20
  const COLOURS = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#393b79", "#e6550d", "#31a354", "#843c39", "#7b4173", "#b5cf6b", "#de9ed6", "#636363", "#8c6d31", "#6baed6",
  ];

  const $ = (id) => document.getElementById(id);
  const state = {
    token: null,
    timer: null,
    runId: null,
    history: { runId: null, rounds: [], signature: "" },
    chart: null,
    chartPaths: 0,
    events: [],
    lastEventId: 0,
    lastOk: null,
    busy: false,
    again: false,
    generation: 0,
  };

  // A reply to a request sent with a token the page no longer holds (forgotten, or another typed in meanwhile):
  // it is dropped, never drawn.
  class Stale extends Error {}

  class HttpError extends Error {
    constructor(status, detail) {
      super(`HTTP ${status}: ${detail}`);
      this.status = status;
      this.detail = detail;
    }
  }

  // -- token ------------------------------------------------------------------------------------------------

  function tokenFromFragment() {
    // not URLSearchParams: it would read a "+" in a token as a space
    const match = /(?:^|&)token=([^&]*)/.exec(location.hash.replace(/^#/, ""));
    let token = "";
    try {
      token = match ? decodeURIComponent(match[1]) : "";
    } catch (e) {
      token = ""; // a malformed fragment: ask instead
    }
    if (match) {
      // the token leaves the address bar (and the history) at once
      history.replaceState(null, "", location.pathname + location.search);
    }
    if (token) {
      sessionStorage.setItem(TOKEN_KEY, token);
    }
  }

  function showLogin(message) {
    stopPolling();
    state.token = null;
    $("dashboard").hidden = true;
    $("sign-out").hidden = true;
    $("login").hidden = false;
    $("login-error").textContent = message || "";
    $("status").textContent = "";
    clearData();
    $("token-input").focus();
  }

  function clearData() {
    for (const id of ["runs", "timeline", "modules", "paths", "islands", "events"]) {
      $(id).tBodies[0].replaceChildren();
    }
    if (state.chart) {
      state.chart.destroy();
      state.chart = null;
    }
    const chart = $("loss-chart");
    chart.replaceChildren();
    chart.dataset.paths = "0";
    chart.dataset.points = "0";
    chart.dataset.rounds = "0";
    state.history = { runId: null, rounds: [], signature: "" };
    state.events = [];
    state.lastEventId = 0;
    $("run-section").hidden = true;
  }

  function signIn(token) {
    state.token = token;
    $("login").hidden = true;
    $("dashboard").hidden = false;
    $("sign-out").hidden = false;
    startPolling();
  }

  // -- HTTP -------------------------------------------------------------------------------------------------

  async function api(path, params) {
    const token = state.token;
    const url = new URL("../v1/" + path, location.href);
    for (const [k, v] of Object.entries(params || {})) {
      if (v !== null && v !== undefined) url.searchParams.set(k, v);
    }
    const response = await fetch(url, {
      headers: { Authorization: "Bearer " + token, Accept: "application/json" },
      cache: "no-store",
      credentials: "omit",
    });
    if (!response.ok) {
      let detail = response.statusText;
      try {
        const body = await response.json();
        detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
      } catch (e) {
        /* not JSON: keep the status text */
      }
      if (state.token !== token) throw new Stale();
      throw new HttpError(response.status, detail);
    }
    const body = await response.json();
    if (state.token !== token) throw new Stale();
    return body;
  }

  // -- formatting -------------------------------------------------------------------------------------------

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k === "title") node.title = v;
      else node.dataset[k] = v;
    }
    for (const child of children) {
      node.append(child instanceof Node ? child : document.createTextNode(child === null ? "" : String(child)));
    }
    return node;
  }

  const fmtNum = (x, digits) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));
  const fmtInt = (x) => (x === null || x === undefined ? "–" : Number(x).toLocaleString("en-US"));
  function fmtSeconds(s) {
    if (s === null || s === undefined) return "–";
    if (s < 60) return s.toFixed(1) + " s";
    if (s < 3600) return (s / 60).toFixed(1) + " min";
    return (s / 3600).toFixed(1) + " h";
  }
  function fmtTime(iso) {
    if (!iso) return "–";
    return new Date(iso).toLocaleTimeString("en-GB", { hour12: false });
  }
  function fmtAgo(iso) {
    if (!iso) return "never";
    const s = Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000);
    return s < 1 ? "just now" : fmtSeconds(s) + " ago";
  }
  function fmtBytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) {
      n /= 1024;
      i += 1;
    }
    return n.toFixed(i ? 1 : 0) + " " + units[i];
  }
  const seconds = (a, b) => (a && b ? (new Date(b).getTime() - new Date(a).getTime()) / 1000 : null);

  function fill(tableId, rows) {
    $(tableId).tBodies[0].replaceChildren(...rows);
  }

  // -- reads ------------------------------------------------------------------------------------------------

  // one page of the largest size: the dashboard shows at most that many runs, islands, modules, paths
  const firstPage = (path, params) => api(path, { ...params, limit: PAGE });

  async function pollRuns() {
    const [runs, stats] = await Promise.all([firstPage("runs"), firstPage("run-stats")]);
    const byRun = new Map(stats.data.map((s) => [s.run_id, s]));
    if (state.runId === null || !runs.data.some((r) => r.id === state.runId)) {
      const saved = Number(sessionStorage.getItem(RUN_KEY));
      const running = runs.data.filter((r) => r.status === "running");
      const newest = runs.data[runs.data.length - 1];
      const pick = runs.data.find((r) => r.id === saved) || running[running.length - 1] || newest;
      state.runId = pick ? pick.id : null;
    }
    fill(
      "runs",
      runs.data.map((r) => {
        const s = byRun.get(r.id) || {};
        const rounds = r.status === "finished" ? r.num_rounds : r.current_round;
        const row = el(
          "tr",
          { run: String(r.id), class: r.id === state.runId ? "selected" : "" },
          el("td", {}, r.id),
          el("td", {}, r.name),
          el("td", { class: "status-" + r.status }, r.status.replace(/_/g, " ")),
          el("td", {}, `${rounds} / ${r.num_rounds}`),
          el("td", {}, (r.config && r.config.sync) || "round"),
          el("td", {}, r.num_paths),
          el("td", {}, s.islands_active ?? "–"),
          el("td", { class: "num" }, fmtInt(s.tokens_trained)),
          el("td", { class: "num" }, fmtNum(s.latest_train_loss, 3)),
          el("td", { class: "num" }, fmtSeconds(s.mean_round_s)),
          el("td", { class: "num" }, fmtSeconds(s.last_round_s))
        );
        row.addEventListener("click", () => selectRun(r.id));
        return row;
      })
    );
    return runs.data.find((r) => r.id === state.runId) || null;
  }

  function selectRun(runId) {
    state.runId = runId;
    sessionStorage.setItem(RUN_KEY, String(runId));
    for (const row of $("runs").tBodies[0].rows) row.classList.toggle("selected", row.dataset.run === String(runId));
    poll();
  }

  async function pollRun(run) {
    if (run === null) {
      $("run-section").hidden = true;
      return;
    }
    $("run-section").hidden = false;
    $("run-title").textContent = `Run ${run.id} · ${run.name} · layout ${run.layout} · H=${run.inner_steps}`;
    const h = state.history;
    if (h.runId !== run.id) {
      state.history = { runId: run.id, rounds: [], signature: "" };
      if (state.chart) {
        state.chart.destroy();
        state.chart = null;
      }
    }
    // only the rounds from the first one not applied yet: applied rounds never change
    const keep = state.history.rounds.filter((r) => r.status === "applied");
    let offset = keep.length;
    const fresh = [];
    let page;
    do {
      page = await api(`runs/${run.id}/history`, { offset: offset, limit: PAGE });
      fresh.push(...page.data);
      offset += page.data.length;
    } while (page.data.length && offset < page.count);
    const rounds = keep.concat(fresh);
    // modules and paths change only when an upload is accepted or a round applied
    const signature = rounds.map((r) => `${r.number}:${r.status}:${r.contributions}`).join(",");
    if (signature !== state.history.signature) {
      const [modules, paths] = await Promise.all([
        firstPage("modules", { run_id: run.id }),
        firstPage("paths", { run_id: run.id }),
      ]);
      drawModules(modules.data);
      drawPaths(paths.data);
    }
    state.history.rounds = rounds;
    state.history.signature = signature;
    drawTimeline(rounds, page.num_paths);
    drawChart(rounds, page.num_paths);
  }

  function drawTimeline(rounds, numPaths) {
    fill(
      "timeline",
      rounds
        .slice()
        .reverse()
        .map((r) =>
          el(
            "tr",
            { round: String(r.number) },
            el("td", {}, r.number),
            el("td", { class: "status-" + r.status }, r.status),
            el("td", {}, fmtTime(r.opened_at)),
            el("td", {}, fmtTime(r.applied_at)),
            el("td", { class: "num" }, fmtSeconds(seconds(r.opened_at, r.applied_at))),
            el("td", { class: "num" }, `${r.contributions} / ${numPaths}`),
            el("td", {}, r.deadline ? `${r.quorum_paths} after ${fmtTime(r.deadline)}` : "all"),
            el("td", { class: r.refused_uploads ? "num warn" : "num" }, r.refused_uploads),
            el("td", { class: r.lease_expiries ? "num warn" : "num" }, r.lease_expiries)
          )
        )
    );
  }

  // [rounds, train loss of path 0..n-1, held-out loss of path 0..n-1 (null where not scored)]
  function chartData(rounds, numPaths) {
    const withLoss = rounds.filter((r) => r.losses.length);
    const xs = withLoss.map((r) => r.number);
    const ys = [];
    const held = [];
    for (let p = 0; p < numPaths; p++) {
      ys.push(withLoss.map(() => null));
      held.push(withLoss.map(() => null));
    }
    withLoss.forEach((r, i) => {
      for (const l of r.losses) {
        if (l.path_index >= numPaths) continue;
        ys[l.path_index][i] = l.train_loss;
        if (l.heldout_loss !== null && l.heldout_loss !== undefined) held[l.path_index][i] = l.heldout_loss;
      }
    });
    return [xs, ...ys, ...held];
  }

  function countPoints(series) {
    return series.reduce((n, ys) => n + ys.filter((y) => y !== null).length, 0);
  }

  function chartSize() {
    const box = $("loss-chart");
    return { width: Math.max(320, box.clientWidth || 600), height: 300 };
  }

  // uPlot draws a single x value across 0..100: show one round between its neighbours instead
  function xRange(u, min, max) {
    const xs = u.data[0];
    if (!xs || xs.length === 0) return [0, 1];
    if (xs.length === 1) return [Math.max(0, xs[0] - 1), xs[0] + 1];
    return [min, max];
  }

  function drawChart(rounds, numPaths) {
    const data = chartData(rounds, numPaths);
    const box = $("loss-chart");
    if (!state.chart || state.chartPaths !== numPaths) {
      if (state.chart) state.chart.destroy();
      box.replaceChildren();
      const series = [{ label: "round" }];
      for (let p = 0; p < numPaths; p++) {
        const colour = COLOURS[p % COLOURS.length];
        series.push({
          label: `path ${p}`,
          stroke: colour,
          width: 2,
          spanGaps: true, // a path missing from a round closed on quorum: join its neighbours
          points: { show: true, size: 6, fill: colour },
          value: (u, v) => (v === null || v === undefined ? "–" : v.toFixed(3)),
        });
      }
      for (let p = 0; p < numPaths; p++) {
        const colour = COLOURS[p % COLOURS.length];
        series.push({
          label: `path ${p} held-out`,
          stroke: colour,
          width: 1.5,
          dash: [6, 4],
          spanGaps: true,
          points: { show: true, size: 5, fill: "#fff" },
          value: (u, v) => (v === null || v === undefined ? "–" : `${v.toFixed(3)} (ppl ${Math.exp(v).toFixed(1)})`),
        });
      }
      const options = {
        ...chartSize(),
        series: series,
        scales: { x: { time: false, range: xRange } },
        axes: [
          {
            label: "round",
            labelSize: 24,
            incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000], // whole rounds only
            values: (u, v) => v.map(String),
          },
          { label: "loss (nats/token)", labelSize: 24, size: 60, values: (u, v) => v.map((x) => x.toFixed(2)) },
        ],
        legend: { show: true, live: true },
        cursor: { drag: { x: true, y: false } },
      };
      state.chart = new uPlot(options, data, box);
      state.chartPaths = numPaths;
      box.dataset.axes = JSON.stringify(state.chart.axes.map((a) => a.label)); // drawn on the canvas: say them
    } else {
      state.chart.setData(data);
    }
    box.dataset.paths = String(numPaths);
    box.dataset.rounds = String(data[0].length);
    box.dataset.points = String(countPoints(data.slice(1, 1 + numPaths)));
    const heldPoints = countPoints(data.slice(1 + numPaths));
    box.dataset.heldoutPoints = String(heldPoints);
    $("perplexity-note").hidden = heldPoints > 0;
    $("heldout-note").hidden = heldPoints === 0;
  }

  function drawModules(modules) {
    fill(
      "modules",
      modules.map((m) =>
        el(
          "tr",
          {},
          el("td", {}, `${m.level} ${m.level_name}`),
          el("td", {}, m.index),
          el("td", {}, m.sharing),
          el("td", { class: "num" }, m.version),
          m.weight_norm === null || m.weight_norm === undefined
            ? el("td", { class: "num", title: "not measured (written before weight norms were recorded)" }, "–")
            : el("td", { class: "num", title: String(m.weight_norm) }, fmtNum(m.weight_norm, 3)),
          el("td", { class: "num" }, fmtInt(m.num_params)),
          el("td", { title: m.updated_at }, fmtTime(m.updated_at))
        )
      )
    );
  }

  function drawPaths(paths) {
    fill(
      "paths",
      paths.map((p) =>
        el(
          "tr",
          {},
          el("td", {}, p.index),
          el("td", {}, "[" + p.module_indices.join(", ") + "]"),
          el("td", { class: "num" }, p.epoch),
          el("td", { class: "num" }, fmtInt(p.token_offset)),
          el("td", { class: "num" }, fmtInt(p.tokens_trained)),
          el("td", { class: "num" }, fmtNum(p.last_train_loss, 3))
        )
      )
    );
  }

  // tokens/s measured by the coordinator over the island's last contributions; before its first one, the join
  // probe's estimate, labelled as such
  function speedCell(measured, probe) {
    if (measured !== null && measured !== undefined) {
      return el("td", { class: "num", title: "measured over its last 10 contributions" }, fmtInt(Math.round(measured)));
    }
    if (probe === null || probe === undefined) return el("td", { class: "num" }, "–");
    return el(
      "td",
      { class: "num", title: "the join probe's estimate: no contribution measured yet" },
      fmtInt(Math.round(probe)),
      el("span", { class: "muted" }, " (probe)")
    );
  }

  async function pollIslands() {
    const [islands, leases] = await Promise.all([firstPage("islands"), firstPage("leases", { status: "active" })]);
    const current = new Map();
    for (const l of leases.data) if (!current.has(l.island_id)) current.set(l.island_id, l);
    fill(
      "islands",
      islands.data.map((i) => {
        const l = current.get(i.id);
        const caps = i.capabilities || {};
        const stats = i.stats || {};
        return el(
          "tr",
          { island: String(i.id) },
          el("td", {}, i.id),
          el("td", {}, i.name),
          el("td", {}, i.site),
          el("td", {}, caps.device || "–"),
          el("td", { class: "num" }, fmtBytes(caps.memory_bytes)),
          speedCell(stats.tokens_per_s, caps.tokens_per_s),
          el("td", { class: "num" }, fmtInt(stats.tokens_trained)),
          el("td", { class: "num", title: fmtInt(stats.upload_bytes) + " B" }, fmtBytes(stats.upload_bytes)),
          // no "bytes down" column: downloads (weights, shards) are not recorded per island, only counted per kind
          // in the process's metrics (dipaco_bytes_out), and direct transfers from a bucket not at all
          el("td", { title: i.last_heartbeat || "" }, fmtAgo(i.last_heartbeat)),
          el("td", {}, l ? `run ${l.run_id} · round ${l.round} · path ${l.path_index}` : "idle"),
          el("td", { class: "status-" + i.status }, i.status)
        );
      })
    );
    if (islands.count > islands.data.length) {
      $("islands").tBodies[0].append(el("tr", {}, el("td", {}, `… and ${islands.count - islands.data.length} more`)));
    }
  }

  async function pollEvents() {
    const page = await api("events", { after: state.lastEventId, order: "desc", limit: EVENTS_KEPT });
    if (page.data.length) {
      state.lastEventId = Math.max(state.lastEventId, ...page.data.map((e) => e.id));
      state.events = page.data.concat(state.events).slice(0, EVENTS_KEPT);
    }
    fill(
      "events",
      state.events.map((e) =>
        el(
          "tr",
          { kind: e.kind, class: "event-" + e.kind },
          el("td", { title: e.created_at }, fmtTime(e.created_at)),
          el("td", {}, e.kind.replace(/_/g, " ")),
          el("td", {}, e.run_id ?? "–"),
          el("td", {}, e.round ?? "–"),
          el("td", {}, e.path_index ?? "–"),
          el("td", {}, e.island_id ?? "–"),
          el("td", { class: "detail" }, e.detail)
        )
      )
    );
  }

  // -- polling ----------------------------------------------------------------------------------------------

  async function poll() {
    if (state.token === null) return;
    if (state.busy) {
      state.again = true; // e.g. a run was selected mid-poll: poll once more when this one ends
      return;
    }
    state.busy = true;
    try {
      const run = await pollRuns();
      await Promise.all([pollRun(run), pollIslands(), pollEvents()]);
      state.lastOk = new Date();
      const at = state.lastOk.toLocaleTimeString("en-GB", { hour12: false });
      $("status").textContent = `updated ${at}, every ${POLL_MS / 1000} s`;
      $("status").classList.remove("error");
    } catch (err) {
      if (err instanceof Stale) return;
      if (err instanceof HttpError && err.status === 401) {
        sessionStorage.removeItem(TOKEN_KEY);
        showLogin("The coordinator refused the token: " + err.detail);
        return;
      }
      $("status").textContent = "could not update: " + err.message;
      $("status").classList.add("error");
    } finally {
      state.busy = false;
    }
    if (state.again) {
      state.again = false;
      await poll();
    }
  }

  // The next poll is scheduled when one ends, so a slow coordinator is never asked twice at once; a tab nobody
  // looks at costs the coordinator nothing (it polls again as soon as it is shown).
  function schedule(generation) {
    state.timer = setTimeout(async () => {
      if (!document.hidden) await poll();
      if (generation === state.generation) schedule(generation); // not stopped or restarted meanwhile
    }, POLL_MS);
  }

  function startPolling() {
    stopPolling();
    poll();
    schedule(state.generation);
  }

  function stopPolling() {
    state.generation += 1;
    if (state.timer !== null) clearTimeout(state.timer);
    state.timer = null;
  }

  // -- start ------------------------------------------------------------------------------------------------

  function start() {
    $("coordinator").textContent = location.host;
    tokenFromFragment();
    $("login-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const token = $("token-input").value.trim();
      if (!token) return;
      sessionStorage.setItem(TOKEN_KEY, token);
      $("token-input").value = "";
      signIn(token);
    });
    $("sign-out").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      showLogin("");
    });
    window.addEventListener("resize", () => {
      if (state.chart) state.chart.setSize(chartSize());
    });
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden && state.token !== null) poll();
    });
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) signIn(token);
    else showLogin("");
  }

  start();
})();
