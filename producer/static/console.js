// batchfleet console: live parts of a page refresh themselves, and keys
// drive the review queue. No framework, nothing fetched from elsewhere.
(function () {
  "use strict";

  // <div data-live="URL" data-every="ms">: replaced by a fresh copy from URL.
  function live(el) {
    var every = parseInt(el.getAttribute("data-every") || "3000", 10);
    function tick() {
      if (document.hidden) { return; }
      fetch(el.getAttribute("data-live"), { credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) { if (html !== null) { el.innerHTML = html; el.setAttribute("data-refreshed", String(Date.now())); } })
        .catch(function () {});
    }
    setInterval(tick, every);
  }

  function typing(e) {
    var t = e.target;
    return t && (t.tagName === "INPUT" || t.tagName === "TEXTAREA" || t.isContentEditable);
  }

  function queueKeys() {
    var rows = Array.prototype.slice.call(document.querySelectorAll("tr[data-href]"));
    var at = rows.length ? 0 : -1;
    function mark() {
      rows.forEach(function (r, i) { r.classList.toggle("selected", i === at); });
      if (at >= 0) { rows[at].scrollIntoView({ block: "nearest" }); }
    }
    mark();
    document.addEventListener("keydown", function (e) {
      if (typing(e) || e.ctrlKey || e.metaKey || e.altKey || !rows.length) { return; }
      if (e.key === "j") { at = Math.min(at + 1, rows.length - 1); mark(); }
      else if (e.key === "k") { at = Math.max(at - 1, 0); mark(); }
      else if (e.key === "Enter" || e.key === "o") { window.location = rows[at].getAttribute("data-href"); }
      else { return; }
      e.preventDefault();
    });
  }

  function entryKeys() {
    var editor = document.getElementById("editor");
    document.addEventListener("keydown", function (e) {
      if (e.key === "Escape" && typing(e)) { e.target.blur(); e.preventDefault(); return; }
      if (typing(e) || e.ctrlKey || e.metaKey || e.altKey) { return; }
      var go = {
        j: function () { document.getElementById("next").click(); },
        k: function () { history.back(); },
        a: function () { document.getElementById("accept-form").submit(); },
        e: function () { editor.focus(); },
        r: function () { document.getElementById("requeue-note").focus(); },
        x: function () { document.getElementById("reject-reason").focus(); },
        s: function () { document.getElementById("skip-form").submit(); }
      }[e.key];
      if (go) { e.preventDefault(); go(); }
    });
  }

  function auditKeys() {
    var editor = document.getElementById("editor");
    document.addEventListener("keydown", function (e) {
      if (e.key === "Escape" && typing(e)) { e.target.blur(); e.preventDefault(); return; }
      if (e.key === "Enter" && e.ctrlKey && e.target === editor) { e.preventDefault(); document.getElementById("incorrect-form").submit(); return; }
      if (typing(e) || e.ctrlKey || e.metaKey || e.altKey) { return; }
      var go = {
        c: function () { document.getElementById("correct-form").submit(); },
        i: function () { editor.focus(); },
        s: function () { document.getElementById("skip-form").submit(); }
      }[e.key];
      if (go) { e.preventDefault(); go(); }
    });
  }

  // The edit form's JSON boxes: the browser refuses to submit one that is
  // not JSON of the field's kind (or holds too many items), saying why.
  function jsonBoxes() {
    Array.prototype.forEach.call(document.querySelectorAll("textarea[data-json]"), function (box) {
      function check() {
        var why = "";
        if (box.value.trim() !== "") {
          try {
            var v = JSON.parse(box.value);
            var kind = box.getAttribute("data-json");
            var max = parseInt(box.getAttribute("data-max-len") || "", 10);
            if (kind === "array" && !Array.isArray(v)) { why = "a JSON array is expected, like [\"a\", \"b\"]"; }
            else if (kind === "object" && (v === null || typeof v !== "object" || Array.isArray(v))) { why = "a JSON object is expected"; }
            else if (kind === "array" && !isNaN(max) && v.length > max) { why = "at most " + max + " items"; }
          } catch (e) { why = "not JSON: " + e.message; }
        }
        box.setCustomValidity(why);
      }
      box.addEventListener("input", check);
      check();
    });
  }

  // <button data-copy="#id">: copies that element's text (says so on itself).
  function copyButtons() {
    Array.prototype.forEach.call(document.querySelectorAll("button[data-copy]"), function (b) {
      b.addEventListener("click", function () {
        var from = document.querySelector(b.getAttribute("data-copy"));
        if (!from || !navigator.clipboard) { return; }
        navigator.clipboard.writeText(from.textContent).then(function () { b.textContent = "copied"; });
      });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    jsonBoxes();
    copyButtons();
    Array.prototype.forEach.call(document.querySelectorAll("[data-live]"), live);
    var p = document.body.getAttribute("data-page");
    if (p === "queue") { queueKeys(); }
    if (p === "entry") { entryKeys(); }
    if (p === "audit") { auditKeys(); }
  });
})();
