//! `cachalot explain --html`: one self-contained page — the memory timeline with the explained
//! moment marked, the live tensors by allocation stack (click a row for its frames), the free
//! memory by segment size and the advice.
//!
//! The one rule: the page loads nothing (no network, no other file): its data is the JSON
//! report embedded in it, drawn by its own script. The script also checks itself: it adds the
//! groups' bytes and writes the sum and whether it equals `live_bytes` into the page
//! (`#computed-total`, `#check`), and `#group=N` in the address selects row `N` as a click
//! would — what `tests/explain_html.rs` reads back from a headless browser.

use crate::replay::engine::Sample;

/// Most points of the embedded timeline; longer ones keep each bucket's highest values.
pub const MAX_POINTS: usize = 2000;

/// The timeline thinned to at most [`MAX_POINTS`] points, each `[index, requested, allocated,
/// reserved]` with the highest value of each series over the bucket it stands for, so no peak
/// is lost.
pub fn thin_timeline(timeline: &[Sample]) -> Vec<[u64; 4]> {
    let n = timeline.len();
    if n == 0 {
        return Vec::new();
    }
    let per = n.div_ceil(MAX_POINTS).max(1);
    timeline
        .chunks(per)
        .enumerate()
        .map(|(k, c)| {
            [
                (k * per) as u64,
                c.iter().map(|s| s.requested).max().unwrap_or(0),
                c.iter().map(|s| s.allocated).max().unwrap_or(0),
                c.iter().map(|s| s.reserved).max().unwrap_or(0),
            ]
        })
        .collect()
}

/// The page for `report` (the JSON report of `cachalot explain`, which must hold a `timeline`
/// of [`thin_timeline`] points and `groups`, `live_bytes` …), titled `title`.
pub fn render(report: &serde_json::Value, title: &str) -> String {
    // `<` inside the embedded JSON is written as \u003c, so no `</script>` can end it early.
    let data = serde_json::to_string(report)
        .unwrap_or_else(|_| "{}".to_string())
        .replace('<', "\\u003c");
    TEMPLATE
        .replace("__TITLE__", &escape(title))
        .replace("__DATA__", &data)
}

/// Text for HTML.
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

