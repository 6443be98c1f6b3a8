// flowkube console: live regions. An element with data-live="/events/..." is replaced by each
// fragment the server sends (server-rendered, escaped HTML). A draft being typed in a textarea with
// data-keep survives the swap while it answers the same request. No inline code: the page's
// Content-Security-Policy allows only this file.
"use strict";

function swap(region, html) {
  const drafts = {};
  const focused = document.activeElement && document.activeElement.id;
  region.querySelectorAll("textarea[data-keep]").forEach((t) => {
    drafts[t.id + "|" + t.dataset.keep] = t.value;
  });
  region.innerHTML = html;
  region.querySelectorAll("textarea[data-keep]").forEach((t) => {
    const kept = drafts[t.id + "|" + t.dataset.keep];
    if (kept !== undefined && kept !== "") t.value = kept;
  });
  if (focused) {
    const again = document.getElementById(focused);
    if (again && region.contains(again)) again.focus();
  }
  region.dispatchEvent(new CustomEvent("flowkube:updated", { bubbles: true }));
}

function follow(region) {
  const source = new EventSource(region.dataset.live);
  region.dataset.connected = "0";
  source.addEventListener("open", () => { region.dataset.connected = "1"; });
  source.addEventListener("update", (e) => swap(region, e.data));
  source.addEventListener("error", () => { region.dataset.connected = "0"; });
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-live]").forEach(follow);
  // A form is sent once: a second click while the first is on its way is ignored.
  document.addEventListener("submit", (e) => {
    const form = e.target;
    if (form.dataset.sending === "1") { e.preventDefault(); return; }
    form.dataset.sending = "1";
  });
});
