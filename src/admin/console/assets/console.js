// idemproxy console: new items without a reload, and a browser notification where the
// operator allowed it. Loaded from the binary ('self'); no inline script anywhere.
(function () {
  "use strict";
  var page = document.body.getAttribute("data-page");
  // Forms: a second click does not send the decision twice.
  document.addEventListener("submit", function (e) {
    var b = e.target.querySelectorAll("button[type=submit]");
    setTimeout(function () { b.forEach(function (x) { x.disabled = true; }); }, 0);
  });
  if (page !== "waiting") return;
  var live = document.getElementById("live");
  var notify = document.getElementById("notify");
  var known = {};
  document.querySelectorAll("[data-item]").forEach(function (el) { known[el.getAttribute("data-item")] = true; });
  if ("Notification" in window && Notification.permission === "default") {
    notify.hidden = false;
    notify.addEventListener("click", function () {
      Notification.requestPermission().then(function () { notify.hidden = true; });
    });
  }
  function tell(text) { live.hidden = false; live.textContent = text; }
  function merge(html) {
    var doc = new DOMParser().parseFromString(html, "text/html");
    var fresh = {};
    var added = [];
    ["approvals", "held"].forEach(function (list) {
      var into = document.getElementById(list);
      var from = doc.getElementById(list);
      if (!into || !from) return;
      from.querySelectorAll("[data-item]").forEach(function (el) {
        var id = el.getAttribute("data-item");
        fresh[id] = true;
        if (!known[id]) {
          var node = document.importNode(el, true);
          node.classList.add("new");
          into.insertBefore(node, into.firstChild);
          known[id] = true;
          added.push(node);
        }
      });
    });
    document.querySelectorAll("[data-item]").forEach(function (el) {
      var id = el.getAttribute("data-item");
      if (!fresh[id] && !el.classList.contains("gone")) {
        el.classList.add("gone");
        el.querySelectorAll("button, input, textarea").forEach(function (x) { x.disabled = true; });
        var p = document.createElement("p");
        p.className = "hint";
        p.textContent = "Decided or resolved elsewhere.";
        el.appendChild(p);
      }
    });
    if (added.length) {
      tell(added.length === 1 ? "1 new item" : added.length + " new items");
      document.querySelectorAll(".empty").forEach(function (e) { e.hidden = true; });
      if ("Notification" in window && Notification.permission === "granted" && document.hidden) {
        var first = added[0].querySelector("h3");
        new Notification("idemproxy: waiting on you", { body: first ? first.textContent : "a new item", tag: "idemproxy" });
      }
    }
  }
  function poll() {
    fetch("/console/?fragment=1", { credentials: "same-origin", cache: "no-store" })
      .then(function (r) {
        if (r.status === 401) { tell("Session ended: reload to log in again."); return null; }
        if (!r.ok) { tell("Could not refresh (" + r.status + "); retrying."); return null; }
        return r.text();
      })
      .then(function (html) { if (html) merge(html); })
      .catch(function () { tell("Offline; retrying."); })
      // A tab in the background asks less often (each ask lists the store's held claims).
      .then(function () { setTimeout(poll, document.hidden ? 10000 : 3000); });
  }
  setTimeout(poll, 3000);
})();