const TEMPLATE: &str = r##"<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em auto; max-width: 1100px; color: #222; padding: 0 1em; }
h1 { font-size: 1.3em; margin-bottom: 0.2em; }
h2 { font-size: 1.1em; margin-top: 1.6em; }
.meta { color: #555; }
.figures td { padding: 0 1.5em 0 0; }
table.list { border-collapse: collapse; width: 100%; }
table.list th, table.list td { text-align: left; padding: 3px 6px; border-bottom: 1px solid #eee; vertical-align: top; }
table.list td.num, table.list th.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
#groups tbody tr { cursor: pointer; }
#groups tbody tr:hover { background: #f3f6fb; }
#groups tbody tr.selected { background: #dde8f8; }
.bar { display: inline-block; height: 0.8em; background: #4a7bd0; vertical-align: middle; }
#detail { border: 1px solid #ccd; background: #fafbff; padding: 0.6em 1em; margin-top: 0.8em; min-height: 2em; }
#detail ol { font: 12px/1.35 ui-monospace, monospace; padding-left: 2.5em; max-height: 26em; overflow: auto; }
#detail li.user { font-weight: bold; color: #0b4a9c; }
#detail li.lib { color: #444; }
#detail li.cpp { color: #999; }
svg text { font: 11px system-ui, sans-serif; fill: #444; }
.legend span { margin-right: 1.2em; }
.sw { display: inline-block; width: 1.4em; height: 0.35em; vertical-align: middle; margin-right: 0.3em; }
ul.advice li { margin-bottom: 0.4em; }
.check { color: #777; font-size: 12px; }
</style>
</head>
<body>
<h1>__TITLE__</h1>
<div class="meta" id="meta"></div>
<table class="figures" id="figures"></table>
<h2>Timeline</h2>
<div class="legend"><span><i class="sw" style="background:#d04a4a"></i>reserved</span><span><i class="sw" style="background:#4a7bd0"></i>allocated</span><span><i class="sw" style="background:#3a9a5a"></i>requested</span><span><i class="sw" style="background:#000"></i>the moment explained</span></div>
<svg id="timeline" width="1060" height="240" viewBox="0 0 1060 240" role="img" aria-label="memory timeline"></svg>
<h2>Live tensors by allocation stack</h2>
<p class="meta">Click a row for its frames (the user's own Python frames in bold).</p>
<table class="list" id="groups"><thead><tr><th class="num">#</th><th class="num">bytes</th><th></th><th class="num">tensors</th><th>allocated at</th></tr></thead><tbody></tbody></table>
<div id="detail" data-group="">Select a group.</div>
<h2>Reserved but free, by segment size</h2>
<table class="list" id="free"><thead><tr><th class="num">segment</th><th>pool</th><th class="num">segments</th><th class="num">free</th><th class="num">empty_cache() gives back</th><th class="num">stranded</th></tr></thead><tbody></tbody></table>
<h2>Advice</h2>
<ul class="advice" id="advice"></ul>
<p class="check">Page self-check: the groups add up to <span id="computed-total"></span> bytes; live bytes <span id="live-total"></span>: <span id="check"></span></p>
<script type="application/json" id="cachalot-data">__DATA__</script>
<script>
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("cachalot-data").textContent);
  function human(b) {
    var u = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"], v = b, i = 0;
    if (b < 1024) return b + " B";
    while (v >= 1024 && i + 1 < u.length) { v /= 1024; i++; }
    return v.toFixed(v >= 100 ? 1 : v >= 10 ? 2 : 3) + " " + u[i];
  }
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  var at = data.at || {};
  document.getElementById("meta").textContent =
    data.trace + " (device " + data.device + ") · " + data.settings_label + " · " + at.description;
  var figures = [
    ["reserved", data.reserved_bytes], ["live tensors (allocated)", data.live_bytes],
    ["pending frees", data.pending_bytes], ["free: empty_cache() gives back", data.releasable_bytes],
    ["free: stranded in split segments", data.stranded_bytes]
  ];
  var ft = document.getElementById("figures");
  figures.forEach(function (f) {
    var tr = el("tr");
    tr.appendChild(el("td", {}, f[0]));
    tr.appendChild(el("td", {}, human(f[1]) + " (" + f[1].toLocaleString("en-US") + " B)"));
    ft.appendChild(tr);
  });

  // Timeline.
  var svg = document.getElementById("timeline"), NS = "http://www.w3.org/2000/svg";
  var pts = data.timeline || [], W = 1000, H = 200, X0 = 55, Y0 = 10;
  var last = pts.length ? pts[pts.length - 1][0] : 1, top = 1;
  pts.forEach(function (p) { top = Math.max(top, p[3], p[2], p[1]); });
  function sx(i) { return X0 + (last > 0 ? i / last : 0) * W; }
  function sy(v) { return Y0 + H - v / top * H; }
  function line(idx, color) {
    var pl = document.createElementNS(NS, "polyline");
    pl.setAttribute("fill", "none");
    pl.setAttribute("stroke", color);
    pl.setAttribute("stroke-width", "1.3");
    pl.setAttribute("points", pts.map(function (p) { return sx(p[0]).toFixed(1) + "," + sy(p[idx]).toFixed(1); }).join(" "));
    svg.appendChild(pl);
  }
  var axis = document.createElementNS(NS, "path");
  axis.setAttribute("d", "M" + X0 + "," + Y0 + " V" + (Y0 + H) + " H" + (X0 + W));
  axis.setAttribute("stroke", "#888"); axis.setAttribute("fill", "none");
  svg.appendChild(axis);
  [[top, Y0 + 4], [0, Y0 + H]].forEach(function (t) {
    var tx = document.createElementNS(NS, "text");
    tx.setAttribute("x", 2); tx.setAttribute("y", t[1]); tx.textContent = human(t[0]);
    svg.appendChild(tx);
  });
  var xl = document.createElementNS(NS, "text");
  xl.setAttribute("x", X0 + W - 120); xl.setAttribute("y", Y0 + H + 22);
  xl.textContent = "operation (" + (data.ops || 0).toLocaleString("en-US") + ")";
  svg.appendChild(xl);
  line(1, "#3a9a5a"); line(2, "#4a7bd0"); line(3, "#d04a4a");
  var mark = document.createElementNS(NS, "line");
  var mx = sx(at.ops_before || 0);
  mark.setAttribute("x1", mx); mark.setAttribute("x2", mx);
  mark.setAttribute("y1", Y0); mark.setAttribute("y2", Y0 + H);
  mark.setAttribute("stroke", "#000"); mark.setAttribute("stroke-dasharray", "4 3");
  mark.setAttribute("id", "moment");
  svg.appendChild(mark);

  // Groups.
  var groups = data.groups || [], tbody = document.querySelector("#groups tbody");
  var detail = document.getElementById("detail"), biggest = groups.length ? groups[0].bytes : 1;
  function show(i, row) {
    var g = groups[i];
    Array.prototype.forEach.call(tbody.children, function (r) { r.classList.remove("selected"); });
    row.classList.add("selected");
    detail.setAttribute("data-group", String(i));
    detail.textContent = "";
    detail.appendChild(el("div", { id: "detail-label" }, g.label));
    detail.appendChild(el("div", { id: "detail-bytes", "data-bytes": String(g.bytes) },
      g.count + " tensors, " + human(g.bytes) + " (" + g.bytes.toLocaleString("en-US") + " B; requested " +
      human(g.requested_bytes) + "; largest " + human(g.largest_bytes) + ")" +
      (g.before_recording ? "; " + g.before_recording + " allocated before recording began" : "")));
    var s = g.stack || {};
    if (s.op || s.autograd_node)
      detail.appendChild(el("div", {}, [s.autograd_node ? "autograd node " + s.autograd_node : "", s.op || ""].filter(Boolean).join(" · ")));
    // The Python frames, innermost first (the user's own in bold), then the C++ frames folded.
    var frames = g.frames || [], py = [], cpp = [];
    frames.forEach(function (f) { (/\.py:\d+ /.test(f) ? py : cpp).push(f); });
    if (!frames.length) detail.appendChild(el("div", {}, "No frames recorded for this group."));
    if (py.length) {
      var ol = el("ol", { id: "detail-python" });
      py.forEach(function (f) {
        var lib = /(site-packages|dist-packages|\/lib\/python3|^<)/.test(f);
        ol.appendChild(el("li", { "class": lib ? "lib" : "user" }, f));
      });
      detail.appendChild(ol);
    }
    if (cpp.length) {
      var d = el("details"), ol2 = el("ol", { "class": "cpp" });
      d.appendChild(el("summary", {}, cpp.length + " C++ frames"));
      cpp.forEach(function (f) { ol2.appendChild(el("li", { "class": "cpp" }, f)); });
      d.appendChild(ol2);
      detail.appendChild(d);
    }
  }
  groups.forEach(function (g, i) {
    var tr = el("tr", { "data-group": String(i) });
    tr.appendChild(el("td", { "class": "num" }, String(i + 1)));
    tr.appendChild(el("td", { "class": "num" }, human(g.bytes)));
    var bar = el("td"), b = el("span", { "class": "bar" });
    b.style.width = Math.max(1, Math.round(g.bytes / biggest * 120)) + "px";
    bar.appendChild(b);
    tr.appendChild(bar);
    tr.appendChild(el("td", { "class": "num" }, String(g.count)));
    tr.appendChild(el("td", {}, g.label));
    tr.addEventListener("click", function () { show(i, tr); });
    tbody.appendChild(tr);
  });

  // Free memory.
  var fb = document.querySelector("#free tbody");
  (data.free_by_segment_size || []).forEach(function (r) {
    var tr = el("tr");
    tr.appendChild(el("td", { "class": "num" }, human(r.segment_bytes) + (r.expandable ? " (expandable run)" : "")));
    tr.appendChild(el("td", {}, r.pool));
    tr.appendChild(el("td", { "class": "num" }, String(r.segments)));
    tr.appendChild(el("td", { "class": "num" }, human(r.free_bytes)));
    tr.appendChild(el("td", { "class": "num" }, human(r.releasable_bytes)));
    tr.appendChild(el("td", { "class": "num" }, human(r.stranded_bytes)));
    fb.appendChild(tr);
  });

  // Advice.
  var ul = document.getElementById("advice");
  (data.advice || []).forEach(function (a) { ul.appendChild(el("li", { "data-kind": a.kind }, a.text)); });

  // Self-check, and #group=N selects a row as a click does.
  var total = groups.reduce(function (s, g) { return s + g.bytes; }, 0);
  document.getElementById("computed-total").textContent = String(total);
  document.getElementById("live-total").textContent = String(data.live_bytes);
  document.getElementById("check").textContent = total === data.live_bytes ? "ok" : "MISMATCH";
  var m = /group=(\d+)/.exec(location.hash);
  if (m && tbody.children[+m[1]]) tbody.children[+m[1]].click();
})();
</script>
</body>
</html>
"##;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_timeline_is_thinned_without_losing_its_peaks() {
        let t: Vec<Sample> = (0..10_001u64)
            .map(|i| Sample {
                requested: i % 7,
                allocated: i % 11,
                reserved: if i == 4_321 { 1 << 40 } else { i % 13 },
            })
            .collect();
        let thin = thin_timeline(&t);
        assert!(thin.len() <= MAX_POINTS);
        assert_eq!(thin.iter().map(|p| p[3]).max(), Some(1 << 40));
        assert_eq!(thin[0][0], 0);
    }

    #[test]
    fn the_embedded_data_cannot_close_the_script() {
        let page = render(
            &serde_json::json!({"trace": "</script><script>alert(1)</script>"}),
            "a <b> & c",
        );
        assert!(!page.contains("</script><script>alert"));
        assert!(page.contains("a &lt;b&gt; &amp; c"));
        // Nothing to load: no external script, style, image or link.
        for attr in ["src=", "href=", "<link", "@import", "url("] {
            assert!(!page.contains(attr), "{attr}");
        }
    }
}
