/* celery-ext dashboard: fetches /api/... and renders with DOM APIs only.
 * Job data is only ever put into the page as text (textContent / attribute values),
 * never parsed as HTML: there is no innerHTML in this file. */
(function () {
  "use strict";

  var body = document.body;
  var ROOT = body.dataset.root || "";
  var PAGE = body.dataset.page || "";
  var REFRESH = parseInt(body.dataset.refresh || "2000", 10) || 2000;
  // Seconds a queue's next job is due in from which the queues page says so (shorter
  // waits are a rate limit's ordinary spacing).
  var NOT_DUE_SHOWN = 1;
  var csrfMeta = document.querySelector('meta[name="csrf-token"]');
  var CSRF = csrfMeta ? csrfMeta.getAttribute("content") : "";
  var state = { offset: 0, limit: 100, prefix: "", window: "1h", history: null, historyAt: 0,
                filters: null, cursors: [], cursor: null, total: null };
  var timer = null;
  var busyAction = false;

  // -- helpers -------------------------------------------------------------------------
  function h(tag, attrs) {
    var node = document.createElement(tag);
    if (attrs) {
      Object.keys(attrs).forEach(function (k) {
        var v = attrs[k];
        if (v === null || v === undefined || v === false) return;
        if (k === "text") node.textContent = String(v);
        else if (k === "cls") node.className = v;
        else if (k === "on") Object.keys(v).forEach(function (e) { node.addEventListener(e, v[e]); });
        else if (k.indexOf("data-") === 0 || k === "title" || k === "href" || k === "type" ||
                 k === "disabled" || k === "colspan" || k === "id" || k === "role")
          node.setAttribute(k, v === true ? "" : String(v));
        else node[k] = v;
      });
    }
    for (var i = 2; i < arguments.length; i++) {
      var c = arguments[i];
      if (c === null || c === undefined || c === false) continue;
      if (Array.isArray(c)) c.forEach(function (x) { if (x) node.appendChild(typeof x === "string" ? document.createTextNode(x) : x); });
      else node.appendChild(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
    }
    return node;
  }

  function api(path, opts) {
    opts = opts || {};
    var init = { method: opts.method || "GET", credentials: "same-origin", headers: { "Accept": "application/json" } };
    if (init.method !== "GET") {
      init.headers["Content-Type"] = "application/json";
      init.headers["X-CSRF-Token"] = CSRF;
      init.body = JSON.stringify(opts.body || {});
    }
    return fetch(ROOT + path, init).then(function (r) {
      return r.json().catch(function () { return {}; }).then(function (data) {
        if (!r.ok) throw new Error((data && data.error) || ("HTTP " + r.status));
        return data;
      });
    });
  }

  function fmtNum(n) { return n === null || n === undefined ? "" : Number(n).toLocaleString(); }
  function fmtDur(s) {
    if (s === null || s === undefined) return "";
    s = Math.max(0, s);
    if (s < 1) return (s * 1000).toFixed(0) + " ms";
    if (s < 60) return s.toFixed(1) + " s";
    if (s < 3600) return Math.floor(s / 60) + " m " + Math.floor(s % 60) + " s";
    if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " m";
    return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
  }
  function pad(n) { return n < 10 ? "0" + n : String(n); }
  function fmtTime(ts) {
    if (!ts) return "";
    var d = new Date(ts * 1000), now = new Date();
    var time = pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds());
    if (d.toDateString() === now.toDateString()) return time;
    return d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + " " + time;
  }
  // The top of a 4-tick axis with round ticks (1, 2, 2.5 or 5 times a power of ten).
  function niceMax(v) {
    if (v <= 0) return 4;
    var step = v / 4, p = Math.pow(10, Math.floor(Math.log10(step))), m = step / p;
    return 4 * (m <= 1 ? 1 : m <= 2 ? 2 : m <= 2.5 ? 2.5 : m <= 5 ? 5 : 10) * p;
  }
  // Tick labels in the unit the axis's top calls for: runtimes of a few milliseconds read
  // "0.5 ms", not "0.00"; as many decimals as the step between ticks needs.
  function tickScale(top, unit) {
    if (unit !== "s" || top <= 0) return { factor: 1, suffix: "" };
    if (top < 0.001) return { factor: 1e6, suffix: " µs" };
    if (top < 1) return { factor: 1000, suffix: " ms" };
    return { factor: 1, suffix: " s" };
  }
  function fmtTick(val, step, scale) {
    var v = val * scale.factor, st = step * scale.factor, digits = 0;
    while (digits < 6 && Math.abs(st * Math.pow(10, digits) - Math.round(st * Math.pow(10, digits))) > 1e-6) digits++;
    return v.toFixed(digits) + (val === 0 ? "" : scale.suffix);
  }
  function preview(v, max) {
    if (v === null || v === undefined) return "";
    var s = typeof v === "string" ? v : JSON.stringify(v);
    max = max || 160;
    return s.length > max ? s.slice(0, max - 1) + "…" : s;
  }
  function badge(text, kind) { return h("span", { cls: "badge " + (kind || ""), text: text }); }
  function showError(msg) {
    var box = document.getElementById("error");
    if (!box) return;
    if (msg) { box.textContent = msg; box.hidden = false; } else { box.hidden = true; box.textContent = ""; }
  }
  function setLive(ok, msg) {
    var live = document.getElementById("live");
    if (!live) return;
    live.textContent = ok ? "updated " + new Date().toLocaleTimeString() : msg;
    live.className = "live" + (ok ? "" : " down");
  }

  function table(columns, rows, emptyText) {
    var head = h("tr", null, columns.map(function (c) { return h("th", { cls: c.num ? "num" : "", text: c.label }); }));
    var tbody = h("tbody");
    if (!rows.length) {
      tbody.appendChild(h("tr", null, h("td", { colspan: columns.length, cls: "empty", text: emptyText || "Nothing here." })));
    }
    rows.forEach(function (row) {
      var tr = h("tr", { "data-row": row.__key || "" });
      columns.forEach(function (c) {
        var v = c.render ? c.render(row) : row[c.key];
        var td = h("td", { cls: (c.num ? "num " : "") + (c.cls || "") });
        if (v instanceof Node) td.appendChild(v);
        else if (v !== null && v !== undefined) td.textContent = String(v);
        if (c.title) td.title = String(c.title(row) || "");
        tr.appendChild(td);
      });
      tbody.appendChild(tr);
    });
    return h("div", { cls: "table-wrap" }, h("table", null, h("thead", null, head), tbody));
  }

  function action(label, fn, opts) {
    opts = opts || {};
    return h("button", {
      type: "button", cls: "btn" + (opts.danger ? " danger" : ""), text: label,
      disabled: opts.disabled, "data-action": opts.name || label.toLowerCase(),
      on: { click: function (ev) {
        var btn = ev.currentTarget;
        if (opts.confirm && !window.confirm(opts.confirm)) return;
        btn.disabled = true;
        busyAction = true;
        Promise.resolve(fn()).then(function () { showError(null); })
          .catch(function (e) { showError(label + " failed: " + e.message); })
          .then(function () { busyAction = false; btn.disabled = false; refresh(); });
      } }
    });
  }

  function pager(total, count) {
    var from = total ? state.offset + 1 : 0, to = state.offset + count;
    return h("div", { cls: "pager" },
      h("span", { text: fmtNum(from) + "–" + fmtNum(to) + " of " + fmtNum(total) }),
      h("button", { type: "button", cls: "btn", text: "← Prev", disabled: state.offset <= 0,
        on: { click: function () { state.offset = Math.max(0, state.offset - state.limit); refresh(); } } }),
      h("button", { type: "button", cls: "btn", text: "Next →", disabled: to >= total,
        on: { click: function () { state.offset += state.limit; refresh(); } } }));
  }

  // -- charts (SVG, drawn by hand) ---------------------------------------------------------
  var SVGNS = "http://www.w3.org/2000/svg";
  function s(tag, attrs) {
    var n = document.createElementNS(SVGNS, tag);
    Object.keys(attrs || {}).forEach(function (k) { n.setAttribute(k, attrs[k]); });
    return n;
  }
  function chart(title, t, lines, unit) {
    var W = 600, H = 180, L = 44, R = 8, T = 8, B = 22;
    var svg = s("svg", { viewBox: "0 0 " + W + " " + H, preserveAspectRatio: "none", role: "img" });
    svg.setAttribute("aria-label", title);
    var max = 0;
    lines.forEach(function (ln) { ln.values.forEach(function (v) { if (v !== null && v > max) max = v; }); });
    var top = max;  // the largest value plotted (data-max: tests and scripts read it)
    max = niceMax(max);
    var t0 = t.length ? t[0] : 0, t1 = t.length ? t[t.length - 1] : 1;
    if (t1 - t0 < 60) t0 = t1 - 60;
    function x(v) { return L + (W - L - R) * (v - t0) / (t1 - t0 || 1); }
    function y(v) { return T + (H - T - B) * (1 - v / max); }
    var scale = tickScale(max, unit);
    for (var i = 0; i <= 4; i++) {
      var val = max * i / 4, yy = y(val);
      svg.appendChild(s("line", { x1: L, x2: W - R, y1: yy, y2: yy, "class": "axis" }));
      var lab = s("text", { x: L - 4, y: yy + 3, "text-anchor": "end", "class": "axis-label y-tick" });
      lab.textContent = fmtTick(val, max / 4, scale);
      svg.appendChild(lab);
    }
    [t0, (t0 + t1) / 2, t1].forEach(function (tv, j) {
      var lab = s("text", { x: x(tv), y: H - 6, "text-anchor": j === 0 ? "start" : j === 2 ? "end" : "middle", "class": "axis-label" });
      lab.textContent = j === 2 ? "now" : "-" + (t1 - tv < 120 ? Math.round(t1 - tv) + " s" : fmtDur(t1 - tv));
      svg.appendChild(lab);
    });
    lines.forEach(function (ln) {
      if (!t.length) return;
      var gap = true;  // null: no sample there, the line breaks
      var d = ln.values.map(function (v, k) {
        if (v === null || v === undefined) { gap = true; return ""; }
        var seg = (gap ? "M" : "L") + x(t[k]).toFixed(1) + "," + y(v).toFixed(1); gap = false; return seg;
      }).join(" ").trim();
      if (d) svg.appendChild(s("path", { d: d, fill: "none", stroke: ln.color, "stroke-width": 2, "vector-effect": "non-scaling-stroke" }));
      var k = ln.values.length - 1;  // the latest value as a dot (visible with one sample)
      while (k >= 0 && (ln.values[k] === null || ln.values[k] === undefined)) k--;
      if (k >= 0) svg.appendChild(s("circle", { cx: x(t[k]).toFixed(1), cy: y(ln.values[k]).toFixed(1), r: 3, fill: ln.color }));
    });
    var legend = h("div", { cls: "legend" }, lines.map(function (ln) {
      var last = 0;
      ln.values.forEach(function (v) { if (v !== null && v !== undefined) last = v; });
      var sw = h("i"); sw.style.background = ln.color;
      return h("span", null, sw, ln.label + ": " + (unit === "/s" ? last.toFixed(1) + "/s" : unit === "s" ? fmtDur(last) : fmtNum(last)));
    }));
    return h("div", { cls: "chart", "data-chart": title, "data-max": String(top) }, h("h3", { text: title }), svg, legend);
  }

  // -- pages ---------------------------------------------------------------------------
  function card(label, value, bad) {
    return h("div", { cls: "card" + (bad ? " bad" : "") }, h("div", { cls: "label", text: label }), h("div", { cls: "value", text: fmtNum(value) }));
  }

  var pages = {
    overview: function () {
      var fresh = state.history && state.history.window === state.window && Date.now() - state.historyAt < REFRESH * 5;
      var history = fresh ? Promise.resolve(state.history) : api("/api/history?window=" + state.window).then(function (hs) {
        state.history = hs; state.historyAt = Date.now(); return hs;
      });
      return Promise.all([api("/api/overview"), history]).then(function (both) {
        var d = both[0], s = both[1];
        var c = d.counts;
        setCounts(c);
        return [
          h("div", { cls: "cards" },
            card("Queued", c.queued), card("In flight", c.in_flight), card("Busy workers", c.busy),
            card("Worker pools", c.live_pools), card("Scheduled", c.scheduled), card("Retry", c.retry),
            card("Dead", c.dead, c.dead > 0), card("Processed", d.totals.processed), card("Failed", d.totals.failed, d.totals.failed > 0)),
          h("div", { cls: "toolbar", "data-testid": "history-window" }, h("span", { cls: "muted", text: "History (kept in Redis):" }),
            ["1h", "6h", "24h", "7d", "30d"].map(function (w) {
              return h("button", { type: "button", cls: "btn" + (w === state.window ? " active" : ""), text: w, "data-window": w,
                on: { click: function () { state.window = w; refresh(); } } });
            })),
          h("div", { cls: "charts" },
            chart("Throughput (jobs/s, per " + (s.resolution === 60 ? "minute" : "hour") + ")", s.t, [
              { label: "processed", values: s.processed_rate, color: "#2f6fde" },
              { label: "failed", values: s.failed_rate, color: "#c53030" }], "/s"),
            chart("Runtime", s.t, [
              { label: "p50", values: s.p50, color: "#1f8a4c" },
              { label: "p95", values: s.p95, color: "#b7791f" },
              { label: "p99", values: s.p99, color: "#c53030" }], "s"),
            chart("Queue sizes", s.t, [
              { label: "queued", values: s.queued, color: "#2f6fde" },
              { label: "in flight", values: s.in_flight, color: "#1f8a4c" },
              { label: "scheduled + retry", values: s.scheduled.map(function (v, i) { return v === null ? null : v + s.retry[i]; }), color: "#b7791f" },
              { label: "dead", values: s.dead, color: "#c53030" }]),
            chart("Queue latency (oldest job)", s.t, [
              { label: "latency", values: s.latency, color: "#6b46c1" }], "s")),
          h("h2", { text: "Largest job queues" }),
          queueTable(d.top_queues, false)
        ];
      });
    },

    queues: function () {
      var q = "/api/queues?offset=" + state.offset + "&limit=" + state.limit + (state.prefix ? "&prefix=" + encodeURIComponent(state.prefix) : "");
      return api(q).then(function (d) {
        return [queueTable(d.items, true), pager(d.total, d.items.length)];
      });
    },

    pools: function () {
      return api("/api/pools").then(function (d) {
        return table([
          { label: "Pool", key: "pool_id", cls: "mono" },
          { label: "Node", key: "node" },
          { label: "Host", key: "host" },
          { label: "PID", key: "pid", num: true },
          { label: "Pool type", render: function (p) { return p.pool_type + (p.concurrency ? " × " + p.concurrency : ""); } },
          { label: "State", render: function (p) { return badge(p.state, p.state === "running" ? "good" : p.state === "stopping" ? "warn" : "bad"); } },
          { label: "Heartbeat", render: function (p) { return p.heartbeat_age === null ? "never" : fmtDur(p.heartbeat_age) + " ago"; } },
          { label: "In flight", key: "in_flight", num: true },
          { label: "Started", render: function (p) { return fmtTime(p.started_at); } },
          { label: "Job queues", render: function (p) { return p.queues.length + ""; }, title: function (p) { return p.queues.join(", "); } }
        ], d.items, "No worker pools have registered.");
      });
    },

    busy: function () {
      return api("/api/busy").then(function (d) {
        return table([
          { label: "Job", render: function (b) { return h("span", null, h("strong", { text: b.job_name }), h("br"), h("a", { href: ROOT + "/demo?job=" + encodeURIComponent(b.job_id), cls: "mono", text: b.job_id })); } },
          { label: "Arguments", key: "args", cls: "args mono", title: function (b) { return b.args; } },
          { label: "Pool / slot", render: function (b) { return b.pool_id + " / " + b.slot; }, cls: "mono" },
          { label: "Running for", render: function (b) { return fmtDur(Date.now() / 1000 - b.started_at); } },
          { label: "Progress", render: function (b) {
            var wrap = h("span");
            if (b.progress !== null && b.progress !== undefined) {
              var bar = h("span", { cls: "progress" }, h("span"));
              bar.firstChild.style.width = Math.max(0, Math.min(100, b.progress * 100)) + "%";
              wrap.appendChild(bar);
              wrap.appendChild(document.createTextNode(Math.round(b.progress * 100) + "% "));
            }
            if (b.checkin_message) wrap.appendChild(h("span", { cls: "muted", text: b.checkin_message }));
            return wrap;
          } },
          { label: "Last checkin", render: function (b) { return b.checkin_at ? fmtDur(Date.now() / 1000 - b.checkin_at) + " ago" : "—"; } },
          { label: "State", render: function (b) {
            return b.stop_requested ? badge("stop requested", "warn") : b.stalled ? badge("stalled", "bad") : badge("running", "good"); } },
          { label: "", render: function (b) {
            return h("span", null,
              action("Stop", function () { return api("/api/busy/stop", { method: "POST", body: { job_id: b.job_id } }); },
                { disabled: b.stop_requested, name: "stop" }), " ",
              action("Cancel", function () { return api("/api/jobs/cancel", { method: "POST", body: { job_id: b.job_id } }); },
                { danger: true, confirm: "Cancel this job? It stops at its next checkin and will not run again.", name: "cancel" })); } }
        ], d.items.map(function (b) { b.__key = b.job_id; return b; }), "No job is running.");
      });
    },

    chords: function () {
      return api("/api/chords").then(function (d) {
        return table([
          { label: "Chord (group id)", key: "group_id", cls: "mono" },
          { label: "Header results", render: function (c) { return c.counted + " of " + (c.size === null ? "?" : c.size); } },
          { label: "Applied", render: function (c) { return fmtDur(d.server_time - c.applied_at) + " ago"; } }
        ], d.items.map(function (c) { c.__key = c.group_id; return c; }),
        "No chord is waiting for its header (or the app's result backend is not celery-ext's).");
      });
    },

    revoked: function () {
      return api("/api/revoked").then(function (d) {
        return table([
          { label: "Task id", render: function (r) { return h("a", { href: ROOT + "/demo?job=" + encodeURIComponent(r.task_id), cls: "mono", text: r.task_id }); } },
          { label: "Revoked by", render: function (r) { return (r.meta.by || "?") + (r.meta.via ? " (" + r.meta.via + ")" : ""); }, cls: "mono" },
          { label: "Terminate", render: function (r) { return r.meta.terminate ? badge("stop at checkin", "warn") : "—"; } },
          { label: "Lapses in", cls: "nowrap", render: function (r) { return fmtDur(r.lapses_at - d.server_time); },
            title: function (r) { return fmtTime(r.lapses_at); } }
        ], d.items.map(function (r) { r.__key = r.task_id; return r; }),
        "No revoke holds now.");
      });
    },

    scheduled: function () { return setPage("scheduled"); },
    retry: function () { return setPage("retry"); },

    periodic: function () {
      return api("/api/periodic").then(function (d) {
        function post(kind, e) { return api("/api/periodic/" + kind, { method: "POST", body: { name: e.name } }); }
        return table([
          { label: "Entry", render: function (e) { return h("span", null, h("strong", { text: e.name }), h("br"), h("span", { cls: "mono muted", text: e.task || "" })); } },
          { label: "Source", render: function (e) { return badge(e.source, e.source === "runtime" ? "warn" : ""); },
            title: function (e) { return e.source === "runtime" ? "set at runtime: wins over the app's beat_schedule entry of this name" : "the app's beat_schedule"; } },
          { label: "Schedule", key: "schedule", cls: "mono" },
          { label: "Next run", cls: "nowrap", render: function (e) { return e.paused ? "—" : fmtTime(e.next_due); },
            title: function (e) { return e.next_due ? "in " + fmtDur(e.next_due - d.server_time) : ""; } },
          { label: "Last run", cls: "nowrap", render: function (e) { return e.last_run_at ? fmtTime(e.last_run_at) : "never"; },
            title: function (e) { return e.last_job_id || ""; } },
          { label: "Outcome", render: function (e) {
            var o = e.last_outcome;
            return o ? badge(o, o === "success" ? "good" : o === "failure" ? "bad" : "warn") : "—"; } },
          { label: "Runs", key: "runs", num: true },
          { label: "Missed", key: "missed", num: true, title: function (e) { return e.error || ""; } },
          { label: "State", render: function (e) { return e.paused ? badge("paused", "warn") : badge("active", "good"); } },
          { label: "", render: function (e) {
            return h("span", { cls: "row-actions" },
              e.paused ? action("Resume", function () { return post("resume", e); }, { name: "periodic-resume" })
                       : action("Pause", function () { return post("pause", e); }, { name: "periodic-pause" }),
              action("Run now", function () { return post("run", e); }, { name: "periodic-run" }),
              e.source === "runtime" ? action("Remove", function () {
                return api("/api/periodic/entries/" + encodeURIComponent(e.name), { method: "DELETE" });
              }, { danger: true, confirm: "Remove the runtime entry " + e.name + "? (The app's beat_schedule entry of this name, if any, runs again.)", name: "periodic-remove" }) : null);
          } }
        ], d.items.map(function (e) { e.__key = e.name; return e; }), "No periodic job: none in the app's beat_schedule or set at runtime, or no worker pool has run them yet.");
      });
    },

    dead: function () {
      return listing("dead").then(function (d) {
        var bar = d.search ? searchActions("dead", d) : h("div", { cls: "toolbar" },
          action("Retry all", function () { return api("/api/dead/retry", { method: "POST", body: { all: true } }); },
            { confirm: "Retry every dead job?", disabled: !d.total, name: "dead-retry-all" }),
          action("Delete all", function () { return api("/api/dead/delete", { method: "POST", body: { all: true } }); },
            { confirm: "Delete every dead job? There is no undo.", danger: true, disabled: !d.total, name: "dead-delete-all" }));
        var t = table([
          { label: "Failed", render: function (j) { return fmtTime(j.failed_at); }, cls: "nowrap" },
          { label: "Job", render: function (j) { return h("a", { href: ROOT + "/dead/" + encodeURIComponent(j.id), text: j.name || j.queue }); } },
          { label: "Fair key", cls: "mono", render: function (j) { return j.fair_key || "—"; } },
          { label: "Reason", render: function (j) { return badge(j.reason || "", "bad"); } },
          { label: "Error", key: "error", cls: "err", title: function (j) { return j.error; } },
          { label: "Attempts", key: "attempts", num: true },
          { label: "Arguments", render: function (j) { return preview(j.args) + (j.kwargs && Object.keys(j.kwargs).length ? " " + preview(j.kwargs) : ""); },
            cls: "args mono", title: function (j) { return JSON.stringify(j.args); } },
          { label: "", render: function (j) {
            return h("span", { cls: "row-actions" },
              h("a", { cls: "btn", href: ROOT + "/dead/" + encodeURIComponent(j.id), text: "Show" }),
              action("Retry", function () { return api("/api/dead/retry", { method: "POST", body: { ids: [j.id] } }); }, { name: "dead-retry" }),
              action("Delete", function () { return api("/api/dead/delete", { method: "POST", body: { ids: [j.id] } }); }, { danger: true, name: "dead-delete" }));
          } }
        ], d.items.map(function (j) { j.__key = j.id; return j; }), d.search ? "No dead job matches." : "The dead set is empty.");
        return [bar, t, d.search ? searchPager(d) : pager(d.total, d.items.length)];
      });
    }
  };

  function queueTable(items, withActions) {
    var cols = [
      { label: "Job queue", key: "name", cls: "mono" },
      { label: "Queued", key: "size", num: true },
      { label: "Latency", render: function (q) { return fmtDur(q.latency); }, num: true },
      { label: "Weight", key: "weight", num: true },
      { label: "In flight", key: "in_flight", num: true },
      { label: "Max conc.", render: function (q) { return q.max_concurrency === null ? "—" : q.max_concurrency; }, num: true },
      { label: "Rate limit", render: function (q) { return q.rate_limit || "—"; }, num: true },
      { label: "Processed", render: function (q) { return fmtNum(q.processed); }, num: true },
      { label: "Failed", render: function (q) { return fmtNum(q.failed); }, num: true },
      { label: "State", render: function (q) {
        var state = q.paused ? badge("paused", "warn") : badge("active", "good");
        // No live worker pool consumes it: its jobs wait for one that knows the task.
        var parts = [state];
        if (q.consumed === false) parts.push(" ", badge("no consumer", q.size ? "bad" : "warn"));
        // Held (a job raised Throttled) or a slow rate limit: when its next job may be fetched.
        if (q.not_due_for !== null && q.not_due_for !== undefined && q.not_due_for >= NOT_DUE_SHOWN)
          parts.push(" ", badge("next in " + fmtDur(q.not_due_for), "warn"));
        return parts.length === 1 ? state : h.apply(null, ["span", {}].concat(parts));
      } },
      // A fair queue (docs/fair.md): its keys with jobs waiting, and the biggest ones.
      { label: "Fair keys", cls: "mono", render: function (q) {
        if (!q.fair) return "—";
        var cell = q.fair.active_keys + ": " + q.fair.top_keys.map(function (kv) { return kv[0] + "=" + kv[1]; }).join(" ");
        // Its per-key rate limit (fair_rate_limit) and the keys not due yet (a limit or a hold).
        if (q.fair.rate_limit) cell += "; " + q.fair.rate_limit + " per key";
        if (q.fair.not_due && q.fair.not_due.length) cell += "; not due: " + q.fair.not_due.map(function (kw) { return kw[0] + " " + kw[1].toFixed(1) + "s"; }).join(" ");
        return cell;
      } }
    ];
    if (withActions) cols.push({ label: "", render: function (q) {
      return h("span", { cls: "row-actions" },
        q.paused
          ? action("Resume", function () { return api("/api/queues/resume", { method: "POST", body: { name: q.name } }); }, { name: "resume" })
          : action("Pause", function () { return api("/api/queues/pause", { method: "POST", body: { name: q.name } }); }, { name: "pause" }),
        action("Rate…", function () {
          // A rate like 20/s, 10/m or 5/h in all pools; empty removes the limit.
          var rate = window.prompt("Rate limit of " + q.name + " (e.g. 20/s, 10/m, 5/h; empty: none)", q.rate_limit || "");
          if (rate === null) return null;
          return api("/api/queues/rate_limit", { method: "POST", body: { name: q.name, rate_limit: rate.trim() || null } });
        }, { name: "rate-limit" }));
    } });
    return table(cols, items.map(function (q) { q.__key = q.name; return q; }), "No job queue yet.");
  }

  // -- search in the dead / scheduled / retry sets ------------------------------------------
  function filterQuery() {
    var f = state.filters || {};
    return ["name", "error", "text", "since", "until"].filter(function (k) { return f[k]; })
      .map(function (k) { return "&" + k + "=" + encodeURIComponent(f[k]); }).join("");
  }
  // One page of a set: offset-paged without filters, cursor-paged through /search with them.
  function listing(kind) {
    if (!state.filters) return api("/api/" + kind + "?offset=" + state.offset + "&limit=" + state.limit);
    var q = "/api/" + kind + "/search?limit=" + state.limit + filterQuery() +
      (state.cursor ? "&cursor=" + encodeURIComponent(state.cursor) : "") + (state.total === null ? "&count=1" : "");
    return api(q).then(function (d) {
      if (d.total !== undefined) state.total = d.total;
      d.search = true;
      return d;
    });
  }
  function searchActions(kind, d) {
    var n = state.total === null ? "" : fmtNum(state.total) + " ";
    var retryLabel = kind === "dead" ? "Retry all matching" : "Run all matching now";
    function bulk(action) {
      return function () {
        return api("/api/" + kind + "/search/" + action, { method: "POST", body: state.filters }).then(function (r) {
          state.total = null; state.cursor = null; state.cursors = [];
          var out = document.getElementById("search-result");
          if (out) out.textContent = (action === "retry" ? (kind === "dead" ? "Retried " : "Made due: ") : "Deleted ") + fmtNum(r.count) + " job(s).";
        });
      };
    }
    return h("div", { cls: "toolbar" },
      h("span", { "data-testid": "match-count", text: n + "matching" }),
      action(retryLabel, bulk("retry"), { confirm: retryLabel + " (" + n + "jobs)?", disabled: !state.total, name: kind + "-retry-matching" }),
      action("Delete all matching", bulk("delete"), { confirm: "Delete " + n + "matching jobs? There is no undo.", danger: true, disabled: !state.total, name: kind + "-delete-matching" }));
  }
  function searchPager(d) {
    return h("div", { cls: "pager" },
      h("span", { text: "scanned " + fmtNum(d.scanned) + (d.cursor ? ", more after this page" : "") }),
      h("button", { type: "button", cls: "btn", text: "← Prev", disabled: !state.cursors.length,
        on: { click: function () { state.cursor = state.cursors.pop() || null; refresh(); } } }),
      h("button", { type: "button", cls: "btn", text: "Next →", disabled: !d.cursor,
        on: { click: function () { state.cursors.push(state.cursor); state.cursor = d.cursor; refresh(); } } }));
  }
  // The search form sits outside the refreshed area (typing is never interrupted).
  function setupSetSearch() {
    var content = document.getElementById("content");
    if (["dead", "scheduled", "retry"].indexOf(PAGE) < 0 || !content) return;
    function input(name, placeholder, type) {
      return h("input", { type: type || "search", placeholder: placeholder, "data-testid": "search-" + name, title: placeholder });
    }
    var fields = {
      name: input("name", "job name (exact)"), error: input("error", PAGE === "scheduled" ? "error type or text (retries)" : "error type or text"),
      text: input("text", "text in the arguments"),
      since: input("since", "from", "datetime-local"), until: input("until", "to", "datetime-local")
    };
    function apply(ev) {
      if (ev) ev.preventDefault();
      var f = {}, any = false;
      Object.keys(fields).forEach(function (k) {
        var v = fields[k].value.trim();
        if (!v) return;
        if (k === "since" || k === "until") v = String(new Date(v).getTime() / 1000);
        f[k] = v; any = true;
      });
      state.filters = any ? f : null;
      state.cursor = null; state.cursors = []; state.total = null; state.offset = 0;
      var out = document.getElementById("search-result");
      if (out) out.textContent = "";
      refresh();
    }
    var form = h("form", { cls: "toolbar search", "data-testid": "search-form", on: { submit: apply } },
      fields.name, fields.error, fields.text, fields.since, fields.until,
      h("button", { type: "submit", cls: "btn", text: "Search", "data-action": "search" }),
      h("button", { type: "button", cls: "btn", text: "Clear", "data-action": "search-clear", on: { click: function () {
        Object.keys(fields).forEach(function (k) { fields[k].value = ""; }); apply(); } } }),
      h("span", { id: "search-result", cls: "muted", "data-testid": "search-result" }));
    content.parentNode.insertBefore(form, content);
  }

  function setPage(kind) {
    return listing(kind).then(function (d) {
      var cols = [
        { label: "Due", cls: "nowrap", render: function (j) { return fmtTime(j.due_at); }, title: function (j) { return "in " + fmtDur(j.due_at - Date.now() / 1000); } },
        { label: "Job", render: function (j) { return h("span", null, h("strong", { text: j.name || j.queue }), h("br"), h("span", { cls: "mono muted", text: j.task_id || j.id })); } },
        { label: "Job queue", key: "queue", cls: "mono" },
        { label: "Arguments", render: function (j) { return preview(j.args) + (j.kwargs && Object.keys(j.kwargs).length ? " " + preview(j.kwargs) : ""); },
          cls: "args mono", title: function (j) { return JSON.stringify(j.args); } }
      ];
      if (kind === "retry") {
        cols.push({ label: "Attempt", key: "attempt", num: true });
        cols.push({ label: "Last error", key: "error", cls: "err", title: function (j) { return j.error; } });
      }
      cols.push({ label: "", render: function (j) {
        return h("span", null,
          action("Cancel", function () { return api("/api/jobs/cancel", { method: "POST", body: { job_id: j.task_id || j.id } }); },
            { confirm: "Cancel this job? It moves to the dead set (reason revoked), and a job enqueued later with its id will not run either.", name: "cancel" }), " ",
          action("Delete", function () { return api("/api/" + kind + "/delete", { method: "POST", body: { id: j.id } }); },
            { danger: true, confirm: "Delete this job? It will not run.", name: "delete" }));
      } });
      var t = table(cols, d.items.map(function (j) { j.__key = j.id; return j; }),
        d.search ? "No job matches." : kind === "retry" ? "No job is waiting to be retried." : "No job is scheduled.");
      return d.search ? [searchActions(kind, d), t, searchPager(d)] : [t, pager(d.total, d.items.length)];
    });
  }

  function setCounts(c) {
    var map = { busy: c.busy, scheduled: c.scheduled, retry: c.retry, dead: c.dead, queues: c.queues, pools: c.live_pools };
    Object.keys(map).forEach(function (k) {
      var el = document.querySelector('[data-count="' + k + '"]');
      if (el) { el.textContent = map[k] ? String(map[k]) : ""; if (k === "dead") el.classList.toggle("bad", map[k] > 0); }
    });
  }

  // -- refresh loop --------------------------------------------------------------------
  function refresh() {
    var content = document.getElementById("content");
    var render = pages[PAGE];
    if (timer) { clearTimeout(timer); timer = null; }
    if (!content || !render) { setLive(true); return; }
    if (busyAction) { timer = setTimeout(refresh, 300); return; }
    render().then(function (nodes) {
      content.replaceChildren.apply(content, Array.isArray(nodes) ? nodes : [nodes]);
      setLive(true);
      showError(null);
      body.dataset.loaded = String((parseInt(body.dataset.loaded || "0", 10) || 0) + 1);
    }).catch(function (e) {
      setLive(false, "offline");
      showError("Cannot refresh: " + e.message);
    }).then(function () {
      timer = setTimeout(refresh, document.hidden ? REFRESH * 5 : REFRESH);
    });
  }

  // Periodic page: the form that sets a runtime entry, outside the refreshed area. The
  // server checks the entry (one check for the client, the CLI and this API).
  function setupPeriodicForm() {
    var content = document.getElementById("content");
    if (PAGE !== "periodic" || !content) return;
    function input(name, placeholder) {
      return h("input", { type: "text", placeholder: placeholder, "data-testid": "periodic-" + name, title: placeholder });
    }
    var f = { name: input("name", "entry name"), task: input("task", "task name"),
              every: input("every", "every (seconds)"), crontab: input("crontab", "or crontab: m h dom mon dow"),
              args: input("args", "args (JSON list)"), queue: input("queue", "queue (optional)") };
    var out = h("span", { cls: "muted", "data-testid": "periodic-result" });
    function submit(ev) {
      ev.preventDefault();
      var body = { name: f.name.value.trim(), task: f.task.value.trim() };
      var every = f.every.value.trim(), cron = f.crontab.value.trim(), args = f.args.value.trim();
      if (every) body.every = isNaN(Number(every)) ? every : Number(every);
      if (cron) body.crontab = cron;
      if (f.queue.value.trim()) body.queue = f.queue.value.trim();
      try { body.args = args ? JSON.parse(args) : []; }
      catch (e) { showError("args is not JSON: " + e.message); return; }
      api("/api/periodic/entries", { method: "POST", body: body }).then(function (d) {
        out.textContent = (d.created ? "Created " : "Replaced ") + d.name + ".";
        showError(null);
        refresh();
      }).catch(function (e) { out.textContent = ""; showError("Set failed: " + e.message); });
    }
    content.parentNode.insertBefore(h("form", { cls: "toolbar", "data-testid": "periodic-form", on: { submit: submit } },
      f.name, f.task, f.every, f.crontab, f.args, f.queue,
      h("button", { type: "submit", cls: "btn", text: "Set entry", "data-action": "periodic-set" }), out), content);
  }

  // Queues page: a filter box outside the refreshed area (typing is never interrupted).
  function setupQueueFilter() {
    var content = document.getElementById("content");
    if (PAGE !== "queues" || !content) return;
    var filter = h("input", { type: "search", placeholder: "filter by name prefix", "data-testid": "queue-filter" });
    var pending = null;
    filter.addEventListener("input", function () {
      clearTimeout(pending);
      pending = setTimeout(function () { state.prefix = filter.value; state.offset = 0; refresh(); }, 250);
    });
    content.parentNode.insertBefore(h("div", { cls: "toolbar" }, filter), content);
  }

  // Dead job page (server-rendered): retry / delete buttons.
  function wireDeadDetail() {
    document.querySelectorAll('[data-action="dead-retry"], [data-action="dead-delete"]').forEach(function (btn) {
      btn.addEventListener("click", function () {
        var retry = btn.dataset.action === "dead-retry";
        if (!retry && !window.confirm("Delete this dead job? There is no undo.")) return;
        btn.disabled = true;
        api(retry ? "/api/dead/retry" : "/api/dead/delete", { method: "POST", body: { ids: [btn.dataset.id] } })
          .then(function () {
            var out = document.getElementById("action-result");
            if (out) out.textContent = retry ? "Requeued." : "Deleted.";
            document.querySelectorAll("#dead-actions button").forEach(function (b) { b.disabled = true; });
          })
          .catch(function (e) { btn.disabled = false; showError(e.message); });
      });
    });
    document.querySelectorAll("[data-ts]").forEach(function (el) {
      var ts = parseFloat(el.dataset.ts);
      if (ts) el.textContent = fmtTime(ts);
    });
  }

  // Demo page without a job: list running jobs to watch.
  function demoBusy() {
    var list = document.getElementById("demo-busy");
    if (!list) return;
    api("/api/busy").then(function (d) {
      list.replaceChildren.apply(list, d.items.length ? d.items.map(function (b) {
        return h("li", null, h("a", { href: ROOT + "/demo?job=" + encodeURIComponent(b.job_id), text: b.job_name + " " + b.job_id }));
      }) : [h("li", { cls: "muted", text: "No job is running right now." })]);
    }).catch(function () {}).then(function () { setTimeout(demoBusy, REFRESH); });
  }

  // Counters in the nav on every page.
  function navCounts() {
    if (PAGE === "overview") return;
    api("/api/overview").then(function (d) { setCounts(d.counts); }).catch(function () {})
      .then(function () { setTimeout(navCounts, REFRESH * 3); });
  }

  document.addEventListener("visibilitychange", function () { if (!document.hidden) refresh(); });
  setupQueueFilter();
  setupSetSearch();
  setupPeriodicForm();
  wireDeadDetail();
  demoBusy();
  navCounts();
  refresh();
})();
