/* tagplan web view: jobs, submission and the drawings of a finished plan (no framework, no build).
 *
 * The top half is pure: functions from the API's JSON to HTML/SVG strings (exported for Node, see
 * the bottom), so they can be checked without a browser. The bottom half is the browser glue: the
 * API key (localStorage, or `?key=` once), fetch, hash routes `#/` and `#/jobs/<id>`, polling.
 */
(function (root) {
  "use strict";

  // ---------------------------------------------------------------- formatting helpers (pure)

  function esc(value) {
    return String(value === undefined || value === null ? "" : value)
      .replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }

  function isNum(x) {
    return typeof x === "number" && isFinite(x);
  }

  function round(x, digits) {
    const p = Math.pow(10, digits);
    return Math.round(x * p) / p;
  }

  /** Seconds as a readable duration: us, ms or s. */
  function fmtSeconds(s) {
    if (!isNum(s)) return "–";
    const a = Math.abs(s);
    if (a === 0) return "0 s";
    if (a < 1e-3) return round(s * 1e6, 1) + " µs";
    if (a < 1) return (s * 1e3).toFixed(a < 0.01 ? 3 : a < 0.1 ? 2 : 1) + " ms";
    if (a < 120) return s.toFixed(a < 10 ? 3 : 2) + " s";
    return (s / 60).toFixed(1) + " min";
  }

  /** Bytes in decimal units (1 GB = 1e9 B, as the planner reports capacities). */
  function fmtBytes(b) {
    if (!isNum(b)) return "–";
    const units = [["TB", 1e12], ["GB", 1e9], ["MB", 1e6], ["kB", 1e3]];
    for (let i = 0; i < units.length; i++) {
      if (Math.abs(b) >= units[i][1]) return (b / units[i][1]).toFixed(2) + " " + units[i][0];
    }
    return Math.round(b) + " B";
  }

  function fmtNum(x, digits) {
    if (!isNum(x)) return "–";
    const d = digits === undefined ? 1 : digits;
    const parts = x.toFixed(d).split(".");
    parts[0] = parts[0].replace(/\B(?=(\d{3})+(?!\d))/g, ",");
    return parts.join(".");
  }

  function fmtPct(x) {
    return isNum(x) ? (x * 100).toFixed(1) + " %" : "–";
  }

  function fmtDate(iso) {
    if (!iso) return "–";
    const d = new Date(iso);
    if (isNaN(d.getTime())) return String(iso);
    const pad = (n) => String(n).padStart(2, "0");
    return d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + " " +
      pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds());
  }

  /** Device ids as runs in the order given (plan order): [24..31] -> "24-31", [0,1,2,3,8,9,10,11] ->
   * "0-3, 8-11", [5] -> "5", [28, 27] -> "28, 27". A run only ever climbs by one, so a reversed or
   * interleaved group never prints as a backwards range; repeated ids are shown once. */
  function deviceRuns(ids) {
    const seen = new Set();
    const list = [];
    (ids || []).forEach((d) => {
      const key = String(d);
      if (!seen.has(key)) { seen.add(key); list.push(d); }
    });
    const out = [];
    let i = 0;
    while (i < list.length) {
      let j = i;
      while (j + 1 < list.length && isNum(list[j]) && list[j + 1] === list[j] + 1) j++;
      out.push(j > i ? list[i] + "-" + list[j] : String(list[i]));
      i = j + 1;
    }
    return out.join(", ");
  }

  /** A set of device ids in ascending runs: [0,1,2,3,8,10,11] -> "0-3, 8, 10-11". */
  function fmtRanges(ids) {
    return deviceRuns(Array.from(new Set(ids || [])).sort((a, b) => a - b));
  }

  function truncate(text, n) {
    const s = String(text);
    return s.length > n ? s.slice(0, n - 1) + "…" : s;
  }

  /** About `count` round tick values covering [lo, hi]. */
  function niceTicks(lo, hi, count) {
    if (!(hi > lo)) return [lo];
    const raw = (hi - lo) / Math.max(1, count);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const norm = raw / mag;
    const step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
    const ticks = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(round(t, 12));
    return ticks;
  }

  /** A label for tick `t` of `ticks`, with as many decimals as their spacing needs. */
  function tickLabel(t, ticks) {
    const step = ticks && ticks.length > 1 ? Math.abs(ticks[1] - ticks[0]) : Math.abs(t) || 1;
    const decimals = Math.max(0, Math.min(10, -Math.floor(Math.log10(step) + 1e-9)));
    return Math.abs(t) >= 1000 ? fmtNum(t, decimals) : t.toFixed(decimals);
  }

  // Tableau 10: distinguishable, colour-blind-friendlier than a rainbow.
  const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
    "#ff9da7", "#9c755f", "#bab0ac"];

  function stageColor(i) {
    if (i < PALETTE.length) return PALETTE[i];
    const hue = (i * 137.508) % 360; // golden angle: well spread
    return "hsl(" + hue.toFixed(0) + ", 55%, " + (i % 2 ? 45 : 62) + "%)";
  }

  /** Black or white text, whichever reads better on `color` (hex or our hsl strings). */
  function textOn(color) {
    let r, g, b;
    const m = /^#([0-9a-f]{6})$/i.exec(color);
    if (m) {
      const v = parseInt(m[1], 16);
      r = (v >> 16) & 255; g = (v >> 8) & 255; b = v & 255;
    } else {
      const h = /hsl\(\s*[\d.]+,\s*[\d.]+%,\s*([\d.]+)%\)/.exec(color);
      const l = h ? Number(h[1]) : 50;
      return l > 55 ? "#111" : "#fff";
    }
    const lum = (0.299 * r + 0.587 * g + 0.114 * b) / 255;
    return lum > 0.6 ? "#111" : "#fff";
  }

  const STATUS_LABEL = { queued: "queued", running: "running", succeeded: "succeeded", failed: "failed",
    cancelled: "cancelled" };

  function statusBadge(status) {
    const s = STATUS_LABEL[status] ? status : "unknown";
    return '<span class="badge status-' + esc(s) + '">' + esc(status || "unknown") + "</span>";
  }

  // ---------------------------------------------------------------- plan helpers (pure)

  function planOf(candidate) {
    return (candidate && candidate.plan) || { stages: [] };
  }

  function reportOf(candidate) {
    return (candidate && candidate.report) || {};
  }

  /** "dp × [cp ×] tp" of a stage, compact ("2×4", "2×2×4" under context parallelism). */
  function mesh(stage) {
    return (stage.dp || 1) + "×" + ((stage.cp || 1) > 1 ? stage.cp + "×" : "") + (stage.tp || 1);
  }

  /** "dp 2 × tp 2" (and cp under context parallelism) and extras of a stage. */
  function stageShape(stage) {
    const cp = (stage.cp || 1) > 1 ? " × cp " + stage.cp : "";
    const bits = ["dp " + (stage.dp || 1) + cp + " × tp " + (stage.tp || 1)];
    if (stage.zero) bits.push("ZeRO-" + stage.zero);
    if (stage.recompute) bits.push(stage.recompute_layers ? "recompute " + stage.recompute_layers + " layers" : "recompute");
    return bits.join(" · ");
  }

  /** One line describing a plan: stages and their meshes, micro-batches, schedule. */
  function describePlan(plan) {
    const stages = plan.stages || [];
    const meshes = stages.map(mesh);
    const uniq = Array.from(new Set(meshes));
    const label = stages.some((s) => (s.cp || 1) > 1) ? "dp×[cp×]tp " : "dp×tp ";
    const shown = label + (uniq.length === 1 ? uniq[0] : meshes.join(", "));
    return stages.length + (stages.length === 1 ? " stage" : " stages") + " (" + shown + "), " +
      (plan.micro_batches || 1) + " micro-batch" + ((plan.micro_batches || 1) === 1 ? "" : "es") +
      ", " + (plan.schedule || "1f1b");
  }

  /** device id -> [{stage, replica, rank}] (a device may serve several stages when interleaved); devices are
   * ordered tp-fastest, then cp, then dp, so a replica spans cp × tp devices. */
  function deviceRoles(plan) {
    const roles = new Map();
    (plan.stages || []).forEach((stage, s) => {
      const tp = stage.tp || 1;
      const width = tp * (stage.cp || 1);
      (stage.devices || []).forEach((d, k) => {
        if (!roles.has(d)) roles.set(d, []);
        roles.get(d).push({ stage: s, replica: Math.floor(k / width), rank: k % tp });
      });
    });
    return roles;
  }

  function memoryByDevice(report) {
    const out = new Map();
    const devs = report.devices || [];
    const mems = report.memory_per_device_bytes || [];
    devs.forEach((d, i) => { if (isNum(mems[i])) out.set(d, mems[i]); });
    return out;
  }

  // Shipped presets (tagplan/frontends/presets.py): GPUs per node and the device type. Used only
  // when a result carries no cluster description, to lay devices out by node from the SPEC.
  const PRESETS = {
    "dgx-a100-40gb": [8, "A100-SXM-40GB"], "dgx-a100-80gb": [8, "A100-SXM-80GB"],
    "dgx-h100": [8, "H100-SXM"], "p4d.24xlarge": [8, "A100-SXM-40GB"],
    "p3.8xlarge": [4, "V100-SXM2-16GB"], "p3.16xlarge": [8, "V100-SXM2-16GB"],
    "g4dn.12xlarge": [4, "T4"], "rtx4090x4": [4, "RTX4090"],
  };

  /** Nodes of a preset cluster SPEC (`p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1`), or null. */
  function layoutFromSpec(spec) {
    if (typeof spec !== "string" || !spec.trim()) return null;
    const nodes = [];
    let next = 0;
    const counters = {};
    const terms = spec.split("+");
    for (let t = 0; t < terms.length; t++) {
      const parts = terms[t].split(/[:,]/).map((p) => p.trim());
      const name = parts[0].toLowerCase();
      const preset = PRESETS[name];
      if (!preset) return null;
      let count = 1;
      let type = preset[1];
      for (let p = 1; p < parts.length; p++) {
        const kv = parts[p].split("=");
        if (kv[0].trim() === "nodes") count = parseInt(kv[1], 10);
        else if (kv[0].trim() === "gpu" && kv[1]) type = kv[1].trim();
      }
      if (!(count > 0)) return null;
      for (let n = 0; n < count; n++) {
        const idx = counters[name] || 0;
        counters[name] = idx + 1;
        const devices = [];
        for (let g = 0; g < preset[0]; g++) devices.push({ id: next++, type: type, local: g });
        nodes.push({ name: name + "-" + idx, type: type, devices: devices });
      }
    }
    return { source: "spec", name: spec, nodes: nodes };
  }

  /** Nodes of an inline cluster-file object (`node_groups`), or null where a group is unknown. */
  function layoutFromClusterFile(data) {
    if (!data || !Array.isArray(data.node_groups)) return null;
    const nodes = [];
    let next = 0;
    const counters = {};
    for (const group of data.node_groups) {
      let gpus = group.gpus_per_node;
      let type = typeof group.gpu === "string" ? group.gpu : (group.gpu && (group.gpu.name || group.gpu.base));
      let prefix = group.name;
      if (group.preset) {
        const preset = PRESETS[String(group.preset).toLowerCase()];
        if (!preset) return null;
        gpus = gpus || preset[0];
        type = type || preset[1];
        prefix = prefix || String(group.preset).toLowerCase();
      }
      if (!(gpus > 0)) return null;
      prefix = prefix || String(type || "node").toLowerCase();
      const count = group.nodes || 1;
      for (let n = 0; n < count; n++) {
        const idx = counters[prefix] || 0;
        counters[prefix] = idx + 1;
        const devices = [];
        for (let g = 0; g < gpus; g++) devices.push({ id: next++, type: type || "", local: g });
        nodes.push({ name: prefix + "-" + idx, type: type || "", devices: devices });
      }
    }
    return { source: "cluster file", name: data.name || "cluster", nodes: nodes };
  }

  /** Nodes of a cluster summary (`tagplan inspect cluster --json`: devices with `node`), or null. */
  function layoutFromSummary(cluster) {
    if (!cluster || !Array.isArray(cluster.devices) || !cluster.devices.length) return null;
    if (!cluster.devices.every((d) => isNum(d.index))) return null;
    const byIndex = new Map(cluster.devices.map((d) => [d.index, d]));
    const nodes = [];
    if (Array.isArray(cluster.nodes) && cluster.nodes.length &&
        cluster.nodes.every((n) => Array.isArray(n.devices))) {
      cluster.nodes.forEach((n, i) => nodes.push({
        name: n.name || "node " + i, type: n.type || "",
        devices: n.devices.map((id, k) => {
          const d = byIndex.get(id) || {};
          return { id: id, type: d.type || n.type || "", local: isNum(d.local) ? d.local : k, mem: d.mem_bytes };
        }),
      }));
    } else {
      const groups = new Map();
      cluster.devices.forEach((d) => {
        const key = isNum(d.node) ? d.node : 0;
        if (!groups.has(key)) groups.set(key, []);
        groups.get(key).push(d);
      });
      Array.from(groups.keys()).sort((a, b) => a - b).forEach((key) => {
        const devs = groups.get(key).sort((a, b) => a.index - b.index);
        nodes.push({ name: "node " + key, type: devs[0].type || "",
          devices: devs.map((d, k) => ({ id: d.index, type: d.type || "", local: isNum(d.local) ? d.local : k,
            mem: d.mem_bytes })) });
      });
    }
    return { source: "cluster", name: cluster.name || "cluster", nodes: nodes };
  }

  /** Devices grouped by the plan's stages, when nothing describes the cluster's nodes. */
  function layoutFromStages(result) {
    const best = result.best || {};
    const plan = planOf(best);
    const report = reportOf(best);
    const groups = new Map();
    (plan.stages || []).forEach((stage, s) => {
      const key = (stage.devices || []).join(",");
      if (!groups.has(key)) groups.set(key, { stages: [], devices: stage.devices || [] });
      groups.get(key).stages.push(s);
    });
    const types = new Map();
    (report.stages || []).forEach((sr, i) => { if (sr.memory && sr.memory.type) types.set(i, sr.memory.type); });
    const nodes = [];
    groups.forEach((g) => {
      const type = types.get(g.stages[0]) || "";
      nodes.push({
        name: (g.stages.length === 1 ? "stage " : "stages ") + g.stages.join(", ") + ": devices " + deviceRuns(g.devices),
        type: type,
        devices: g.devices.slice().sort((a, b) => a - b).map((id, k) => ({ id: id, type: type, local: k })),
      });
    });
    return { source: "stages", name: "devices by stage", nodes: nodes };
  }

  /** The best layout the result allows: its cluster, the request's cluster, or the plan's stages. */
  function clusterLayout(result) {
    const plan = planOf(result.best);
    const used = new Set((plan.stages || []).flatMap((s) => s.devices || []));
    const covers = (layout) => {
      if (!layout) return false;
      const ids = new Set(layout.nodes.flatMap((n) => n.devices.map((d) => d.id)));
      return Array.from(used).every((d) => ids.has(d));
    };
    const request = result.request || {};
    const candidates = [
      () => layoutFromSummary(result.cluster),
      () => layoutFromSummary(request.cluster),
      () => layoutFromClusterFile(request.cluster),
      () => layoutFromSpec(request.cluster),
    ];
    for (const make of candidates) {
      let layout = null;
      try { layout = make(); } catch (e) { layout = null; }
      if (covers(layout)) return layout;
    }
    return layoutFromStages(result);
  }

  // ---------------------------------------------------------------- best-plan summary (pure)

  const BREAKDOWN = [["compute", "compute", "#4e79a7"], ["tp_comm", "tensor-parallel comm", "#f28e2b"],
    ["dp_comm", "data-parallel sync", "#b07aa1"], ["pp_comm", "pipeline p2p", "#59a14f"],
    ["bubble", "pipeline bubble", "#bab0ac"], ["optimizer", "optimizer", "#76b7b2"]];

  function renderBreakdown(breakdown) {
    if (!breakdown) return "";
    const total = BREAKDOWN.reduce((acc, b) => acc + (isNum(breakdown[b[0]]) ? breakdown[b[0]] : 0), 0);
    if (!(total > 0)) return "";
    const W = 600, H = 22;
    let x = 0;
    let bars = "";
    let legend = "";
    BREAKDOWN.forEach((b) => {
      const v = isNum(breakdown[b[0]]) ? breakdown[b[0]] : 0;
      const w = (v / total) * W;
      const label = b[1] + ": " + fmtSeconds(v) + " (" + fmtPct(v / total) + ")";
      if (w > 0) {
        bars += '<rect class="breakdown-part" x="' + x.toFixed(2) + '" y="0" width="' + w.toFixed(2) +
          '" height="' + H + '" fill="' + b[2] + '"><title>' + esc(label) + "</title></rect>";
      }
      x += w;
      if (v > 0) legend += '<li><span class="swatch" style="background:' + b[2] + '"></span>' + esc(label) + "</li>";
    });
    return '<figure class="breakdown"><figcaption>Where the critical device\'s iteration goes</figcaption>' +
      '<svg viewBox="0 0 ' + W + " " + H + '" width="' + W + '" height="' + H + '" role="img" ' +
      'aria-label="iteration time breakdown" preserveAspectRatio="none">' + bars + "</svg>" +
      '<ul class="legend small">' + legend + "</ul></figure>";
  }

  function renderSummary(result) {
    const best = result.best || {};
    const plan = planOf(best);
    const r = reportOf(best);
    const worst = r.worst_device_memory || {};
    const rows = [
      ["Iteration time", fmtSeconds(r.iteration_time_s)],
      ["Throughput", fmtNum(r.throughput_samples_s, 2) + " samples/s" +
        (isNum(r.tokens_per_s) ? " · " + fmtNum(r.tokens_per_s, 0) + " tokens/s" : "")],
      ["Peak memory", fmtBytes(r.peak_memory_bytes) +
        (isNum(worst.mem_bytes) ? " of " + fmtBytes(worst.mem_bytes) +
          " (" + fmtPct(worst.memory_bytes / worst.mem_bytes) + ", device " + esc(worst.device) +
          (worst.type ? " " + esc(worst.type) : "") + ")" : "") +
        (r.fits === false ? ' <strong class="warn">does not fit</strong>' : "")],
    ];
    if (isNum(r.mfu)) rows.push(["MFU", fmtPct(r.mfu)]);
    if (isNum(r.tflops_per_device)) rows.push(["Model TFLOP/s per device", fmtNum(r.tflops_per_device, 1)]);
    rows.push(["Schedule", esc(plan.schedule || "–")]);
    rows.push(["Micro-batches", esc(plan.micro_batches || 1)]);
    rows.push(["Stages", esc((plan.stages || []).length) + " · " +
      esc((plan.stages || []).map(mesh).join(", ")) +
      ((plan.stages || []).some((s) => (s.cp || 1) > 1) ? " (dp×[cp×]tp)" : " (dp×tp)")]);
    rows.push(["Devices used", esc(isNum(r.devices_used) ? r.devices_used : (r.devices || []).length)]);
    if (best.source) rows.push(["Found by", esc(best.source)]);
    if (result.objective) rows.push(["Objective", esc(result.objective)]);
    const s = result.search;
    if (s) {
      rows.push(["Search", esc(fmtNum(s.evaluations, 0)) + " evaluations in " + fmtSeconds(s.wall_s) +
        (s.stopped_by ? " (stopped by " + esc(s.stopped_by) + ")" : "")]);
    }
    const dl = rows.map((row) => "<dt>" + esc(row[0]) + "</dt><dd>" + row[1] + "</dd>").join("");
    const notes = (result.notes || []).length
      ? '<ul class="notes">' + result.notes.map((n) => "<li>" + esc(n) + "</li>").join("") + "</ul>" : "";
    return '<section id="best-summary" data-testid="best-summary" class="card" aria-labelledby="best-summary-h">' +
      '<h3 id="best-summary-h">Chosen plan</h3><p class="plan-line">' + esc(describePlan(plan)) + "</p>" +
      '<dl class="kv">' + dl + "</dl>" + renderBreakdown(r.breakdown) + notes + "</section>";
  }

  // ---------------------------------------------------------------- baselines (pure)

  const BASELINE_LABEL = { data_parallel: "data parallel", megatron: "Megatron-LM (3D)",
    exhaustive: "exhaustive search" };

  function baselineLabel(name) {
    return BASELINE_LABEL[name] || String(name).replace(/_/g, " ");
  }

  /** The export formats that run a plan (its `exporters` verdicts: null where a format runs it), or why none does. */
  function runsUnder(exporters, fits) {
    if (!exporters) return { runs: "", cell: "–" };
    const formats = Object.keys(exporters);
    const runs = formats.filter((f) => exporters[f] === null);
    if (fits === false) return { runs: "", cell: "none: does not fit in memory" };
    if (runs.length) return { runs: runs.join(","), cell: runs.join(", ") };
    return { runs: "", cell: "none: " + formats.map((f) => truncate(String(exporters[f]), 160)).join("; ") };
  }

  function renderBaselines(result) {
    const best = result.best || {};
    const bt = reportOf(best).iteration_time_s;
    const baselines = result.baselines || {};
    const reasons = result.baseline_reasons || {};
    const names = Array.from(new Set(Object.keys(baselines).concat(Object.keys(reasons))));
    const rowOf = (label, cand, exporters, cls, extra) => {
      const r = reportOf(cand);
      const under = runsUnder(exporters, r.fits);
      return '<tr class="' + cls + '"' + extra + ' data-runs="' + esc(under.runs) + '"><th scope="row">' +
        esc(label) + "</th>" +
        '<td class="num">' + fmtSeconds(r.iteration_time_s) + "</td>" +
        '<td class="num">' + fmtBytes(r.peak_memory_bytes) + (r.fits === false ? ' <span class="warn">(does not fit)</span>' : "") + "</td>" +
        '<td class="runs">' + esc(under.cell) + "</td>";
    };
    let body = rowOf("chosen plan", best, result.exporters, "chosen", ' data-baseline="chosen"') +
      '<td class="num">1.00×</td><td>' + esc(describePlan(planOf(best))) + "</td></tr>";
    names.forEach((name) => {
      const cand = baselines[name];
      if (cand) {
        const t = reportOf(cand).iteration_time_s;
        const speedup = isNum(t) && isNum(bt) && bt > 0 ? t / bt : NaN;
        const cls = isNum(speedup) && speedup < 1 ? "slower" : "";
        body += rowOf(baselineLabel(name), cand, cand.exporters, "baseline", ' data-baseline="' + esc(name) + '"') +
          '<td class="num ' + cls + '">' + (isNum(speedup) ? speedup.toFixed(2) + "×" : "–") + "</td><td>" +
          esc(describePlan(planOf(cand))) + "</td></tr>";
      } else {
        body += '<tr class="baseline na" data-baseline="' + esc(name) + '"><th scope="row">' +
          esc(baselineLabel(name)) + '</th><td class="num">–</td><td class="num">–</td><td class="runs">–</td>' +
          '<td class="num">–</td><td class="reason">' + esc(reasons[name] || "does not apply") + "</td></tr>";
      }
    });
    return '<section id="baselines" data-testid="baselines" class="card" aria-labelledby="baselines-h">' +
      '<h3 id="baselines-h">Baselines</h3><div class="table-wrap"><table class="baselines">' +
      "<caption>Speedup: a baseline's iteration time over the chosen plan's. Runs under: the export formats " +
      "that run the plan, or why none does</caption>" +
      '<thead><tr><th scope="col">plan</th><th scope="col" class="num">iteration</th>' +
      '<th scope="col" class="num">peak memory</th><th scope="col">runs under</th>' +
      '<th scope="col" class="num">speedup</th>' +
      '<th scope="col">plan / reason</th></tr></thead><tbody>' + body + "</tbody></table></div></section>";
  }

  // ---------------------------------------------------------------- stage-to-device map (pure)

  /** Runs of consecutive cells in one row: [[pos...], ...] from sorted positions in a node. */
  function runs(positions, perRow) {
    const sorted = positions.slice().sort((a, b) => a - b);
    const out = [];
    sorted.forEach((p) => {
      const last = out.length ? out[out.length - 1] : null;
      if (last && p === last[last.length - 1] + 1 && Math.floor(p / perRow) === Math.floor(last[0] / perRow)) {
        last.push(p);
      } else {
        out.push([p]);
      }
    });
    return out;
  }

  function renderStageMap(result) {
    const best = result.best || {};
    const plan = planOf(best);
    const report = reportOf(best);
    const layout = clusterLayout(result);
    const roles = deviceRoles(plan);
    const memory = memoryByDevice(report);
    const stageMem = new Map((report.stages || []).map((sr, i) => [i, sr.memory || {}]));
    const total = layout.nodes.reduce((a, n) => a + n.devices.length, 0);
    const compact = total > 128;
    const CW = compact ? 30 : 66, CH = compact ? 28 : 58, GAP = compact ? 4 : 8;
    const PAD = 10, HEAD = compact ? 18 : 24, NODE_GAP = 12, MAX_W = 1000;
    const perRowMax = compact ? 16 : 8;

    // place nodes left to right, wrapping at MAX_W
    const placed = [];
    let x = 0, y = 0, rowH = 0, width = 0;
    layout.nodes.forEach((node) => {
      const n = Math.max(1, node.devices.length);
      const perRow = Math.min(perRowMax, n);
      const rows = Math.ceil(n / perRow);
      const w = PAD * 2 + perRow * CW + (perRow - 1) * GAP;
      const h = HEAD + PAD + rows * CH + (rows - 1) * GAP + PAD;
      if (x > 0 && x + w > MAX_W) { x = 0; y += rowH + NODE_GAP; rowH = 0; }
      placed.push({ node: node, x: x, y: y, w: w, h: h, perRow: perRow });
      x += w + NODE_GAP;
      rowH = Math.max(rowH, h);
      width = Math.max(width, x - NODE_GAP);
    });
    const height = y + rowH;
    const cell = new Map(); // device id -> {x, y, node index, pos}
    placed.forEach((p, ni) => {
      p.node.devices.forEach((d, k) => {
        const cx = p.x + PAD + (k % p.perRow) * (CW + GAP);
        const cy = p.y + HEAD + PAD + Math.floor(k / p.perRow) * (CH + GAP);
        cell.set(d.id, { x: cx, y: cy, node: ni, pos: k, dev: d });
      });
    });

    let svg = "";
    placed.forEach((p) => {
      const label = p.node.name + (p.node.type && p.node.name.indexOf(p.node.type) < 0 ? " · " + p.node.type : "");
      svg += '<g class="node"><rect class="node-box" x="' + p.x + '" y="' + p.y + '" width="' + p.w + '" height="' +
        p.h + '" rx="8"><title>' + esc(label + " (" + p.node.devices.length + " devices)") + "</title></rect>" +
        '<text class="node-label" x="' + (p.x + PAD) + '" y="' + (p.y + (compact ? 13 : 17)) + '">' +
        esc(truncate(label, Math.max(8, Math.floor((p.w - 2 * PAD) / (compact ? 6 : 7))))) + "</text></g>";
    });

    const stages = plan.stages || [];
    cell.forEach((c, id) => {
      const rs = roles.get(id) || [];
      const mem = memory.get(id);
      const cap = isNum(c.dev.mem) ? c.dev.mem
        : (rs.length && isNum((stageMem.get(rs[0].stage) || {}).mem_bytes) ? stageMem.get(rs[0].stage).mem_bytes : NaN);
      const lines = ["device " + id + (c.dev.type ? " (" + c.dev.type + ")" : "") +
        (layout.source !== "stages" ? ", " + layout.nodes[c.node].name + " #" + c.dev.local : "")];
      rs.forEach((role) => {
        const st = stages[role.stage];
        lines.push("stage " + role.stage + ": layers [" + st.layers[0] + ", " + st.layers[1] + "), replica " +
          (role.replica + 1) + " of " + (st.dp || 1) + ", tp rank " + role.rank + " of " + (st.tp || 1));
      });
      if (!rs.length) lines.push("not used by this plan");
      if (isNum(mem)) lines.push("peak memory " + fmtBytes(mem) + (isNum(cap) ? " of " + fmtBytes(cap) : ""));
      let fill = "";
      if (!rs.length) {
        fill = '<rect class="device idle" data-device="' + id + '" x="' + c.x + '" y="' + c.y + '" width="' + CW +
          '" height="' + CH + '" rx="4"></rect>';
      } else {
        const sliceW = CW / rs.length;
        rs.forEach((role, k) => {
          fill += '<rect class="device" data-device="' + id + '" data-stage="' + role.stage + '" x="' +
            (c.x + k * sliceW).toFixed(2) + '" y="' + c.y + '" width="' + sliceW.toFixed(2) + '" height="' + CH +
            '" rx="' + (rs.length > 1 ? 0 : 4) + '" fill="' + stageColor(role.stage) + '"></rect>';
        });
      }
      const ink = rs.length ? textOn(stageColor(rs[0].stage)) : "#555";
      let text = "";
      if (compact) {
        text = '<text class="device-id" x="' + (c.x + CW / 2) + '" y="' + (c.y + CH / 2 + 4) + '" fill="' + ink +
          '" text-anchor="middle">' + id + "</text>";
      } else {
        text = '<text class="device-id" x="' + (c.x + CW / 2) + '" y="' + (c.y + 18) + '" fill="' + ink +
          '" text-anchor="middle">#' + id + "</text>";
        let role = "idle";
        if (rs.length === 1) {
          const st = stages[rs[0].stage];
          role = "S" + rs[0].stage + ((st.dp || 1) > 1 ? " r" + rs[0].replica : "") + ((st.tp || 1) > 1 ? " t" + rs[0].rank : "");
        } else if (rs.length > 1) {
          role = "S" + rs.map((r) => r.stage).join(",");
        }
        text += '<text class="device-role" x="' + (c.x + CW / 2) + '" y="' + (c.y + 35) + '" fill="' + ink +
          '" text-anchor="middle">' + esc(truncate(role, 10)) + "</text>";
        if (isNum(mem) && isNum(cap) && cap > 0) {
          const frac = Math.max(0, Math.min(1, mem / cap));
          text += '<rect class="mem-track" x="' + (c.x + 6) + '" y="' + (c.y + CH - 12) + '" width="' + (CW - 12) +
            '" height="5" rx="2"></rect><rect class="mem-fill" x="' + (c.x + 6) + '" y="' + (c.y + CH - 12) +
            '" width="' + ((CW - 12) * frac).toFixed(2) + '" height="5" rx="2"></rect>';
        }
      }
      svg += '<g class="device-cell"' + (total <= 64 ? ' tabindex="0"' : "") + ' role="img" aria-label="' + esc(lines.join("; ")) + '"><title>' +
        esc(lines.join("\n")) + "</title>" + fill + text + "</g>";
    });

    // outlines: a stage's devices (its data-parallel group, dashed) and each tensor-parallel group
    const outline = (ids, inset, cls, title) => {
      const byNode = new Map();
      ids.forEach((id) => {
        const c = cell.get(id);
        if (!c) return;
        if (!byNode.has(c.node)) byNode.set(c.node, []);
        byNode.get(c.node).push(c.pos);
      });
      let out = "";
      byNode.forEach((positions, ni) => {
        const p = placed[ni];
        runs(positions, p.perRow).forEach((run) => {
          const first = cell.get(p.node.devices[run[0]].id);
          const w = run.length * CW + (run.length - 1) * GAP;
          out += '<rect class="' + cls + '" x="' + (first.x - inset) + '" y="' + (first.y - inset) + '" width="' +
            (w + 2 * inset) + '" height="' + (CH + 2 * inset) + '" rx="' + (4 + inset) + '"><title>' + esc(title) +
            "</title></rect>";
        });
      });
      return out;
    };
    let outlines = "";
    const seen = new Set();
    stages.forEach((st, s) => {
      const key = (st.devices || []).join(",");
      if ((st.dp || 1) > 1 && !seen.has(key)) {
        outlines += outline(st.devices, compact ? 2 : 4, "dp-group", "stage " + s + ": data-parallel group of " + st.dp +
          " replicas");
      }
      seen.add(key);
      if ((st.tp || 1) > 1) {
        const cp = st.cp || 1;
        for (let g = 0; g < (st.dp || 1) * cp; g++) {  // one per replica and context-parallel rank
          const where = "replica " + Math.floor(g / cp) + (cp > 1 ? ", cp rank " + (g % cp) : "");
          outlines += outline(st.devices.slice(g * st.tp, (g + 1) * st.tp), compact ? 1 : 2, "tp-group",
            "stage " + s + ", " + where + ": tensor-parallel group of " + st.tp);
        }
      }
    });

    const legend = stages.map((st, s) => '<li data-stage="' + s + '" data-devices="' + esc(deviceRuns(st.devices || [])) +
      '"><span class="swatch" style="background:' +
      stageColor(s) + '"></span><strong>Stage ' + s + "</strong> · layers [" + esc(st.layers[0]) + ", " +
      esc(st.layers[1]) + ") · " + esc(stageShape(st)) + " · devices " + esc(deviceRuns(st.devices || [])) +
      "</li>").join("");
    const note = layout.source === "stages"
      ? '<p class="hint">The result does not describe the cluster\'s nodes: devices are grouped by stage.</p>'
      : layout.source === "spec" ? '<p class="hint">Node layout derived from the cluster SPEC.</p>' : "";
    const W = Math.max(width, 200), H = Math.max(height, 40);
    return '<section id="stage-map" data-testid="stage-map" class="card" aria-labelledby="stage-map-h">' +
      '<h3 id="stage-map-h">Stage-to-device map</h3>' + note +
      '<figure><svg class="stage-map" viewBox="0 0 ' + W + " " + H + '" width="' + W + '" height="' + H +
      '" role="group" aria-label="' + esc("devices of " + layout.name + " by node, coloured by pipeline stage") + '">' +
      svg + outlines + "</svg>" +
      '<figcaption><ul class="legend stage-legend" data-testid="stage-legend">' + legend + "</ul>" +
      '<p class="hint small">Device labels: S<i>n</i> stage, r<i>n</i> data-parallel replica, t<i>n</i> ' +
      'tensor-parallel rank; the bar: peak memory of the device over its capacity. <span class="key-tp">Solid outline</span>: a tensor-parallel group; <span class="key-dp">' +
      "dashed outline</span>: a stage's data-parallel replicas.</p></figcaption></figure></section>";
  }

  // ---------------------------------------------------------------- timeline (pure)

  const CAT_COLOR = { forward: "#4e79a7", backward: "#f28e2b", dp_comm: "#b07aa1", optimizer: "#76b7b2",
    tp_comm: "#e15759", pp_comm: "#59a14f" };
  const CAT_LABEL = { forward: "forward", backward: "backward", dp_comm: "data-parallel sync",
    optimizer: "optimizer step", tp_comm: "tensor-parallel comm", pp_comm: "pipeline p2p" };

  function catColor(cat) {
    return CAT_COLOR[cat] || "#9c9c9c";
  }

  function renderTimeline(trace) {
    const events = Array.isArray(trace) ? trace : (trace && Array.isArray(trace.traceEvents) ? trace.traceEvents : []);
    const procNames = new Map(), threadNames = new Map();
    const rows = new Map();
    events.forEach((e) => {
      if (!e || typeof e !== "object") return;
      if (e.ph === "M" && e.name === "process_name") procNames.set(String(e.pid), (e.args || {}).name);
      else if (e.ph === "M" && e.name === "thread_name") threadNames.set(e.pid + ":" + e.tid, (e.args || {}).name);
      else if (e.ph === "X" && isNum(e.ts)) {
        const key = e.pid + ":" + (e.tid === undefined ? 0 : e.tid);
        if (!rows.has(key)) rows.set(key, { pid: e.pid, tid: e.tid === undefined ? 0 : e.tid, events: [] });
        rows.get(key).events.push(e);
      }
    });
    const head = '<section id="timeline" data-testid="timeline" class="card" aria-labelledby="timeline-h">' +
      '<h3 id="timeline-h">Timeline of one iteration</h3>';
    if (!rows.size) return head + '<p class="hint">No timeline in the result.</p></section>';
    const order = (a, b) => {
      const na = Number(a), nb = Number(b);
      return isNum(na) && isNum(nb) ? na - nb : String(a).localeCompare(String(b));
    };
    const list = Array.from(rows.values()).sort((a, b) => order(a.pid, b.pid) || order(a.tid, b.tid));
    let t0 = Infinity, t1 = -Infinity;
    list.forEach((row) => row.events.forEach((e) => {
      t0 = Math.min(t0, e.ts);
      t1 = Math.max(t1, e.ts + (isNum(e.dur) ? e.dur : 0));
    }));
    if (!(t1 > t0)) t1 = t0 + 1;
    const useS = (t1 - t0) / 1e3 > 10000; // more than 10 s: axis in seconds
    const unit = useS ? 1e6 : 1e3;
    const L = 220, R = 16, TOP = 28, ROW = 22, W = 1000;
    const plotW = W - L - R;
    const sx = (ts) => L + ((ts - t0) / (t1 - t0)) * plotW;
    const H = TOP + list.length * ROW + 8;
    let svg = "";
    // row backgrounds and labels
    let lastPid = null, band = 0;
    list.forEach((row, i) => {
      if (row.pid !== lastPid) { band++; lastPid = row.pid; }
      const y = TOP + i * ROW;
      const proc = procNames.get(String(row.pid)) || "process " + row.pid;
      const thread = threadNames.get(row.pid + ":" + row.tid) || "thread " + row.tid;
      const label = proc + " · " + thread;
      svg += '<rect class="row-bg' + (band % 2 ? " alt" : "") + '" x="0" y="' + y + '" width="' + W + '" height="' +
        ROW + '"></rect><text class="row-label" x="6" y="' + (y + 15) + '"><title>' + esc(label) + "</title>" +
        esc(truncate(label, 32)) + "</text>";
    });
    // axis and grid
    const ticks = niceTicks(0, (t1 - t0) / unit, 8);
    ticks.forEach((t) => {
      const x = sx(t0 + t * unit);
      svg += '<line class="grid" x1="' + x.toFixed(2) + '" x2="' + x.toFixed(2) + '" y1="' + (TOP - 4) + '" y2="' +
        (H - 8) + '"></line><text class="tick" x="' + x.toFixed(2) + '" y="' + (TOP - 9) +
        '" text-anchor="middle">' + esc(tickLabel(t, ticks)) + "</text>";
    });
    svg += '<text class="axis-label" x="' + (L - 20) + '" y="' + (TOP - 9) + '" text-anchor="end">' +
      (useS ? "time (s)" : "time (ms)") + "</text>";
    // bars
    const cats = new Set();
    list.forEach((row, i) => {
      const y = TOP + i * ROW + 3;
      row.events.forEach((e) => {
        const dur = isNum(e.dur) ? e.dur : 0;
        const x = sx(e.ts);
        const w = Math.max(0.75, (dur / (t1 - t0)) * plotW);
        const cat = e.cat || "other";
        cats.add(cat);
        const args = e.args || {};
        const extra = Object.keys(args).map((k) => k + " " + args[k]).join(", ");
        const title = (e.name || cat) + " — " + fmtSeconds(dur / 1e6) + " (" + (CAT_LABEL[cat] || cat) + ")" +
          "\nfrom " + fmtSeconds((e.ts - t0) / 1e6) + " to " + fmtSeconds((e.ts + dur - t0) / 1e6) +
          (extra ? "\n" + extra : "");
        svg += '<g class="event"><title>' + esc(title) + '</title><rect class="bar cat-' + esc(cat) + '" x="' +
          x.toFixed(2) + '" y="' + y + '" width="' + w.toFixed(2) + '" height="' + (ROW - 6) + '" fill="' +
          catColor(cat) + '"></rect>';
        if (w > 7 * String(e.name || "").length + 6) {
          svg += '<text class="bar-label" x="' + (x + w / 2).toFixed(2) + '" y="' + (y + 12) + '" fill="' +
            textOn(catColor(cat)) + '" text-anchor="middle">' + esc(e.name || "") + "</text>";
        }
        svg += "</g>";
      });
    });
    const legend = Array.from(cats).map((c) => '<li><span class="swatch" style="background:' + catColor(c) +
      '"></span>' + esc(CAT_LABEL[c] || c) + "</li>").join("");
    const total = fmtSeconds((t1 - t0) / 1e6);
    return head + '<figure><svg class="timeline" viewBox="0 0 ' + W + " " + H + '" width="' + W + '" height="' + H +
      '" role="img" aria-label="' + esc("Gantt chart of " + list.length + " tracks over " + total) + '">' + svg +
      "</svg><figcaption><ul class=\"legend\">" + legend + "</ul><p class=\"hint small\">" + esc(list.length) +
      " tracks, " + esc(total) + " end to end. Hover a bar for its name and duration.</p></figcaption></figure></section>";
  }

  // ---------------------------------------------------------------- Pareto chart (pure)

  const MARKERS = { data_parallel: "square", megatron: "triangle", exhaustive: "diamond" };

  function markerPath(shape, x, y, r) {
    const f = (v) => v.toFixed(2);
    if (shape === "square") return "M" + f(x - r) + " " + f(y - r) + "h" + f(2 * r) + "v" + f(2 * r) + "h" + f(-2 * r) + "Z";
    if (shape === "triangle") return "M" + f(x) + " " + f(y - r * 1.2) + "L" + f(x + r * 1.1) + " " + f(y + r * 0.8) +
      "L" + f(x - r * 1.1) + " " + f(y + r * 0.8) + "Z";
    if (shape === "diamond") return "M" + f(x) + " " + f(y - r * 1.3) + "L" + f(x + r * 1.1) + " " + f(y) + "L" + f(x) +
      " " + f(y + r * 1.3) + "L" + f(x - r * 1.1) + " " + f(y) + "Z";
    if (shape === "star") {
      let d = "";
      for (let i = 0; i < 10; i++) {
        const a = -Math.PI / 2 + (i * Math.PI) / 5;
        const rr = i % 2 ? r * 0.45 : r;
        d += (i ? "L" : "M") + f(x + rr * Math.cos(a)) + " " + f(y + rr * Math.sin(a));
      }
      return d + "Z";
    }
    // cross
    const k = r * 0.35;
    return "M" + f(x - r) + " " + f(y - k) + "H" + f(x - k) + "V" + f(y - r) + "H" + f(x + k) + "V" + f(y - k) + "H" +
      f(x + r) + "V" + f(y + k) + "H" + f(x + k) + "V" + f(y + r) + "H" + f(x - k) + "V" + f(y + k) + "H" + f(x - r) + "Z";
  }

  function renderPareto(result) {
    const pareto = (result.pareto || []).filter((c) => c && c.report);
    const baselines = result.baselines || {};
    const best = result.best;
    const points = [];
    pareto.forEach((c, i) => points.push({ c: c, kind: "pareto", name: c.source || "search", i: i }));
    Object.keys(baselines).forEach((name) => {
      if (baselines[name] && baselines[name].report) points.push({ c: baselines[name], kind: "baseline", name: name });
    });
    if (best && best.report) points.push({ c: best, kind: "best", name: "chosen plan" });
    const head = '<section id="pareto" data-testid="pareto" class="card" aria-labelledby="pareto-h">' +
      '<h3 id="pareto-h">Pareto frontier: time vs memory</h3>';
    const valid = points.filter((p) => isNum(p.c.report.iteration_time_s) && isNum(p.c.report.peak_memory_bytes));
    if (!valid.length) return head + '<p class="hint">No candidates to draw.</p></section>';
    const xs = valid.map((p) => p.c.report.iteration_time_s);
    const ys = valid.map((p) => p.c.report.peak_memory_bytes);
    const useS = Math.max.apply(null, xs) > 10;
    const xu = useS ? 1 : 1e3, yu = 1e9;
    const range = (vals, u) => {
      let lo = Math.min.apply(null, vals) * u, hi = Math.max.apply(null, vals) * u;
      if (hi - lo < 1e-12) { const pad = Math.abs(hi) * 0.1 || 1; lo -= pad; hi += pad; }
      const pad = (hi - lo) * 0.08;
      return [Math.max(0, lo - pad), hi + pad];
    };
    const [x0, x1] = range(xs, xu);
    const [y0, y1] = range(ys, 1 / yu);
    const W = 760, H = 420, L = 72, R = 20, T = 18, B = 52;
    const px = (v) => L + ((v * xu - x0) / (x1 - x0)) * (W - L - R);
    const py = (v) => H - B - ((v / yu - y0) / (y1 - y0)) * (H - T - B);
    let svg = '<rect class="plot-bg" x="' + L + '" y="' + T + '" width="' + (W - L - R) + '" height="' + (H - T - B) + '"></rect>';
    const xticks = niceTicks(x0, x1, 7);
    xticks.forEach((t) => {
      const x = L + ((t - x0) / (x1 - x0)) * (W - L - R);
      if (x < L - 0.5 || x > W - R + 0.5) return;
      svg += '<line class="grid" x1="' + x.toFixed(2) + '" x2="' + x.toFixed(2) + '" y1="' + T + '" y2="' + (H - B) +
        '"></line><text class="tick" x="' + x.toFixed(2) + '" y="' + (H - B + 16) + '" text-anchor="middle">' +
        esc(tickLabel(t, xticks)) + "</text>";
    });
    const yticks = niceTicks(y0, y1, 6);
    yticks.forEach((t) => {
      const y = H - B - ((t - y0) / (y1 - y0)) * (H - T - B);
      if (y < T - 0.5 || y > H - B + 0.5) return;
      svg += '<line class="grid" x1="' + L + '" x2="' + (W - R) + '" y1="' + y.toFixed(2) + '" y2="' + y.toFixed(2) +
        '"></line><text class="tick" x="' + (L - 6) + '" y="' + (y + 4).toFixed(2) + '" text-anchor="end">' +
        esc(tickLabel(t, yticks)) + "</text>";
    });
    svg += '<line class="axis" x1="' + L + '" x2="' + (W - R) + '" y1="' + (H - B) + '" y2="' + (H - B) + '"></line>' +
      '<line class="axis" x1="' + L + '" x2="' + L + '" y1="' + T + '" y2="' + (H - B) + '"></line>' +
      '<text class="axis-label" x="' + ((L + W - R) / 2) + '" y="' + (H - 12) + '" text-anchor="middle">iteration time (' +
      (useS ? "s" : "ms") + ")</text>" +
      '<text class="axis-label" transform="translate(18 ' + ((T + H - B) / 2) + ') rotate(-90)" text-anchor="middle">' +
      "peak memory per device (GB)</text>";
    // frontier as a step line through the Pareto candidates
    const front = valid.filter((p) => p.kind === "pareto").map((p) => [px(p.c.report.iteration_time_s), py(p.c.report.peak_memory_bytes)])
      .sort((a, b) => a[0] - b[0]);
    if (front.length > 1) {
      let d = "M" + front[0][0].toFixed(2) + " " + front[0][1].toFixed(2);
      for (let i = 1; i < front.length; i++) d += "H" + front[i][0].toFixed(2) + "V" + front[i][1].toFixed(2);
      svg += '<path class="frontier" d="' + d + '"></path>';
    }
    const describe = (p) => {
      const r = p.c.report;
      return (p.kind === "best" ? "chosen plan" : p.kind === "baseline" ? "baseline " + baselineLabel(p.name)
        : "Pareto candidate (" + p.name + ")") + ": " + fmtSeconds(r.iteration_time_s) + ", " +
        fmtBytes(r.peak_memory_bytes) + (r.fits === false ? ", does not fit" : "") + "\n" + describePlan(planOf(p.c));
    };
    const order = { pareto: 0, baseline: 1, best: 2 };
    valid.sort((a, b) => order[a.kind] - order[b.kind]).forEach((p) => {
      const x = px(p.c.report.iteration_time_s), y = py(p.c.report.peak_memory_bytes);
      const hollow = p.c.report.fits === false ? " hollow" : "";
      let shape;
      if (p.kind === "best") {
        svg += '<g class="point best" data-kind="best"><title>' + esc(describe(p)) + '</title><circle class="halo" cx="' +
          x.toFixed(2) + '" cy="' + y.toFixed(2) + '" r="13"></circle><path class="marker" d="' +
          markerPath("star", x, y, 10) + '"></path></g>';
        return;
      }
      if (p.kind === "baseline") {
        shape = MARKERS[p.name] || "cross";
        svg += '<g class="point baseline' + hollow + '" data-kind="baseline" data-name="' + esc(p.name) + '"><title>' +
          esc(describe(p)) + '</title><path class="marker" d="' + markerPath(shape, x, y, 7) + '"></path></g>';
      } else if (p.name !== "search" && MARKERS[p.name]) {
        // a baseline that is itself on the frontier: drawn as that baseline
        svg += '<g class="point pareto baseline' + hollow + '" data-kind="pareto" data-name="' + esc(p.name) + '"><title>' +
          esc(describe(p)) + '</title><path class="marker" d="' + markerPath(MARKERS[p.name], x, y, 7) + '"></path></g>';
      } else {
        svg += '<g class="point pareto' + hollow + '" data-kind="pareto"><title>' + esc(describe(p)) +
          '</title><circle class="marker" cx="' + x.toFixed(2) + '" cy="' + y.toFixed(2) + '" r="6"></circle></g>';
      }
    });
    const legendItems = ['<li><svg class="legend-marker" viewBox="-8 -8 16 16" width="16" height="16" aria-hidden="true">' +
      '<circle class="pareto-marker" r="6"></circle></svg>Pareto candidate</li>',
    '<li><svg class="legend-marker" viewBox="-12 -12 24 24" width="18" height="18" aria-hidden="true"><path class="best-marker" d="' +
      markerPath("star", 0, 0, 10) + '"></path></svg>chosen plan</li>'];
    const baseNames = Array.from(new Set(valid.filter((p) => p.kind === "baseline" ||
      (p.kind === "pareto" && MARKERS[p.name])).map((p) => p.name)));
    baseNames.forEach((name) => legendItems.push('<li><svg class="legend-marker" viewBox="-9 -9 18 18" width="16" height="16" ' +
      'aria-hidden="true"><path class="baseline-marker" d="' + markerPath(MARKERS[name] || "cross", 0, 0, 7) +
      '"></path></svg>' + esc(baselineLabel(name)) + "</li>"));
    if (valid.some((p) => p.c.report.fits === false)) legendItems.push("<li>hollow: does not fit in memory</li>");
    return head + '<figure><svg class="pareto" viewBox="0 0 ' + W + " " + H + '" width="' + W + '" height="' + H +
      '" role="img" aria-label="' + esc("scatter of " + pareto.length + " Pareto candidates and the baselines: " +
      "iteration time against peak memory") + '">' + svg + "</svg><figcaption><ul class=\"legend\">" +
      legendItems.join("") + "</ul></figcaption></figure></section>";
  }

  // ---------------------------------------------------------------- pages (pure)

  function renderResult(result) {
    if (!result || !result.best) {
      return '<section class="card"><h3>Result</h3><pre class="json">' + esc(JSON.stringify(result, null, 2)) +
        "</pre></section>";
    }
    return '<div class="result">' +
      '<div class="grid-2">' + renderSummary(result) + renderBaselines(result) + "</div>" +
      renderStageMap(result) + renderTimeline(result.timeline) + renderPareto(result) + "</div>";
  }

  function requestLine(request) {
    if (!request || typeof request !== "object") return "";
    const bits = [];
    if (request.model !== undefined) bits.push("model " + (typeof request.model === "string" ? request.model : "(inline graph)"));
    if (request.cluster !== undefined) bits.push("cluster " + (typeof request.cluster === "string" ? request.cluster : "(inline)"));
    const w = request.workload || {};
    if (w.global_batch) bits.push("global batch " + w.global_batch);
    if (w.seq_len) bits.push("sequence " + w.seq_len);
    if (request.max_evaluations) bits.push("≤ " + request.max_evaluations + " evaluations");
    return bits.join(" · ");
  }

  function progressCell(job) {
    const p = isNum(job.progress) ? Math.max(0, Math.min(1, job.progress)) : 0;
    return '<progress max="1" value="' + p.toFixed(3) + '" aria-label="progress">' + fmtPct(p) + "</progress> " +
      '<span class="small">' + fmtPct(p) + "</span>";
  }

  /** "–" for a missing list field (an older service, a training job). */
  function cell(value) {
    return value === null || value === undefined || value === "" ? "–" : String(value);
  }

  function renderJobsTable(data) {
    const jobs = (data && data.jobs) || [];
    if (!jobs.length) return '<p class="hint" data-testid="jobs-empty">No jobs yet. Submit a plan above.</p>';
    const rows = jobs.map((j) => '<tr data-job="' + esc(j.id) + '"><td><a href="#/jobs/' + encodeURIComponent(j.id) +
      '"><code>' + esc(String(j.id).slice(0, 12)) + "</code></a></td><td>" + esc(j.kind) + "</td><td>" +
      statusBadge(j.status) + '</td><td class="model"><code title="' + esc(cell(j.model)) + '">' +
      esc(truncate(cell(j.model), 40)) + '</code></td><td class="cluster"><code title="' + esc(cell(j.cluster)) + '">' +
      esc(truncate(cell(j.cluster), 32)) + '</code></td><td class="objective">' + esc(cell(j.objective)) +
      '</td><td class="iteration num">' + (isNum(j.iteration_time_s) ? esc(fmtSeconds(j.iteration_time_s)) : "–") +
      "</td><td>" + progressCell(j) + '</td><td class="msg">' +
      esc(j.error || j.message || "") + "</td><td>" + esc(fmtDate(j.created_at)) + "</td><td>" +
      esc(j.finished_at ? fmtDate(j.finished_at) : (isNum(j.eta_s) ? "eta " + fmtSeconds(j.eta_s) : "–")) +
      "</td></tr>").join("");
    const total = isNum(data.total) ? data.total : jobs.length;
    const offset = data.offset || 0;
    return '<div class="table-wrap"><table class="jobs" data-testid="jobs"><thead><tr><th scope="col">job</th>' +
      '<th scope="col">kind</th><th scope="col">status</th><th scope="col">model</th><th scope="col">cluster</th>' +
      '<th scope="col">objective</th><th scope="col" title="predicted iteration time of the chosen plan">iteration</th>' +
      '<th scope="col">progress</th><th scope="col">message</th>' +
      '<th scope="col">created</th><th scope="col">finished / eta</th></tr></thead><tbody>' + rows +
      '</tbody></table></div><p class="small">Jobs ' + (offset + 1) + "–" + (offset + jobs.length) + " of " +
      total + "</p>";
  }

  function renderJobHeader(job) {
    const running = job.status === "queued" || job.status === "running";
    return '<section class="card job-head" aria-labelledby="job-h" data-testid="job-status">' +
      '<h2 id="job-h">Job <code>' + esc(job.id) + "</code> " + statusBadge(job.status) + "</h2>" +
      '<dl class="kv"><dt>Kind</dt><dd>' + esc(job.kind) + "</dd><dt>Progress</dt><dd>" + progressCell(job) +
      (job.message ? " " + esc(job.message) : "") + "</dd>" +
      (job.error ? '<dt>Error</dt><dd class="error">' + esc(job.error) + "</dd>" : "") +
      "<dt>Created</dt><dd>" + esc(fmtDate(job.created_at)) + "</dd>" +
      (job.started_at ? "<dt>Started</dt><dd>" + esc(fmtDate(job.started_at)) + "</dd>" : "") +
      (job.finished_at ? "<dt>Finished</dt><dd>" + esc(fmtDate(job.finished_at)) + "</dd>" : "") +
      (running && isNum(job.eta_s) ? "<dt>ETA</dt><dd>" + fmtSeconds(job.eta_s) + "</dd>" : "") +
      "<dt>Attempts</dt><dd>" + esc(isNum(job.attempts) ? job.attempts : "–") + "</dd></dl>" +
      (running ? '<button type="button" class="secondary" data-action="cancel">Cancel job</button>' : "") +
      "</section>";
  }

  /** FastAPI's `detail` (a string, or a list of validation errors) as one line. */
  function formatDetail(body, status) {
    if (body && typeof body === "object" && body.detail !== undefined) {
      const d = body.detail;
      if (typeof d === "string") return d;
      if (Array.isArray(d)) {
        return d.map((e) => (e && e.loc ? e.loc.join(".") + ": " : "") + (e && e.msg ? e.msg : JSON.stringify(e))).join("; ");
      }
      return JSON.stringify(d);
    }
    if (typeof body === "string" && body) return "HTTP " + status + ": " + truncate(body, 200);
    return "HTTP " + status;
  }

  /** The body of `POST /v1/plans` from the form's values (strings). */
  function planRequest(values) {
    const body = { model: String(values.model || "").trim(), cluster: String(values.cluster || "").trim() };
    const workload = {};
    const int = (v) => {
      const n = parseInt(String(v || "").trim(), 10);
      return isNum(n) && n > 0 ? n : null;
    };
    if (int(values.global_batch)) workload.global_batch = int(values.global_batch);
    if (int(values.seq_len)) workload.seq_len = int(values.seq_len);
    if (Object.keys(workload).length) body.workload = workload;
    if (int(values.max_evaluations)) body.max_evaluations = int(values.max_evaluations);
    return body;
  }

  /** Complete server-sent events at the front of `text`: {events: [{event, data}], rest} where `rest` is
   * the unfinished tail to prepend to the next chunk. Comments (`: ping`) and empty blocks are skipped. */
  function parseSse(text) {
    const blocks = String(text).replace(/\r\n?/g, "\n").split("\n\n");
    const rest = blocks.pop();
    const events = [];
    blocks.forEach((block) => {
      let event = "message";
      const data = [];
      block.split("\n").forEach((line) => {
        if (!line || line[0] === ":") return;
        const i = line.indexOf(":");
        const field = i < 0 ? line : line.slice(0, i);
        let value = i < 0 ? "" : line.slice(i + 1);
        if (value[0] === " ") value = value.slice(1);
        if (field === "event") event = value;
        else if (field === "data") data.push(value);
      });
      if (data.length) events.push({ event: event, data: data.join("\n") });
    });
    return { events: events, rest: rest };
  }

  /** `#/jobs/abc?x=1` -> {page: "job", id: "abc"}; anything else -> {page: "jobs"}. */
  function parseRoute(hash) {
    const path = String(hash || "").replace(/^#/, "").split("?")[0];
    const m = /^\/?jobs\/([^/]+)\/?$/.exec(path);
    if (m) return { page: "job", id: decodeURIComponent(m[1]) };
    return { page: "jobs" };
  }

  const pure = {
    esc, fmtSeconds, fmtBytes, fmtNum, fmtPct, fmtRanges, deviceRuns, niceTicks, stageColor, textOn, describePlan,
    deviceRoles, layoutFromSpec, layoutFromClusterFile, layoutFromSummary, layoutFromStages, clusterLayout,
    renderSummary, renderBaselines, renderStageMap, renderTimeline, renderPareto, renderResult,
    renderJobsTable, renderJobHeader, formatDetail, planRequest, parseRoute, requestLine, parseSse,
  };

  if (typeof module !== "undefined" && module.exports) module.exports = pure;
  if (typeof document === "undefined") return;

  // ================================================================ browser glue

  const KEY_NAME = "tagplan.apiKey";
  let memoryKey = "";
  const POLL_MS = 2000;

  function getKey() {
    try { return root.localStorage.getItem(KEY_NAME) || memoryKey; } catch (e) { return memoryKey; }
  }

  function setKey(key) {
    memoryKey = key || "";
    try {
      if (key) root.localStorage.setItem(KEY_NAME, key);
      else root.localStorage.removeItem(KEY_NAME);
    } catch (e) { /* storage disabled: keep it for this page only */ }
  }

  /** Take `?key=` (or `#/...?key=`) once into storage and drop it from the address bar. */
  function takeKeyFromUrl() {
    let url;
    try { url = new URL(root.location.href); } catch (e) { return; }
    let key = url.searchParams.get("key");
    if (key !== null) url.searchParams.delete("key");
    const hash = url.hash || "";
    const q = hash.indexOf("?");
    if (q >= 0) {
      const params = new URLSearchParams(hash.slice(q + 1));
      if (params.get("key") !== null) {
        key = key || params.get("key");
        params.delete("key");
        const rest = params.toString();
        url.hash = hash.slice(0, q) + (rest ? "?" + rest : "");
      }
    }
    if (key) {
      setKey(key);
      try { root.history.replaceState(null, "", url.pathname + url.search + url.hash); } catch (e) { /* ignore */ }
    }
  }

  async function api(path, options) {
    const opts = Object.assign({}, options || {});
    const headers = Object.assign({ Accept: "application/json" }, opts.headers || {});
    const key = getKey();
    if (key) headers.Authorization = "Bearer " + key;
    opts.headers = headers;
    const resp = await fetch(path, opts);
    const text = await resp.text();
    let body = null;
    try { body = text ? JSON.parse(text) : null; } catch (e) { body = text; }
    if (!resp.ok) {
      const err = new Error(formatDetail(body, resp.status));
      err.status = resp.status;
      throw err;
    }
    return body;
  }

  const $ = (sel, el) => (el || document).querySelector(sel);
  let generation = 0; // bumps on every navigation; stale async work checks it and stops
  let timer = null;
  let stream = null; // the AbortController of the job page's event stream

  function schedule(fn) {
    if (timer) clearTimeout(timer);
    timer = setTimeout(fn, POLL_MS);
  }

  /** Stop the polling timer and the event stream (on every navigation). */
  function stopPolling() {
    if (timer) clearTimeout(timer);
    timer = null;
    if (stream) stream.abort();
    stream = null;
  }

  /** Follow `GET /v1/jobs/{id}/events` with fetch and a stream reader (it sends the key as a header,
   * which EventSource cannot), calling `onJob(job)` for every `progress` and the `done` event.
   * Resolves true once the job finished (or the page moved on), false when the stream could not be
   * used or broke off early: the caller then polls. */
  async function streamJob(id, gen, onJob) {
    if (!root.fetch || !root.TextDecoder || !root.AbortController) return false;
    const ctl = new AbortController();
    if (stream) stream.abort();
    stream = ctl;
    try {
      const headers = { Accept: "text/event-stream" };
      const key = getKey();
      if (key) headers.Authorization = "Bearer " + key;
      const resp = await fetch("/v1/jobs/" + encodeURIComponent(id) + "/events",
        { headers: headers, signal: ctl.signal, cache: "no-store" });
      if (!resp.ok || !resp.body || !resp.body.getReader) return false;
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        if (gen !== generation) return true;
        const chunk = await reader.read();
        if (chunk.done) return false; // closed without `done`: poll for the rest
        buffer += decoder.decode(chunk.value, { stream: true });
        const parsed = parseSse(buffer);
        buffer = parsed.rest;
        for (const ev of parsed.events) {
          if (gen !== generation) return true;
          if (ev.event !== "progress" && ev.event !== "done") continue;
          let job;
          try { job = JSON.parse(ev.data); } catch (e) { continue; }
          if (!job || !job.status || job.status === "unknown") return false;
          await onJob(job);
          if (ev.event === "done") return true;
        }
      }
    } catch (err) {
      return gen !== generation || ctl.signal.aborted;
    } finally {
      if (stream === ctl) stream = null;
      ctl.abort(); // the server's side of a finished or abandoned stream ends too
    }
  }

  /** Save `data` as pretty JSON under `filename`. */
  function downloadJson(data, filename) {
    const blob = new Blob([JSON.stringify(data, null, 2)], { type: "application/json" });
    const a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    a.download = filename;
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  }

  function flash(message, kind) {
    const el = $("#flash");
    if (!el) return;
    el.textContent = message || "";
    el.className = "flash" + (message ? " " + (kind || "info") : "");
  }

  function handleError(err, where) {
    if (err && err.status === 401) {
      flash("The API key was not accepted. Enter a valid key above.", "error");
      const input = $("#api-key");
      if (input) input.focus();
    } else {
      flash((where ? where + ": " : "") + (err && err.message ? err.message : String(err)), "error");
    }
  }

  function needKey(main) {
    main.innerHTML = '<section class="card" data-testid="need-key"><h2>API key needed</h2><p>Enter your API key ' +
      "above (an administrator creates one with <code>tagplan admin create-key --tenant NAME</code>). It is kept in " +
      "this browser's local storage only.</p></section>";
    const input = $("#api-key");
    if (input) input.focus();
  }

  // ---------------------------------------------------------------- jobs page

  let listOffset = 0;
  const LIST_LIMIT = 50;

  function jobsPage(main, gen) {
    main.innerHTML =
      '<section class="card" aria-labelledby="submit-h"><h2 id="submit-h">Plan a model on a cluster</h2>' +
      '<form id="submit-form" class="submit-form" data-testid="submit-form">' +
      '<label>Model SPEC<input name="model" required placeholder="gpt3-1.3b" autocomplete="off"></label>' +
      '<label>Cluster SPEC<input name="cluster" required placeholder="p3.8xlarge:nodes=2" autocomplete="off"></label>' +
      '<label>Global batch<input name="global_batch" type="number" min="1" step="1" placeholder="8"></label>' +
      '<label>Sequence length<input name="seq_len" type="number" min="1" step="1" placeholder="2048"></label>' +
      '<label>Max evaluations<input name="max_evaluations" type="number" min="1" step="1" placeholder="500"></label>' +
      '<button type="submit">Submit</button></form><p id="submit-status" class="small" role="status"></p></section>' +
      '<section class="card" aria-labelledby="jobs-h"><div class="row"><h2 id="jobs-h">Jobs</h2>' +
      '<span class="spacer"></span><button type="button" class="secondary" id="jobs-newer">Newer</button>' +
      '<button type="button" class="secondary" id="jobs-older">Older</button>' +
      '<button type="button" class="secondary" id="jobs-refresh">Refresh</button></div>' +
      '<div id="jobs-list" aria-live="polite"><p class="hint">Loading…</p></div></section>';
    const form = $("#submit-form");
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const values = {};
      new FormData(form).forEach((v, k) => { values[k] = v; });
      const status = $("#submit-status");
      status.textContent = "Submitting…";
      try {
        const job = await api("/v1/plans", { method: "POST", headers: { "Content-Type": "application/json" },
          body: JSON.stringify(planRequest(values)) });
        status.innerHTML = 'Submitted job <a href="#/jobs/' + encodeURIComponent(job.id) + '"><code>' +
          esc(job.id) + "</code></a>.";
        flash("");
        listOffset = 0;
        refreshJobs(gen);
      } catch (err) {
        status.textContent = "";
        handleError(err, "Submission refused");
      }
    });
    $("#jobs-refresh").addEventListener("click", () => refreshJobs(gen));
    $("#jobs-newer").addEventListener("click", () => { listOffset = Math.max(0, listOffset - LIST_LIMIT); refreshJobs(gen); });
    $("#jobs-older").addEventListener("click", () => { listOffset += LIST_LIMIT; refreshJobs(gen); });
    refreshJobs(gen);
  }

  async function refreshJobs(gen) {
    if (gen !== generation) return;
    try {
      const data = await api("/v1/jobs?offset=" + listOffset + "&limit=" + LIST_LIMIT);
      if (gen !== generation) return;
      const el = $("#jobs-list");
      if (el) el.innerHTML = renderJobsTable(data);
      const newer = $("#jobs-newer"), older = $("#jobs-older");
      if (newer) newer.disabled = listOffset === 0;
      if (older) older.disabled = listOffset + ((data && data.jobs) || []).length >= ((data && data.total) || 0);
      const active = ((data && data.jobs) || []).some((j) => j.status === "running" || j.status === "queued");
      if (active) schedule(() => refreshJobs(gen));
      else stopPolling();
    } catch (err) {
      if (gen !== generation) return;
      const el = $("#jobs-list");
      if (el) el.innerHTML = '<p class="error">' + esc(err.message) + "</p>";
      handleError(err, "Jobs");
    }
  }

  // ---------------------------------------------------------------- job page

  async function jobPage(main, id, gen) {
    main.innerHTML = '<p><a href="#/">← All jobs</a></p><div id="job-head" aria-live="polite"><p class="hint">Loading…</p>' +
      '</div><div id="job-body"></div>';
    let resultShown = false;
    const live = (how) => { const head = $("#job-head"); if (head) head.dataset.live = how; };

    const showResult = async () => {
      resultShown = true;
      const body = $("#job-body");
      body.innerHTML = '<p class="hint">Loading the result…</p>';
      try {
        const result = await api("/v1/jobs/" + encodeURIComponent(id) + "/result");
        if (gen !== generation) return;
        const line = requestLine(result && result.request);
        const plan = result && result.best && result.best.plan;
        body.innerHTML = (line ? '<p class="request-line" data-testid="request">' + esc(line) + "</p>" : "") +
          renderResult(result) + '<p class="row downloads" data-testid="downloads">' +
          '<button type="button" class="secondary" id="download">Download result JSON</button>' +
          (plan ? '<button type="button" class="secondary" id="download-plan" data-testid="download-plan">' +
            "Download plan JSON</button>" : "") + "</p>";
        $("#download").addEventListener("click", () => downloadJson(result, "tagplan-" + id + ".json"));
        const planButton = $("#download-plan");
        if (planButton) planButton.addEventListener("click", () => downloadJson(plan, "tagplan-plan-" + id + ".json"));
      } catch (err) {
        if (gen !== generation) return;
        body.innerHTML = '<p class="error" data-testid="result-error">' + esc(err.message) + "</p>";
      }
    };

    /** Draw the job's state (from the stream or a poll); the result once it succeeded. */
    const show = async (job) => {
      if (gen !== generation) return;
      $("#job-head").innerHTML = renderJobHeader(job); // its data-live (events or polling) stays
      const cancel = $('#job-head [data-action="cancel"]');
      if (cancel) {
        cancel.addEventListener("click", async () => {
          cancel.disabled = true;
          try {
            const after = await api("/v1/jobs/" + encodeURIComponent(id), { method: "DELETE" });
            if (after && after.status) await show(after);
          } catch (err) { handleError(err, "Cancel"); }
        });
      }
      if (job.status === "succeeded" && !resultShown) await showResult();
    };

    const poll = async () => {
      if (gen !== generation) return;
      live("polling");
      let job;
      try {
        job = await api("/v1/jobs/" + encodeURIComponent(id));
      } catch (err) {
        if (gen !== generation) return;
        $("#job-head").innerHTML = '<section class="card"><h2>Job <code>' + esc(id) + '</code></h2><p class="error">' +
          esc(err.message) + "</p></section>";
        if (err.status === 401) handleError(err);
        return;
      }
      if (gen !== generation) return;
      await show(job);
      if (gen === generation && (job.status === "queued" || job.status === "running")) schedule(poll);
    };

    // One GET first: a finished job is drawn at once, with no stream left open; a queued or running
    // one is then followed over the event stream (polling only if the stream cannot be used).
    let first;
    try {
      first = await api("/v1/jobs/" + encodeURIComponent(id));
    } catch (err) {
      poll();
      return;
    }
    if (gen !== generation) return;
    if (first.status !== "queued" && first.status !== "running") {
      live("done");
      await show(first);
      return;
    }
    live("events");
    const followed = await streamJob(id, gen, show);
    if (!followed && gen === generation) poll(); // no stream (or it broke off): poll every POLL_MS
  }

  // ---------------------------------------------------------------- routing and start

  function route() {
    generation++;
    stopPolling();
    flash("");
    const main = $("#main");
    if (!getKey()) { needKey(main); return; }
    const r = parseRoute(root.location.hash);
    if (r.page === "job") {
      document.title = "Job " + r.id.slice(0, 12) + " · tagplan";
      jobPage(main, r.id, generation);
    } else {
      document.title = "Jobs · tagplan";
      jobsPage(main, generation);
    }
  }

  function keyForm() {
    const form = $("#key-form");
    const input = $("#api-key");
    const state = $("#key-state");
    const show = () => {
      const k = getKey();
      state.textContent = k ? "key set (" + k.slice(0, 6) + "…)" : "no key";
      input.value = "";
      input.placeholder = k ? "replace key" : "paste API key";
    };
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      const v = input.value.trim();
      if (v) { setKey(v); show(); route(); }
    });
    $("#key-forget").addEventListener("click", () => { setKey(""); show(); route(); });
    show();
  }

  function start() {
    takeKeyFromUrl();
    keyForm();
    root.addEventListener("hashchange", route);
    route();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})(typeof window !== "undefined" ? window : globalThis);
