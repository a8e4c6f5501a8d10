// idem console: the pages work without this file. It refreshes the main
// part of a page that asks for it (data-refresh, in seconds), keeps the
// keyboard focus where it was, and lets the person pause it.
(function () {
  "use strict";
  var main = document.getElementById("main");
  if (!main || !main.dataset.refresh) { return; }
  var every = Number(main.dataset.refresh) * 1000;
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
  function refresh() {
    if (paused || document.hidden) { return; }
    fetch(window.location.href, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) { if (!r.ok) { throw new Error("HTTP " + r.status); } return r.text(); })
      .then(function (html) {
        var doc = new DOMParser().parseFromString(html, "text/html");
        var next = doc.getElementById("main");
        if (!next || paused) { return; }
        var focused = document.activeElement && document.activeElement.id;
        main.innerHTML = next.innerHTML;
        if (focused) { var el = document.getElementById(focused); if (el) { el.focus(); } }
        said.textContent = "Refreshed at " + new Date().toLocaleTimeString();
      })
      .catch(function (e) { said.textContent = "Not refreshed: " + e.message; });
  }
  window.setInterval(refresh, every);
})();
