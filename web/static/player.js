// cube-adapter console: the session recording player (ours, no framework).
// It fetches the recording (asciicast v2, with cube-adapter's codes: `e` a
// job's standard error, `*b` bytes in base64), and replays it in a <pre>:
// play/pause, seek, speed, a search in the output whose hits seek to where
// they were written. The terminal is simple: text, carriage returns,
// backspaces, erasing and cursor moves; colours and other escape sequences
// are dropped. The page shows the output as text without this script.
"use strict";
(function () {
  // `crlf`: output not from a terminal (a job, an exec), whose newline
  // also returns to the line's start, as a terminal's output does.
  function Term(cols, crlf) {
    this.cols = cols || 80;
    this.crlf = !!crlf;
    this.reset();
  }
  Term.prototype.reset = function () {
    this.lines = [[]];
    this.row = 0;
    this.col = 0;
    this.state = 0;
    this.params = "";
  };
  Term.prototype.line = function () {
    while (this.lines.length <= this.row) { this.lines.push([]); }
    return this.lines[this.row];
  };
  Term.prototype.csi = function (final) {
    var ps = this.params.replace(/^[?>=]/, "").split(";").map(function (x) { return parseInt(x, 10) || 0; });
    var n = Math.max(1, ps[0] || 0);
    var l = this.line();
    switch (final) {
      case "K":
        if (ps[0] === 2) { l.length = 0; } else if (ps[0] === 1) { for (var i = 0; i <= this.col && i < l.length; i++) { l[i] = " "; } } else { l.length = Math.min(l.length, this.col); }
        break;
      case "J":
        if (ps[0] === 2 || ps[0] === 3) { this.lines = [[]]; this.row = 0; this.col = 0; } else if (ps[0] === 0) { l.length = Math.min(l.length, this.col); this.lines.length = this.row + 1; }
        break;
      case "A": this.row = Math.max(0, this.row - n); break;
      case "B": this.row += n; break;
      case "C": this.col += n; break;
      case "D": this.col = Math.max(0, this.col - n); break;
      case "G": this.col = n - 1; break;
      case "H": case "f":
        var top = Math.max(0, this.lines.length - 24);
        this.row = top + Math.max(1, ps[0] || 1) - 1;
        this.col = Math.max(1, ps[1] || 1) - 1;
        break;
      default: break;
    }
  };
  Term.prototype.write = function (s) {
    for (var k = 0; k < s.length; k++) {
      var c = s[k];
      var code = s.charCodeAt(k);
      if (this.state === 1) {
        if (c === "[") { this.state = 2; this.params = ""; } else if (c === "]") { this.state = 3; } else { this.state = 0; }
        continue;
      }
      if (this.state === 2) {
        if (code >= 0x40 && code <= 0x7e) { this.csi(c); this.state = 0; } else { this.params += c; }
        continue;
      }
      if (this.state === 3) {
        if (code === 7) { this.state = 0; } else if (code === 27) { this.state = 4; }
        continue;
      }
      if (this.state === 4) { this.state = 0; continue; }
      if (code === 27) { this.state = 1; continue; }
      if (c === "\r") { this.col = 0; continue; }
      if (c === "\n") { this.row += 1; if (this.crlf) { this.col = 0; } this.line(); continue; }
      if (c === "\b") { this.col = Math.max(0, this.col - 1); continue; }
      if (c === "\t") { this.col = (Math.floor(this.col / 8) + 1) * 8; continue; }
      if (code < 32 || code === 127) { continue; }
      if (this.col >= this.cols) { this.row += 1; this.col = 0; }
      var l = this.line();
      while (l.length < this.col) { l.push(" "); }
      l[this.col] = c;
      this.col += 1;
    }
  };
  Term.prototype.text = function () {
    return this.lines.map(function (l) { return l.join(""); }).join("\n");
  };

  function decode(code, data) {
    if (code.length === 2 && code[1] === "b") {
      var bin = atob(data);
      var bytes = new Uint8Array(bin.length);
      for (var i = 0; i < bin.length; i++) { bytes[i] = bin.charCodeAt(i); }
      return new TextDecoder("utf-8").decode(bytes);
    }
    return data;
  }

  function start(root, text) {
    var lines = text.split("\n");
    var head = JSON.parse(lines[0]);
    var events = [];
    for (var i = 1; i < lines.length; i++) {
      if (!lines[i]) { continue; }
      try {
        var e = JSON.parse(lines[i]);
        events.push({ t: e[0], code: e[1], text: decode(e[1], e[2]) });
      } catch (err) { /* a line cut short: skipped */ }
    }
    var duration = events.length ? events[events.length - 1].t : 0;
    var kind = head.cube_adapter && head.cube_adapter.kind;
    var term = new Term(head.width, kind && kind !== "pty");
    var screen = document.getElementById("play-screen");
    var seek = document.getElementById("play-seek");
    var time = document.getElementById("play-time");
    var toggle = document.getElementById("play-toggle");
    var speed = document.getElementById("play-speed");
    var status = document.getElementById("play-status");
    var at = 0; // events applied
    var now = 0;
    var timer = null;
    seek.max = String(duration);
    function apply(t) {
      if (t < now) { term.reset(); term.cols = head.width || 80; at = 0; }
      while (at < events.length && events[at].t <= t) {
        var e = events[at];
        if (e.code === "o" || e.code === "ob" || e.code === "e" || e.code === "eb") { term.write(e.text); }
        if (e.code === "r") { term.cols = parseInt(e.text, 10) || term.cols; }
        at += 1;
      }
      now = t;
      screen.textContent = term.text();
      seek.value = String(t);
      time.textContent = t.toFixed(1) + " s of " + duration.toFixed(1) + " s";
    }
    function stop() {
      if (timer) { clearInterval(timer); timer = null; }
      toggle.textContent = "Play";
    }
    toggle.addEventListener("click", function () {
      if (timer) { stop(); return; }
      if (now >= duration) { apply(0); }
      var wall = performance.now();
      var from = now;
      toggle.textContent = "Pause";
      timer = setInterval(function () {
        var t = from + (performance.now() - wall) / 1000 * parseFloat(speed.value);
        if (t >= duration) { apply(duration); stop(); return; }
        apply(t);
      }, 50);
    });
    seek.addEventListener("input", function () { stop(); apply(parseFloat(seek.value)); });
    document.getElementById("play-end").addEventListener("click", function () { stop(); apply(duration); });
    document.getElementById("play-search").addEventListener("submit", function (ev) {
      ev.preventDefault();
      var q = document.getElementById("play-query").value.toLowerCase();
      var hits = document.getElementById("play-hits");
      hits.textContent = "";
      if (!q) { return; }
      var n = 0;
      events.forEach(function (e) {
        if (n >= 50 || (e.code[0] !== "o" && e.code[0] !== "e")) { return; }
        var plain = e.text.replace(/\u001b\[[0-9;?>=]*[@-~]/g, "").replace(/\u001b\][^\u0007]*\u0007/g, "");
        var i = plain.toLowerCase().indexOf(q);
        if (i < 0) { return; }
        n += 1;
        var li = document.createElement("li");
        var b = document.createElement("button");
        b.type = "button";
        b.className = "hit";
        b.textContent = "at " + e.t.toFixed(1) + " s: " + plain.substr(Math.max(0, i - 20), q.length + 40).replace(/\s+/g, " ");
        b.addEventListener("click", function () { stop(); apply(e.t); });
        li.appendChild(b);
        hits.appendChild(li);
      });
      status.textContent = n ? n + " found" + (n >= 50 ? " (the first 50)" : "") + "." : "Not found.";
    });
    root.hidden = false;
    apply(0);
    status.textContent = events.length + " events, " + duration.toFixed(1) + " s.";
  }

  document.addEventListener("DOMContentLoaded", function () {
    var root = document.getElementById("player");
    if (!root || !window.fetch) { return; }
    fetch(root.getAttribute("data-cast"), { credentials: "same-origin" })
      .then(function (r) { if (!r.ok) { throw new Error(String(r.status)); } return r.text(); })
      .then(function (t) { start(root, t); })
      .catch(function (e) {
        var s = document.getElementById("play-status");
        if (s) { s.textContent = "The recording could not be loaded (" + e.message + ")."; }
        root.hidden = false;
      });
  });
})();
