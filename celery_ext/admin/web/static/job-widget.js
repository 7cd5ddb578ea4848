/* celery-ext job observer widget: shows one job from queued to done, live.
 *
 *   <div data-celery-ext-job="JOB ID"></div>
 *   <script src="https://DASHBOARD/static/job-widget.js"></script>
 *
 * or from script: CeleryExtJob.watch(element, jobId, {base: "https://DASHBOARD/",
 * onUpdate: function (status) {...}}). It follows /api/jobs/<id>/events (server-sent
 * events) and falls back to polling /api/jobs/<id>. Everything it shows is set as
 * text, never as HTML; it styles itself and needs no CSS from the page.
 */
(function (global) {
  "use strict";

  var COLORS = {
    queued: "#6b7483", scheduled: "#6b7483", retrying: "#b7791f", reserved: "#2f6fde",
    running: "#2f6fde", succeeded: "#1f8a4c", failed: "#c53030", dead: "#c53030",
    revoked: "#6b7483", finished: "#1f8a4c"
  };
  var LABELS = {
    queued: "queued", scheduled: "scheduled", retrying: "waiting to retry",
    reserved: "fetched, about to run", running: "running", succeeded: "done", failed: "failed",
    dead: "dead", revoked: "revoked", finished: "finished"
  };
  var FINAL = { succeeded: 1, failed: 1, dead: 1, revoked: 1, finished: 1 };

  var scriptBase = (function () {
    var el = document.currentScript;
    if (!el || !el.src) return "";
    return el.src.replace(/static\/job-widget\.js(\?.*)?$/, "");
  })();

  function node(tag, style, text) {
    var n = document.createElement(tag);
    if (style) Object.keys(style).forEach(function (k) { n.style[k] = style[k]; });
    if (text !== undefined) n.textContent = text;
    return n;
  }

  function Widget(el, jobId, opts) {
    this.el = el;
    this.jobId = jobId;
    this.opts = opts || {};
    var base = this.opts.base || el.getAttribute("data-celery-ext-base") || scriptBase || "/";
    this.base = base.charAt(base.length - 1) === "/" ? base : base + "/";
    this.build();
  }

  Widget.prototype.build = function () {
    var box = node("div", {
      font: "14px/1.4 system-ui, sans-serif", border: "1px solid #dde1e7", borderRadius: "8px",
      padding: "10px 12px", background: "#fff", color: "#1d2430", maxWidth: "520px"
    });
    box.className = "celery-ext-job";
    var top = node("div", { display: "flex", justifyContent: "space-between", gap: "10px", alignItems: "center" });
    this.name = node("strong", null, "job");
    this.badge = node("span", {
      padding: "1px 9px", borderRadius: "10px", fontSize: "12px", fontWeight: "600", color: "#fff",
      background: COLORS.queued
    }, "…");
    this.badge.setAttribute("data-state", "");
    top.appendChild(this.name);
    top.appendChild(this.badge);
    var track = node("div", { height: "6px", background: "#e5e8ee", borderRadius: "3px", margin: "8px 0 4px", overflow: "hidden" });
    this.bar = node("div", { height: "100%", width: "0%", background: COLORS.running, transition: "width .3s" });
    track.appendChild(this.bar);
    this.line = node("div", { fontSize: "13px", color: "#3b4453", minHeight: "1.2em", wordBreak: "break-word" });
    this.cursorLine = node("div", { fontSize: "12px", color: "#3b4453", fontFamily: "ui-monospace, monospace", marginTop: "4px", wordBreak: "break-all", display: "none" });
    this.lockLine = node("div", { fontSize: "12px", color: "#3b4453", marginTop: "4px", display: "none" });
    this.lockLine.setAttribute("data-unique-lock", "");
    this.idLine = node("div", { fontSize: "11px", color: "#6b7483", fontFamily: "ui-monospace, monospace", marginTop: "4px" }, this.jobId);
    box.appendChild(top);
    box.appendChild(track);
    box.appendChild(this.line);
    box.appendChild(this.cursorLine);
    box.appendChild(this.lockLine);
    box.appendChild(this.idLine);
    this.el.replaceChildren(box);
    this.box = box;
  };

  Widget.prototype.render = function (st) {
    this.status = st;
    if (st.job_name) this.jobName = st.job_name;
    this.name.textContent = this.jobName || "job";
    this.badge.textContent = LABELS[st.state] || st.state;
    this.badge.style.background = COLORS[st.state] || "#6b7483";
    this.badge.setAttribute("data-state", st.state);
    this.el.setAttribute("data-job-state", st.state);
    var pct = null;
    if (st.state === "succeeded") pct = 100;
    else if (typeof st.progress === "number") pct = Math.max(0, Math.min(100, st.progress * 100));
    this.bar.style.width = (pct === null ? 0 : pct) + "%";
    this.bar.style.background = COLORS[st.state] || COLORS.running;
    var text = "";
    if (st.state === "running") {
      text = (pct !== null ? Math.round(pct) + "%" : "started") + (st.message ? " · " + st.message : "");
      if (st.stop_requested) text += " · stop requested";
    } else if (st.state === "succeeded") text = st.result !== null && st.result !== undefined ? "result: " + st.result : "";
    else if (st.state === "scheduled" || st.state === "retrying") {
      text = st.due_at ? "due " + new Date(st.due_at * 1000).toLocaleTimeString() : "";
      if (st.error) text += (text ? " · " : "") + st.error;
    } else if (st.error) text = st.error;
    else if (st.state === "queued" && st.queue) {
      text = "in " + st.queue + (st.level ? " (priority level " + st.level + ")" : "");
    } else if ((st.state === "reserved" || st.state === "finished") && st.pool) text = "pool " + st.pool;
    this.line.textContent = text;
    // A resumable job's cursor: where its next run goes on from (gone once it finishes).
    var hasCursor = st.cursor !== null && st.cursor !== undefined;
    var cursor = hasCursor ? JSON.stringify(st.cursor) : "";
    this.cursorLine.textContent = hasCursor ? "cursor " + (cursor.length > 200 ? cursor.slice(0, 199) + "…" : cursor) : "";
    this.cursorLine.style.display = hasCursor ? "" : "none";
    // A unique job's lock, where its message is in a record (docs/sets.md#unique-jobs).
    var lock = st.unique_lock;
    this.lockLine.textContent = lock ? "unique lock (" + lock.mode + "): " +
      (lock.held ? "held by this job" : lock.holder ? "held by " + lock.holder : "free") +
      (lock.ttl !== null && lock.ttl !== undefined ? ", " + Math.round(lock.ttl) + " s left" : "") : "";
    this.lockLine.style.display = lock ? "" : "none";
    if (this.opts.onUpdate) { try { this.opts.onUpdate(st); } catch (e) { /* the page's bug */ } }
  };

  Widget.prototype.url = function (suffix) {
    return this.base + "api/jobs/" + encodeURIComponent(this.jobId) + (suffix || "");
  };

  Widget.prototype.start = function () {
    var self = this;
    if (global.EventSource && !this.opts.poll) {
      var es = new EventSource(this.url("/events"), { withCredentials: !!this.opts.withCredentials });
      this.source = es;
      var failures = 0;
      es.addEventListener("status", function (ev) {
        failures = 0;
        var st;
        try { st = JSON.parse(ev.data); } catch (e) { return; }
        self.render(st);
        if (FINAL[st.state]) self.stop();
      });
      es.onerror = function () {
        failures += 1;
        if (self.status && FINAL[self.status.state]) { self.stop(); return; }
        if (failures >= 3) { self.stop(); self.poll(); }
      };
    } else {
      this.poll();
    }
    return this;
  };

  Widget.prototype.poll = function () {
    var self = this;
    this.stopped = false;
    function once() {
      if (self.stopped) return;
      fetch(self.url(""), { credentials: self.opts.withCredentials ? "include" : "same-origin" })
        .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
        .then(function (st) {
          self.render(st);
          if (!FINAL[st.state]) self.timer = setTimeout(once, 1000);
        })
        .catch(function () { self.timer = setTimeout(once, 3000); });
    }
    once();
  };

  Widget.prototype.stop = function () {
    this.stopped = true;
    if (this.source) { this.source.close(); this.source = null; }
    if (this.timer) { clearTimeout(this.timer); this.timer = null; }
  };

  function watch(el, jobId, opts) {
    if (typeof el === "string") el = document.querySelector(el);
    if (!el) throw new Error("CeleryExtJob.watch: no element");
    return new Widget(el, jobId || el.getAttribute("data-celery-ext-job"), opts).start();
  }

  function autoInit() {
    var els = document.querySelectorAll("[data-celery-ext-job]");
    for (var i = 0; i < els.length; i++) {
      if (!els[i].__celeryExtJob && els[i].getAttribute("data-celery-ext-job")) {
        els[i].__celeryExtJob = watch(els[i]);
      }
    }
  }

  global.CeleryExtJob = { watch: watch, Widget: Widget };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", autoInit);
  else autoInit();
})(window);
