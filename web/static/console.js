// cube-adapter console: the one script, progressive enhancement only.
// Every page works without it. Buttons with data-copy="ID" (hidden in the
// HTML) are shown and copy the value (or, for a <pre>, the text) of the
// element with that id. On the approvals queue (#queue-news), it asks every
// few seconds which plans are pending and, when that changed, says so with
// a link to reload: the page itself never reloads (focus stays put).
"use strict";
document.addEventListener("DOMContentLoaded", function () {
  var buttons = document.querySelectorAll("button[data-copy]");
  Array.prototype.forEach.call(buttons, function (b) {
    var field = document.getElementById(b.getAttribute("data-copy"));
    if (!field || !navigator.clipboard) { return; }
    var status = document.getElementById("copy-status");
    b.hidden = false;
    b.addEventListener("click", function () {
      var text = field.value !== undefined ? field.value : field.textContent;
      navigator.clipboard.writeText(text).then(function () {
        if (status) { status.textContent = "Copied."; }
      }, function () {
        if (field.select) { field.select(); }
        if (status) { status.textContent = "Select the text and copy it."; }
      });
    });
  });
  var news = document.getElementById("queue-news");
  if (news && window.fetch) {
    var shown = (news.getAttribute("data-pending") || "").split(" ").filter(Boolean).sort().join(" ");
    var every = (parseInt(news.getAttribute("data-every"), 10) || 5) * 1000;
    var poll = function () {
      fetch("/console/approvals/pending", { credentials: "same-origin", headers: { accept: "application/json" } })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (v) {
          if (!v || !v.pending) { return; }
          var now = v.pending.slice().sort().join(" ");
          if (now === shown) { news.hidden = true; return; }
          var fresh = v.pending.filter(function (p) { return shown.split(" ").indexOf(p) < 0; }).length;
          news.textContent = "";
          news.appendChild(document.createTextNode(
            (fresh > 0 ? fresh + " new; " : "The queue changed; ") + v.pending.length + " pending now. "));
          var a = document.createElement("a");
          a.href = "/console/approvals";
          a.id = "queue-news-reload";
          a.textContent = "Reload";
          news.appendChild(a);
          news.hidden = false;
        }, function () {});
    };
    window.setInterval(poll, every);
  }
});
