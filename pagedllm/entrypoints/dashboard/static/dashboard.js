// pagedllm dashboard: reads /dashboard/events (SSE: one "init" event with the configuration
// and each engine's history, then one update a second) and draws it. Charts are uPlot's;
// the KV block map is one square per block (or group of blocks) on a canvas.
"use strict";

(function () {
  const MAX_POINTS = 300;
  const COLORS = { free: "#334155", used: "#3b82f6", cached: "#22c55e" };
  const STATE_COLORS = [COLORS.free, COLORS.used, COLORS.cached];
  const CHARTS = [
    { id: "chart-tps", series: [["generation", "gen_tps", "#3b82f6"], ["prompt", "prompt_tps", "#a855f7"]] },
    { id: "chart-ttft", series: [["p50", "ttft_p50", "#22c55e"], ["p99", "ttft_p99", "#ef4444"]] },
    { id: "chart-itl", series: [["p50", "itl_p50", "#22c55e"], ["p99", "itl_p99", "#ef4444"]] },
    {
      id: "chart-step",
      series: [
        ["scheduling", "sched_ms", "#f59e0b"], ["model", "model_ms", "#3b82f6"],
        ["sampling", "sampling_ms", "#a855f7"], ["output", "output_ms", "#22c55e"],
      ],
    },
  ];

  const view = {
    fields: [],
    series: [], // per engine: one array per field (column-wise, as uPlot wants)
    latest: [], // per engine: the last update's non-chart state
    engine: 0,
    charts: [],
    ticks: 0,
  };
  window.pagedllmDashboard = view; // for the browser test and for curious operators

  const $ = (id) => document.getElementById(id);

  function fmt(value, digits) {
    return value === null || value === undefined ? "-" : Number(value).toFixed(digits);
  }

  function chartSize(el) {
    return { width: Math.max(el.clientWidth, 200), height: 200 };
  }

  function makeCharts() {
    view.charts.forEach((c) => c.destroy());
    view.charts = CHARTS.map((spec) => {
      const el = $(spec.id);
      el.textContent = "";
      const opts = {
        ...chartSize(el),
        scales: { x: { time: true } },
        axes: [
          { stroke: "#94a3b8", grid: { stroke: "#334155" } },
          { stroke: "#94a3b8", grid: { stroke: "#334155" } },
        ],
        series: [{}].concat(spec.series.map(([label, , color]) => ({ label, stroke: color, width: 2 }))),
      };
      return new uPlot(opts, chartData(spec), el);
    });
  }

  function chartData(spec) {
    const cols = view.series[view.engine];
    const col = (name) => (cols ? cols[view.fields.indexOf(name)] : []);
    return [col("t")].concat(spec.series.map(([, name]) => col(name)));
  }

  function redrawCharts() {
    view.charts.forEach((chart, i) => chart.setData(chartData(CHARTS[i])));
  }

  function drawBlockMap(state) {
    const canvas = $("block-map");
    const note = $("cell-note");
    if (!state.blocks) {
      note.textContent = "(waiting for the engine)";
      return;
    }
    const states = Uint8Array.from(atob(state.blocks), (c) => c.charCodeAt(0));
    const width = canvas.clientWidth || 800;
    const n = states.length;
    const size = Math.max(3, Math.min(14, Math.floor(Math.sqrt((width * 140) / n))));
    const cols = Math.max(1, Math.floor(width / size));
    const rows = Math.ceil(n / cols);
    const ratio = window.devicePixelRatio || 1;
    canvas.style.height = rows * size + "px";
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(rows * size * ratio);
    const ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    const gap = size > 4 ? 1 : 0;
    for (let i = 0; i < n; i++) {
      ctx.fillStyle = STATE_COLORS[states[i]] || COLORS.free;
      ctx.fillRect((i % cols) * size, Math.floor(i / cols) * size, size - gap, size - gap);
    }
    note.textContent =
      state.blocks_per_cell > 1 ? `(one square per ${state.blocks_per_cell} blocks: the busiest)` : "";
  }

  function drawRequests(state) {
    const body = $("requests").tBodies[0];
    const rows = (state.requests || []).map(([id, status, prompt, computed, output, age, preempted]) => {
      const tr = document.createElement("tr");
      const pct = prompt ? Math.round((100 * computed) / prompt) : 100;
      const cells = [id, status, null, output, `${fmt(age, 1)} s`, preempted];
      cells.forEach((text, i) => {
        const td = document.createElement("td");
        if (i === 2) {
          const bar = document.createElement("span");
          bar.className = "bar";
          const fill = document.createElement("span");
          fill.style.width = pct + "%";
          bar.appendChild(fill);
          td.append(bar, ` ${computed}/${prompt}`);
        } else {
          td.textContent = String(text);
        }
        tr.appendChild(td);
      });
      return tr;
    });
    body.replaceChildren(...rows);
    const listed = rows.length;
    const total = (state.num_running || 0) + (state.num_waiting || 0);
    $("req-note").textContent = total > listed ? `(${listed} of ${total} shown)` : "";
  }

  function drawState() {
    const state = view.latest[view.engine];
    if (!state) return;
    const cols = view.series[view.engine];
    const gen = cols[view.fields.indexOf("gen_tps")];
    $("gen-tps").textContent = fmt(gen[gen.length - 1], 1);
    $("kv-usage").textContent = fmt(100 * state.kv_usage, 1) + " %";
    $("kv-blocks").textContent = state.num_blocks ?? "-";
    $("hit-rate").textContent = fmt(100 * state.prefix_hit_rate, 1) + " %";
    $("queues").textContent = `${state.running} / ${state.waiting}`;
    $("preemptions").textContent = state.preemptions ?? "-";
    const health = $("health");
    const ok = state.health === "ok";
    health.textContent = ok ? "healthy" : state.health;
    health.className = "badge " + (ok ? "ok" : state.health.startsWith("stalled") ? "warn" : "bad");
    drawBlockMap(state);
    drawRequests(state);
  }

  function showConfig(config) {
    $("model").textContent = config.served_model_name;
    const dl = $("config");
    dl.replaceChildren();
    Object.entries(config).forEach(([key, value]) => {
      const dt = document.createElement("dt");
      dt.textContent = key;
      const dd = document.createElement("dd");
      dd.textContent = typeof value === "object" && value !== null ? JSON.stringify(value) : String(value);
      dl.append(dt, dd);
    });
    const engines = config.data_parallel_size;
    const select = $("engine");
    select.replaceChildren();
    for (let r = 0; r < engines; r++) select.add(new Option(`${r} of ${engines}`, String(r)));
    select.value = String(view.engine);
    $("engine-select").hidden = engines < 2;
    $("engine-label").textContent = engines < 2 ? "" : "data-parallel engine shown:";
  }

  function onInit(event) {
    const init = JSON.parse(event.data);
    view.fields = init.fields;
    view.series = init.history.map((columns) =>
      init.fields.map((_, i) => (columns.length ? Array.from(columns[i]) : []))
    );
    view.latest = view.series.map(() => null);
    view.engine = Math.min(view.engine, view.series.length - 1);
    showConfig(init.config);
    makeCharts();
  }

  function onUpdate(event) {
    const update = JSON.parse(event.data);
    update.engines.forEach((engine, r) => {
      const cols = view.series[r];
      engine.point.forEach((value, i) => {
        cols[i].push(value);
        if (cols[i].length > MAX_POINTS) cols[i].shift();
      });
      view.latest[r] = engine;
    });
    view.ticks += 1;
    redrawCharts();
    drawState();
  }

  $("engine").addEventListener("change", (e) => {
    view.engine = Number(e.target.value);
    redrawCharts();
    drawState();
  });
  window.addEventListener("resize", () => {
    view.charts.forEach((chart, i) => chart.setSize(chartSize($(CHARTS[i].id))));
    drawState();
  });

  const source = new EventSource("dashboard/events");
  source.addEventListener("init", onInit);
  source.addEventListener("message", onUpdate);
  source.addEventListener("error", () => {
    const health = $("health");
    health.textContent = "disconnected (retrying)";
    health.className = "badge bad";
  });
})();
