// kvscope dashboard helpers: ECharts renderItem functions, tooltip formatters, latency probe.
// Loaded once per page; every chart option refers to these by name (":renderItem": "kvscope.x").
(function () {
  const colors = window.KVSCOPE_COLORS; // frontend/palette.py's for_js(), set by the page head
  const palette = colors.requests;
  const KIND_COLORS = colors.kinds;
  // A timeline cell's kind index: RunHistory's KINDS (backend/events/history.py), sent by palette.for_js
  const KIND_NAMES = colors.kindNames;
  const KIND_LABELS = colors.kindLabels; // the words of the timeline's legend (palette.py's KIND_LABELS)
  const RECOMPUTE = KIND_NAMES.indexOf("recompute");
  const PHASES = colors.phases; // the batch chart's phase index (backend/phase.py's SHOWN_PHASES)
  const esc = (s) => String(s).replace(/[&<>]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;" }[c]));

  function rect(api, x0, y0, x1, y1, style) {
    const a = api.coord([x0, y0]);
    const b = api.coord([x1, y1]);
    return {
      type: "rect",
      shape: { x: Math.min(a[0], b[0]), y: Math.min(a[1], b[1]), width: Math.max(Math.abs(b[0] - a[0]), 0.8),
               height: Math.max(Math.abs(b[1] - a[1]), 0.8) },
      style: style,
    };
  }

  const kv = {
    palette: palette,
    latency: [],
    // [x0, x1, row, kind, tokens, step, request_id]
    timelineCell(params, api) {
      const row = api.value(2);
      const h = Math.max(api.size([0, 1])[1] * 0.74, 1);
      const a = api.coord([api.value(0), row]);
      const b = api.coord([api.value(1), row]);
      return { type: "rect", shape: { x: a[0], y: a[1] - h / 2, width: Math.max(b[0] - a[0] - 0.4, 0.8), height: h },
               style: { fill: KIND_COLORS[api.value(3)] } };
    },
    // [x0, x1, row, slot, slots, parent slot, end (0 open, 1 finished, 2 pruned), seq, request, position,
    // reason, parent seq]: one sequence of a multi-sequence request, a thin line inside the request's row
    branchLine(params, api) {
      const row = api.value(2), slots = api.value(4), parent = api.value(5), end = api.value(6);
      const band = Math.max(api.size([0, 1])[1] * 0.74, 4);
      const top = api.coord([api.value(0), row])[1] - band / 2;
      const yOf = (slot) => top + (band * (slot + 0.5)) / slots;
      const x0 = api.coord([api.value(0), row])[0], x1 = api.coord([api.value(1), row])[0], y = yOf(api.value(3));
      const ink = { stroke: "#111827", lineWidth: 1.5 };
      const kids = [{ type: "line", shape: { x1: x0, y1: y, x2: x1, y2: y }, style: ink }];
      if (parent >= 0) kids.push({ type: "line", shape: { x1: x0, y1: yOf(parent), x2: x0, y2: y }, style: ink });
      // the marks keep their size however thin the lines get: a lesson points at them
      const r = kv.markPx() / 2, cross = { stroke: "#dc2626", lineWidth: r / 2.5 };
      // a mark at the plot's edge (the run's first or last iteration) moves in by its size: clipped, half
      // of it would be lost
      const plot = params.coordSys, pad = r + r / 2.5;
      const inside = (x) => Math.min(Math.max(x, plot.x + pad), plot.x + plot.width - pad);
      const fx = inside(x0), ex = inside(x1);
      if (parent >= 0) // the fork: where this sequence left its parent
        kids.push({ type: "circle", name: "fork", shape: { cx: fx, cy: y, r: r - 1 }, z2: 2,
                    style: { fill: "#fff", stroke: "#111827", lineWidth: r / 4 } });
      if (end === 2) { // pruned: a cross
        kids.push({ type: "line", name: "prune", shape: { x1: ex - r, y1: y - r, x2: ex + r, y2: y + r }, style: cross, z2: 2 });
        kids.push({ type: "line", name: "prune", shape: { x1: ex - r, y1: y + r, x2: ex + r, y2: y - r }, style: cross, z2: 2 });
      } else if (end === 1) {
        kids.push({ type: "circle", name: "finished", shape: { cx: ex, cy: y, r: r }, style: { fill: "#111827" }, z2: 2 });
      }
      return { type: "group", children: kids };
    },
    // [x0, x1, row, share, ms, step, count, bytes, step ms]: one step's all-reduces (tensor parallelism), the
    // step's extent outlined and the share of it rank 0 spent in them filled from its start
    allreduceCell(params, api) {
      const row = api.value(2);
      const h = Math.max(api.size([0, 1])[1] * 0.5, 3);
      const a = api.coord([api.value(0), row]), b = api.coord([api.value(1), row]);
      const width = Math.max(b[0] - a[0] - 0.4, 0.8), y = a[1] - h / 2;
      return { type: "group", children: [
        { type: "rect", shape: { x: a[0], y, width, height: h },
          style: { fill: null, stroke: colors.allreduce, opacity: 0.35, lineWidth: 1 } },
        { type: "rect", shape: { x: a[0], y, width: Math.max(width * api.value(3), 0.8), height: h },
          style: { fill: colors.allreduce } },
      ] };
    },
    // [x0, x1, row, share, ms, step, tokens, running, role (its kind's index), instance]: a disaggregated
    // instance's step, outlined, the share of it that instance spent working filled in its role's colour
    instanceCell(params, api) {
      const row = api.value(2);
      const h = Math.max(api.size([0, 1])[1] * 0.6, 3);
      const a = api.coord([api.value(0), row]), b = api.coord([api.value(1), row]);
      const width = Math.max(b[0] - a[0] - 0.4, 0.8), y = a[1] - h / 2;
      const fill = KIND_COLORS[api.value(8)];
      return { type: "group", children: [
        { type: "rect", shape: { x: a[0], y, width, height: h }, style: { fill: null, stroke: fill, opacity: 0.35, lineWidth: 1 } },
        { type: "rect", shape: { x: a[0], y, width: Math.max(width * api.value(3), api.value(6) ? 0.8 : 0), height: h },
          style: { fill } },
      ] };
    },
    timelineTip(p) {
      const v = p.value;
      if (p.seriesId && p.seriesId.startsWith("in-"))
        return `<b>${colors.kindNames[v[8]]} instance ${v[9]}</b> · iteration ${v[5]}<br>${v[6]} tokens, ` +
               `${v[7]} running<br>${v[4]} ms on its own clock (${Math.round(v[3] * 100)}% of the step)`;
      if (p.seriesId === "transfers") return `<b>${esc(v[2])}</b>: KV moved<br>${esc(v[3])}`;
      if (p.seriesId && p.seriesId.startsWith("ar-"))
        return `<b>all-reduce</b> · iteration ${v[5]}<br>${+v[4].toFixed(1)} ms of the step's ${+v[8].toFixed(1)} ms ` +
               `(${Math.round(v[3] * 100)}%)<br>${v[6]} all-reduces, ${(v[7] / 1024).toFixed(1)} KiB summed<br>` +
               "rank 0's time in them, waiting for the slower rank included";
      if (p.seriesId === "branches") {
        const origin = v[5] >= 0 ? `forked from seq ${v[11]} at token ${v[9]}` : "first sequence";
        return `<b>${esc(v[8])}</b> · seq ${v[7]}<br>${origin}` + (v[10] ? `<br>ended: ${esc(v[10])}` : "");
      }
      if (p.seriesId === "ttft") return `<b>${esc(v[2])}</b>: first token at ${v[0]}<br>TTFT ${v[3]}`;
      const tokens = v[4] ? ` · ${v[4]} token${v[4] > 1 ? "s" : ""}` : "";
      const steps = v[7] > v[5] ? `iterations ${v[5]}–${v[7]}` : `iteration ${v[5]}`;
      return `<b>${esc(v[6])}</b> · ${steps}<br>${KIND_LABELS[v[3]]}${tokens}`;
    },
    // [x0, x1, y0, y1, color, phase (PHASES index), request_id, tokens, focus (0 none picked, 1 the
    // picked request, 2 another)]: iterations x0..x1 (equal consecutive columns are merged into one
    // shape) stacked from y0 to y1 tokens
    batchSeg(params, api) {
      const half = Math.max(api.size([1, 0])[0] * 0.4, 0.5);
      const a = api.coord([api.value(0), api.value(3)]);
      const b = api.coord([api.value(1), api.value(2)]);
      const phase = PHASES[api.value(5)], focus = api.value(8);
      const solid = phase === "prefill" || phase === "recompute";
      const h = Math.max(b[1] - a[1], 3); // a 1-token decode stays visible next to a 2,048-token prefill
      const style = { fill: api.value(4) >= 900 ? colors.many : palette[api.value(4) % palette.length],
                      opacity: (solid ? 1 : 0.5) * (focus === 2 ? 0.25 : 1),
                      stroke: phase === "recompute" ? KIND_COLORS[RECOMPUTE] : solid ? "#222" : null,
                      lineWidth: phase === "recompute" ? 2 : solid ? 0.6 : 0 };
      if (focus === 1) Object.assign(style, { stroke: "#111827", lineWidth: 2.5 });
      return { type: "rect", shape: { x: a[0] - half, y: b[1] - h, width: b[0] - a[0] + 2 * half, height: h },
               style: style, z2: focus === 1 ? 10 : 0 };
    },
    batchTip(p) {
      const v = p.value;
      const steps = v[1] > v[0] ? `iterations ${v[0]}–${v[1]}` : `iteration ${v[0]}`;
      if (p.seriesId && p.seriesId.startsWith("sl-"))
        return `${steps}<br>${v[2]} of ${v[3]} slots used` + (v[3] > v[2] ? `<br><b>${v[3] - v[2]} idle</b>` : "");
      return `<b>${esc(v[6])}</b> · ${steps}<br>${PHASES[v[5]]}: ${v[7]} token${v[7] > 1 ? "s" : ""} per iteration`;
    },
    // [x0, x1, used, max]: batch slots in use and idle over iterations x0..x1
    slotBar(params, api) {
      const used = api.value(2), max = api.value(3);
      // a slot is held from one iteration to the next: runs touch (a gap would read as an idle moment)
      const half = Math.max(api.size([1, 0])[0] * 0.5, 0.5);
      const children = [];
      const r = (y0, y1, style) => {
        const a = api.coord([api.value(0), y1]), b = api.coord([api.value(1), y0]);
        children.push({ type: "rect", shape: { x: a[0] - half, y: a[1], width: b[0] - a[0] + 2 * half,
                                               height: Math.max(b[1] - a[1], 0) }, style });
      };
      r(0, used, { fill: colors.slots.used });
      if (max > used) r(used, max, { fill: colors.slots.idle, stroke: colors.slots.idle_edge, lineWidth: 0.6 });
      return { type: "group", children };
    },
    // [row, offset, start, q, key_len, color]: query at absolute position q sees keys 0..q;
    // keys below `start` come from the KV cache, start..q are computed in this pass.
    maskRow(params, api) {
      const row = api.value(0), off = api.value(1), start = api.value(2), q = api.value(3), klen = api.value(4);
      const y0 = row - 0.5, y1 = row + 0.5;
      const kids = [];
      if (klen > q + 1) kids.push(rect(api, off + q + 1, y0, off + klen, y1, { fill: colors.mask.masked }));
      if (start > 0) kids.push(rect(api, off, y0, off + start, y1, { fill: colors.mask.cached }));
      kids.push(rect(api, off + start, y0, off + q + 1, y1, { fill: colors.mask.computed }));
      return { type: "group", children: kids };
    },
    maskTip(p) {
      const v = p.value;
      const cached = v[2] > 0 ? `<br>keys 0..${v[2] - 1} read from the KV cache` : "";
      return `${v[6] ? `<b>${esc(v[6])}</b><br>` : ""}query at position ${v[3]} attends to keys 0..${v[3]}` + cached +
             `<br>keys ${v[2]}..${v[3]} computed in this pass` + (v[4] > v[3] + 1 ? `<br>keys ${v[3] + 1}..${v[4] - 1} masked (future)` : "");
    },
    // Seconds on a time axis, in the unit that keeps them readable (modelled steps last microseconds).
    seconds(v) {
      const a = Math.abs(v);
      if (a === 0 || a >= 1) return `${+v.toFixed(2)} s`;
      if (a >= 1e-3) return `${+(v * 1e3).toPrecision(3)} ms`;
      return `${+(v * 1e6).toPrecision(3)} µs`;
    },
    // A log axis's numbers in SI steps (1k, 1M, 1G, 1T): FLOP/s span fifteen decades.
    si(v) {
      const units = [[1e15, "P"], [1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
      for (const [scale, unit] of units) if (Math.abs(v) >= scale) return `${+(v / scale).toPrecision(3)}${unit}`;
      return `${+v.toPrecision(3)}`;
    },
    // [intensity, attained FLOP/s, step, µs, roofs' µs, compute µs, memory µs, fixed µs, measured] of one
    // iteration (views/roofline.py roofline_point)
    rooflineTip(p) {
      const v = p.value;
      if (p.seriesId === "roof") return "the roofs: memory bandwidth × intensity, then peak FLOP/s";
      if (p.seriesId === "fixed-roof") return "the roofs lowered by the run's fixed cost per step";
      const t = (us) => kv.seconds(us / 1e6);
      return `iteration ${v[2]} · ${esc(p.seriesName)}<br>${kv.si(v[0])} FLOP/byte<br>` +
             `${kv.si(v[1])}FLOP/s · ${t(v[3])} ${v[8] ? "measured" : "modelled"}<br>` +
             `= roofs ${t(v[4])} (compute ${t(v[5])}, memory ${t(v[6])}) + fixed cost ${t(v[7])}`;
    },
    // Records how long after the NiceGUI process received an event the browser painted it.
    lat(stamp, view) {
      const applied = Date.now() - stamp;
      requestAnimationFrame(() => {
        kv.latency.push([view, Date.now() - stamp, applied, Date.now(), stamp]);
        if (kv.latency.length > 20000) kv.latency.splice(0, 10000);
      });
    },
    // Tells the dashboard process this view's update reached the screen, so it may send the next.
    painted(key) {
      requestAnimationFrame(() => window.emitEvent && emitEvent(`kvscope_painted_${key}`));
    },
    p95(last, withinMs) {
      const since = Date.now() - (withinMs || 1e12);
      const xs = kv.latency.slice(-(last || 400)).filter((x) => x[3] >= since).map((x) => x[1]).sort((a, b) => a - b);
      return xs.length ? xs[Math.min(xs.length - 1, Math.floor(0.95 * xs.length))] : null;
    },
  };
  // Projector mode: large type everywhere (the page's CSS under html.kv-projector, and here the
  // charts' canvas text, which CSS cannot reach), remembered for the tab's session.
  const PROJECTOR_KEY = "kvscope-projector";
  const PROJECTOR_FONT = 16;
  const root = document.documentElement;
  function chartFonts(chart, on) {
    const o = chart.getOption();
    if (!o) return;
    if (!chart.__kvNormal) { // the sizes the view chose, to go back to
      const of = (list, key) => (list || []).map((item) => (item[key] || {}).fontSize || 12);
      chart.__kvNormal = { x: of(o.xAxis, "axisLabel"), xn: of(o.xAxis, "nameTextStyle"),
                           y: of(o.yAxis, "axisLabel"), yn: of(o.yAxis, "nameTextStyle"),
                           legend: of(o.legend, "textStyle"), tooltip: of(o.tooltip, "textStyle"),
                           zoom: of(o.dataZoom, "textStyle") };
    }
    const n = chart.__kvNormal;
    const size = (normal, i) => (on ? Math.max(PROJECTOR_FONT, normal[i] || 0) : normal[i]);
    const axes = (list, labels, names) => (list || []).map((_, i) => ({
      axisLabel: { fontSize: size(labels, i) }, nameTextStyle: { fontSize: size(names, i) } }));
    const texts = (list, normal) => (list || []).map((_, i) => ({ textStyle: { fontSize: size(normal, i) } }));
    chart.setOption({ xAxis: axes(o.xAxis, n.x, n.xn), yAxis: axes(o.yAxis, n.y, n.yn), legend: texts(o.legend, n.legend),
                      tooltip: texts(o.tooltip, n.tooltip), dataZoom: texts(o.dataZoom, n.zoom) });
    chart.__kvProjector = on;
  }
  // An axis a view replaced (the sampling view's linear <-> log) comes back at ECharts' 12 px: read
  // from the chart's model, which costs nothing, where getOption() would copy every series.
  function smallAxisText(chart) {
    const model = chart.getModel && chart.getModel();
    if (!model) return false;
    return ["xAxis", "yAxis"].some((mainType) => model.findComponents({ mainType }).some((axis) =>
      (axis.get(["axisLabel", "fontSize"]) || 12) < PROJECTOR_FONT));
  }
  function charts() {
    const out = [];
    for (const el of document.querySelectorAll("[data-kv]")) {
      const component = window.getElement && getElement(el.id.slice(1));
      if (component && component.chart && !component.chart.isDisposed()) out.push(component.chart);
    }
    return out;
  }
  kv.projector = () => root.classList.contains("kv-projector");
  // The size of a chart's marks (fork, prune, finish, first token): 16 px from the back of a room.
  kv.markPx = () => (kv.projector() ? 16 : 10);
  kv.setProjector = (on) => {
    root.classList.toggle("kv-projector", on);
    sessionStorage.setItem(PROJECTOR_KEY, on ? "1" : "");
    for (const chart of charts()) chartFonts(chart, on);
    window.dispatchEvent(new Event("kvscope-projector")); // the block pool lays its cells out again
  };
  kv.toggleProjector = () => kv.setProjector(!kv.projector());
  // The fixed header's height, for the CSS that keeps cards clear of it (kvscope.css: the lesson dock).
  (function watchHeader() {
    const header = document.querySelector(".q-header");
    if (!header) return setTimeout(watchHeader, 100); // Vue mounts the page after this script ran
    new ResizeObserver(() => root.style.setProperty("--kv-header-h", `${header.offsetHeight}px`)).observe(header);
  })();
  root.classList.toggle("kv-projector", sessionStorage.getItem(PROJECTOR_KEY) === "1");
  // A lesson pause's view, scrolled into sight, and held there while the page settles: the views above
  // it still grow in the updates that come with the pause (a finished run's last rows), pushing it
  // down. Every resize of the page or a card within SIGHT_MS scrolls it back, until the person at the
  // keyboard scrolls for themselves.
  const SIGHT_MS = 5000;
  let sight = null; // {id, until}
  const keepInSight = () => {
    if (!sight || performance.now() > sight.until) return (sight = null);
    document.getElementById(sight.id)?.scrollIntoView({ block: "nearest", behavior: "auto" });
  };
  kv.bringIntoSight = (id) => {
    sight = { id, until: performance.now() + SIGHT_MS };
    document.getElementById(id)?.scrollIntoView({ block: "nearest", behavior: "smooth" });
  };
  for (const name of ["wheel", "touchstart", "keydown"]) addEventListener(name, () => (sight = null), { passive: true });
  new ResizeObserver(keepInSight).observe(document.documentElement);
  // The keys a lecturer reaches for (docs/dashboard.md): each presses the button it stands for, so a key
  // does exactly what a click does. Typing in a field, or with a modifier held, is left alone.
  const SHORTCUTS = [ // [keys as the help names them, what they do]; the handler below reads the keys
    [["space", "→"], "continue the lesson; without one, space plays / pauses and → steps one iteration"],
    [["←"], "the lesson's previous moment: its card and question again"],
    [["N"], "the next view the lesson's step names, brought into sight"],
    [["P"], "projector mode on / off"],
    [["F"], "full screen: the view the lesson names, else the page (Esc leaves)"],
    [["?"], "these keys"],
  ];
  const visible = (el) => el && el.offsetParent !== null && !el.disabled;
  const press = (kv) => {
    const el = [...document.querySelectorAll(`[data-kv=${kv}]`)].find(visible);
    if (el) el.click();
    return Boolean(el);
  };
  kv.shortcutsHelp = () => {
    let help = document.getElementById("kv-shortcuts");
    if (help) return help.remove();
    help = document.createElement("div");
    help.id = "kv-shortcuts";
    help.className = "kv-shortcuts";
    help.dataset.kv = "shortcuts";
    help.innerHTML = "<b>Keys</b>" + SHORTCUTS.map(([keys, what]) =>
      `<div>${keys.map((k) => `<kbd>${esc(k)}</kbd>`).join(" ")} ${esc(what)}</div>`).join("") +
      "<div class='kv-muted'>? or Esc closes this</div>";
    help.addEventListener("click", () => help.remove());
    document.body.appendChild(help);
  };
  kv.fullScreen = () => {
    if (document.fullscreenElement) return document.exitFullscreen();
    const named = [...document.querySelectorAll(".kv-focus-now, .kv-focus")].find(visible);
    return (named || document.documentElement).requestFullscreen?.().catch(() => {});
  };
  addEventListener("keydown", (e) => {
    const t = e.target;
    if (e.ctrlKey || e.metaKey || e.altKey || e.isComposing) return;
    if (t && (t.isContentEditable || /^(INPUT|TEXTAREA|SELECT)$/.test(t.tagName))) return;
    if (e.key === "Escape") return document.getElementById("kv-shortcuts")?.remove();
    if (e.key === " " || e.key === "ArrowRight") {
      if (!press("lesson-continue") && !press(e.key === " " ? "play" : "step")) return;
    } else if (e.key === "ArrowLeft") {
      if (!press("lesson-previous")) return;
    } else if (e.key === "n" || e.key === "N") {
      if (!press("lesson-next-view")) return;
    } else if (e.key === "p" || e.key === "P") kv.toggleProjector();
    else if (e.key === "f" || e.key === "F") kv.fullScreen();
    else if (e.key === "?") kv.shortcutsHelp();
    else return;
    e.preventDefault(); // space would also scroll the page, or press the focused button a second time
  });
  window.kvscope = kv;
  // ECharts (zrender) takes a line of text to be as tall as "国" is wide. Without a CJK font that is a
  // narrow fallback glyph (6 px at 16 px), so it lays labels out as if lines were 6 px tall: the
  // timeline's 512 request names, legend rows and axis names overlap. This font holds that one glyph,
  // an empty square one em wide (fontTools' FontBuilder: glyph uni56FD, advance 1000 of 1000 units),
  // and the charts' font list names it (views/charts.py). Built from bytes it is ready at once, before
  // any chart measures a label (zrender caches what it measured).
  const EM_FONT = "AAEAAAAKAIAAAwAgT1MvMpvcpSEAAAEoAAAAYGNtYXAADFdQAAABkAAAADRnbHlmAAAAAAAAAcwAAAABaGVhZC2AxoQAAACsAAAANmhoZWEDcgNzAAAA5AAAACRobXR4A+gAAAAAAYgAAAAIbG9jYQAAAAAAAAHEAAAABm1heHAAAwACAAABCAAAACBuYW1lRdlAGQAAAdAAAABpcG9zdLWzPKsAAAI8AAAALgABAAAAAQAADPIWp18PPPUAAwPoAAAAAOc1QtIAAAAA5zVC0gAAAAAAAAAAAAAAAwACAAAAAAAAAAEAAANw/4gAAAPoAAAAAAAAAAEAAAAAAAAAAAAAAAAAAAACAAEAAAACAAAAAAAAAAAAAgAAAAAAAAAAAAAAAAAAAAAAAwPoAZAABQAEAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAACAAAAAAAAAAAAAAAPz8/PwAAVv1W/QNw/4gAAANwAHgAAAAAAAAAAAAAAAAAAAAgAAAAAAAAA+gAAAAAAAIAAAADAAAAFAADAAEAAAAUAAQAIAAAAAQABAABAABW/f//AABW/f//qQQAAQAAAAAAAAAAAAAAAAAAAAAAAAAEADYAAQAAAAAAAQAKAAAAAQAAAAAAAgAHAAoAAwABBAkAAQAUABEAAwABBAkAAgAOACVrdnNjb3BlLWVtUmVndWxhcgBrAHYAcwBjAG8AcABlAC0AZQBtAFIAZQBnAHUAbABhAHIAAAAAAgAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAACAAABAgd1bmk1NkZEAAA=";
  document.fonts.add(new FontFace("kvscope-em", Uint8Array.from(atob(EM_FONT), (c) => c.charCodeAt(0)),
                                  { unicodeRange: "U+56FD" }));
  // Each card's height as --kv-h: in projector mode a card's scroll-margin-bottom tops it up to the
  // window's height (kvscope.css), so a lesson's scrollIntoView({block: "nearest"}) always puts the
  // card it names whole just under the header, where a card that grows during the pause stays in sight.
  const cardSizes = new ResizeObserver((entries) => {
    for (const e of entries) e.target.style.setProperty("--kv-h", `${e.target.offsetHeight}px`);
    keepInSight();
  });
  setInterval(() => { // charts and cards mounted after the switch (a page opened in projector mode) catch up
    for (const card of document.querySelectorAll(".kv-card:not([data-kv-sized])")) {
      card.dataset.kvSized = "1";
      cardSizes.observe(card);
    }
    const on = kv.projector();
    for (const chart of charts()) {
      if ((chart.__kvProjector !== on && (on || chart.__kvNormal)) || (on && smallAxisText(chart))) chartFonts(chart, on);
    }
  }, 500);
  setInterval(() => {
    const el = document.getElementById("kvscope-lag");
    const p = kv.p95(200, 10000); // the last ten seconds: the page load's first paint is not "lag"
    if (el) el.textContent = p === null ? "" : `screen lag p95 ${p} ms`;
  }, 1000);
})();
