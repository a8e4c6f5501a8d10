// idem console: the pages work without this file. It refreshes the main
// part of a page that asks for it (data-refresh, in seconds), keeps the
// keyboard focus where it was, and lets the person pause it. One refresh
// at a time: the next is planned when the last has answered (or given up
// after a timeout), so a slow server never gets a pile of them.
(function () {
  "use strict";
  var main = document.getElementById("main");
  if (!main || !main.dataset.refresh) { return; }
  var every = Number(main.dataset.refresh) * 1000;
  var timeout = 2 * every;
  var paused = false;
  var toggle = document.getElementById("refresh-toggle");
  var said = document.getElementById("refreshed");
  if (toggle) {
    toggle.addEventListener("click", function () {
      paused = !paused;
      toggle.setAttribute("aria-pressed", String(paused));
      toggle.textContent = paused ? "Resume refresh" : "Pause refresh";
      said.textContent = paused ? "Paused" : "Refreshes every 5 s";
    });
  }
  function next() { window.setTimeout(refresh, every); }
  function refresh() {
    if (paused || document.hidden) { next(); return; }
    var ctl = new AbortController();
    var timer = window.setTimeout(function () { ctl.abort(); }, timeout);
    fetch(window.location.href, { credentials: "same-origin", cache: "no-store", signal: ctl.signal })
      .then(function (r) { if (!r.ok) { throw new Error("HTTP " + r.status); } return r.text(); })
      .then(function (html) {
        var doc = new DOMParser().parseFromString(html, "text/html");
        var fresh = doc.getElementById("main");
        if (!fresh || paused) { return; }
        var focused = document.activeElement && document.activeElement.id;
        main.innerHTML = fresh.innerHTML;
        if (focused) { var el = document.getElementById(focused); if (el) { el.focus(); } }
        said.textContent = "Refreshed at " + new Date().toLocaleTimeString();
      })
      .catch(function (e) {
        said.textContent = "Not refreshed: " + (e.name === "AbortError" ? "no answer within " + timeout / 1000 + " s" : e.message);
      })
      .finally(function () { window.clearTimeout(timer); next(); });
  }
  next();
})();
