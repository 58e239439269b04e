// cube-adapter console: the one script, progressive enhancement only.
// Every page works without it. Buttons with data-copy="ID" (hidden in the
// HTML) are shown and copy the value (or, for a <pre>, the text) of the
// element with that id.
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
});
