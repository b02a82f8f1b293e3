// keras_scale TensorBoard dashboard: plain DOM + SVG, no script, font or chart library (works air-gapped).
// TensorBoard loads this module in an iframe whose base URL is /data/plugin/keras_scale/ and calls render().

const SVG_NS = 'http://www.w3.org/2000/svg';
const COLORS = {
  productive_s: '#2e7d32', skipped_steps_s: '#c62828', redone_s: '#ef6c00', input_wait_s: '#f9a825',
  compile_s: '#6a1b9a', checkpoint_s: '#1565c0', eval_s: '#00838f', measure_s: '#b0bec5', other_s: '#78909c',
};
const LABELS = {
  productive_s: 'productive', skipped_steps_s: 'NaN-skipped', redone_s: 'redone', input_wait_s: 'input wait',
  compile_s: 'compile', checkpoint_s: 'checkpoint', eval_s: 'eval', measure_s: 'measuring', other_s: 'other',
};
const INCIDENT = {
  nan: ['#c62828', 'NaN skip'], rollback: ['#ad1457', 'rollback'], lr_cut: ['#6a1b9a', 'LR cut'],
  oom_resplit: ['#ef6c00', 'OOM re-split'], preemption: ['#1565c0', 'preemption save'],
  resume: ['#2e7d32', 'resume'], worker_restart: ['#4e342e', 'worker restart'],
};
const SERIES_COLORS = ['#1565c0', '#90a4ae', '#ef6c00', '#2e7d32', '#6a1b9a'];

const CSS = `
body { font-family: Roboto, Arial, Helvetica, sans-serif; margin: 0; color: #212121; background: #f5f5f5; }
.ks { padding: 12px 20px 40px; max-width: 1100px; }
.ks h1 { font-size: 20px; font-weight: 500; margin: 6px 0 4px; }
.ks h2 { font-size: 15px; font-weight: 500; margin: 0 0 8px; }
.ks .card { background: #fff; border-radius: 4px; box-shadow: 0 1px 3px rgba(0,0,0,.18); padding: 12px 16px;
  margin: 12px 0; }
.ks .muted { color: #616161; font-size: 12px; }
.ks .totals { font-size: 13px; margin: 4px 0 8px; }
.ks .totals b { font-weight: 500; }
.ks table { border-collapse: collapse; font-size: 12px; width: 100%; }
.ks th, .ks td { text-align: left; padding: 3px 8px 3px 0; border-bottom: 1px solid #eee; vertical-align: top; }
.ks th { font-weight: 500; color: #616161; }
.ks .legend { font-size: 12px; display: flex; flex-wrap: wrap; gap: 4px 14px; margin: 4px 0; }
.ks .sw { display: inline-block; width: 10px; height: 10px; margin-right: 4px; border-radius: 2px;
  vertical-align: -1px; }
.ks .runs button { margin: 0 6px 6px 0; padding: 4px 10px; border: 1px solid #bdbdbd; background: #fff;
  border-radius: 14px; cursor: pointer; font-size: 12px; }
.ks .runs button.on { background: #ff7043; border-color: #ff7043; color: #fff; }
.ks .verdict { font-size: 13px; margin: 4px 0; }
.ks .tag { display: inline-block; white-space: nowrap; padding: 1px 6px; border-radius: 3px; color: #fff; font-size: 11px; }
.ks svg text { font-size: 11px; fill: #424242; }
.ks a { color: #1565c0; }
`;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === 'class') node.className = v; else if (k === 'style') node.style.cssText = v;
    else if (k.startsWith('on')) node.addEventListener(k.slice(2), v); else node.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

function tip(node, text) { node.append(svg('title', {}, text)); return node; }

function fmt(x, digits = 3) {
  // integers as they are (290, 1,024), others to `digits` significant digits without trailing zeros
  if (x === null || x === undefined || typeof x !== 'number' || !Number.isFinite(x)) return 'n/a';
  if (Number.isInteger(x) || Math.abs(x) >= 1000) return Math.round(x).toLocaleString('en-US');
  const s = x.toPrecision(digits);
  const [mantissa, exponent] = s.split('e');
  const trimmed = mantissa.includes('.') ? mantissa.replace(/0+$/, '').replace(/\.$/, '') : mantissa;
  return exponent === undefined ? trimmed : trimmed + 'e' + exponent;
}
// Round ("nice") tick values covering [lo, hi]: steps of 1, 2, 2.5 or 5 times a power of ten (integers only with
// `integer`); returns {lo, hi, ticks} with lo and hi widened to the outer ticks.
function niceTicks(lo, hi, count = 5, integer = false) {
  if (!Number.isFinite(lo) || !Number.isFinite(hi)) return {lo: 0, hi: 1, ticks: [0, 1]};
  if (hi < lo) [lo, hi] = [hi, lo];
  if (hi - lo < 1e-12) { const d = Math.abs(lo) > 0 ? Math.abs(lo) * 0.1 : 1; lo -= d; hi += d; }
  const raw = (hi - lo) / Math.max(1, count - 1);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  let step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((v) => v >= raw * (1 - 1e-9));
  if (integer) step = Math.max(1, Math.round(step));
  const first = Math.floor(lo / step + 1e-9), last = Math.ceil(hi / step - 1e-9);
  const ticks = [];
  for (let k = first; k <= last; k++) ticks.push(Number((k * step).toPrecision(12)));
  return {lo: ticks[0], hi: ticks[ticks.length - 1], ticks, step};
}
// A tick's label: as many decimals as the tick step needs (0.0025 -> 4), so adjacent ticks never read the same
// ("1.100", "1.105", not "1.1" twice); whole steps print as integers.
function tickLabel(v, step) {
  if (typeof v !== 'number' || !Number.isFinite(v)) return 'n/a';
  let decimals = 0;
  while (decimals < 12 && Math.abs(step * Math.pow(10, decimals) - Math.round(step * Math.pow(10, decimals))) >
         1e-6 * step * Math.pow(10, decimals)) decimals++;
  if (decimals === 0) return Math.round(v).toLocaleString('en-US');
  const s = v.toLocaleString('en-US', {minimumFractionDigits: decimals, maximumFractionDigits: decimals});
  return s === '-' + (0).toFixed(decimals) ? (0).toFixed(decimals) : s;
}
// Where a checkpoint was taken: Keras's epochs 1-based; a save at batch 0 of epoch e+1 is the end of epoch e.
function savedAt(epoch, stepInEpoch) {
  if (epoch === null || epoch === undefined) return '';
  if (!stepInEpoch) return epoch > 0 ? `end of epoch ${epoch}` : 'before the first step';
  return `epoch ${epoch + 1}, batch ${stepInEpoch}`;
}
function secs(s) {
  if (s === null || s === undefined) return 'n/a';
  if (s >= 3600) return (s / 3600).toFixed(1) + ' h';
  if (s >= 120) return (s / 60).toFixed(1) + ' min';
  return fmt(s, 3) + ' s';
}
function pct(f) { return f === null || f === undefined ? 'n/a' : (100 * f).toFixed(0) + '%'; }
function base(path) { return (path || '').split('/').pop(); }

async function getJSON(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(url + ': HTTP ' + response.status);
  return response.json();
}

function legend(categories) {
  return el('div', {class: 'legend'}, ...categories.map(
    (c) => el('span', {}, el('span', {class: 'sw', style: 'background:' + (COLORS[c] || '#999')}), LABELS[c] || c)));
}

function totalsLine(t) {
  if (!t) return el('div', {class: 'totals muted'}, 'no goodput recorded (Goodput(log_dir=...) writes it)');
  const parts = [
    ['wall', secs(t.wall_s)], ['goodput', pct(t.goodput)], ['samples/s', fmt(t.samples_per_s)],
    ['MFU', t.mfu === null || t.mfu === undefined ? 'n/a (peak FLOP/s unknown here)' : pct(t.mfu)],
    ['steps', fmt(t.steps)], ['NaN-skipped', fmt(t.skipped_steps)], ['rolled back', fmt(t.rolled_back_steps)],
  ];
  if (t.restarts) parts.push(['worker restarts', `${t.restarts} (${secs(t.restart_lost_s)} restart downtime)`]);
  return el('div', {class: 'totals'}, ...parts.flatMap(([k, v], i) => [i ? ' · ' : '', k + ' ', el('b', {}, v)]));
}

// ---------------------------------------------------------------------------------------------- goodput
function compareBars(runs, categories, selected, onPick) {
  const width = 1000, row = 26, left = 170, right = 150;
  const shown = runs.filter((r) => r.totals);
  const chart = svg('svg', {width: '100%', viewBox: `0 0 ${width} ${Math.max(1, shown.length) * row + 4}`});
  shown.forEach((r, i) => {
    const t = r.totals, y = i * row + 2, span = width - left - right;
    const name = svg('text', {x: left - 8, y: y + 15, 'text-anchor': 'end',
      style: 'cursor:pointer' + (r.run === selected ? ';font-weight:bold' : '')}, r.label || r.run);
    name.addEventListener('click', () => onPick(r.run));
    chart.append(name);
    let x = left;
    for (const c of categories) {
      const w = t.wall_s > 0 ? span * (t[c] || 0) / t.wall_s : 0;
      if (w <= 0) continue;
      chart.append(tip(svg('rect', {x, y, width: w, height: row - 8, fill: COLORS[c] || '#999'}),
        `${r.run}: ${LABELS[c] || c} ${secs(t[c])} (${pct(t[c] / t.wall_s)})`));
      x += w;
    }
    chart.append(svg('text', {x: width - right + 8, y: y + 15},
      `${pct(t.goodput)} of ${secs(t.wall_s)}` + (t.samples_per_s ? `, ${fmt(t.samples_per_s)}/s` : '')));
  });
  return chart;
}

function epochBars(epochs, categories) {
  const width = 1000, height = 190, left = 50, bottom = 24, top = 8;
  const chart = svg('svg', {width: '100%', viewBox: `0 0 ${width} ${height}`});
  if (!epochs.length) return el('div', {class: 'muted'}, 'no epoch finished yet');
  const axis = niceTicks(0, Math.max(...epochs.map((e) => e.wall_s || 0), 1e-9));
  const maxWall = axis.hi;
  const slot = (width - left - 10) / epochs.length, barW = Math.max(2, Math.min(60, slot * 0.7));
  const yScale = (s) => (height - bottom - top) * s / maxWall;
  for (const v of axis.ticks) {
    const y = height - bottom - yScale(v);
    chart.append(svg('line', {x1: left, x2: width - 10, y1: y, y2: y, stroke: '#eee'}));
    chart.append(svg('text', {x: left - 6, y: y + 4, 'text-anchor': 'end'}, secs(v)));
  }
  const labelEvery = Math.ceil(epochs.length / 25);
  epochs.forEach((e, i) => {
    const x = left + i * slot + (slot - barW) / 2;
    let y = height - bottom;
    for (const c of categories) {
      const h = yScale(e[c] || 0);
      if (h <= 0) continue;
      y -= h;
      chart.append(tip(svg('rect', {x, y, width: barW, height: h, fill: COLORS[c] || '#999'}),
        `epoch ${e.epoch + 1}: ${LABELS[c] || c} ${secs(e[c])} of ${secs(e.wall_s)}`));
    }
    if (i % labelEvery === 0) {
      chart.append(svg('text', {x: x + barW / 2, y: height - 8, 'text-anchor': 'middle'}, 'e' + (e.epoch + 1)));
    }
    if (i > 0 && epochs[i - 1].pid !== e.pid) {  // a new process: a resume or a second fit
      chart.append(tip(svg('line', {x1: x - (slot - barW) / 2, x2: x - (slot - barW) / 2, y1: top,
        y2: height - bottom, stroke: '#2e7d32', 'stroke-dasharray': '3 3'}), 'new process (resume / next fit)'));
    }
  });
  return chart;
}

// ---------------------------------------------------------------------------------------------- loss + incidents
function describe(e) {
  switch (e.kind) {
    case 'nan': return `${e.bad_steps || 1} non-finite step(s) skipped; source: ${e.source}` +
      (e.details && e.details.length ? ` (${e.details.slice(0, 3).join('; ')})` : '');
    case 'rollback': return `rolled back to the ${e.restored_from}; learning rate x ${fmt(e.lr_factor)}; ` +
      `${fmt(e.discarded_steps)} update(s) discarded (rollback ${e.rollback})`;
    case 'lr_cut': return `learning rate ${fmt(e.old_lr)} -> ${fmt(e.new_lr)} (${e.monitor} stopped improving)`;
    case 'oom_resplit': return `out of memory: accum ${e.old_accum} -> ${e.new_accum}, micro-batch ` +
      `${e.old_micro_batch} -> ${e.new_micro_batch}`;
    case 'preemption': return `preemption signal ${e.signal || ''}: state saved, run stops`;
    case 'resume': return `resumed from ${base(e.path)} (saved at ${savedAt(e.epoch || 0, e.step_in_epoch)}; ` +
      `continues at epoch ${(e.epoch || 0) + 1}, batch ${(e.step_in_epoch || 0) + 1})` +
      (e.redone_steps !== undefined ? `; ${e.redone_steps} step(s) redone` : '');
    case 'worker_restart': return `worker ${e.task || ''} restarted` + (e.reason ? `: ${e.reason}` : '');
    default: return e.kind;
  }
}

// the one x axis of every chart and table (data.py converts the records that count optimizer updates)
const STEP_NOTE = 'step: batches trained, NaN-skipped steps included (as Keras\'s progress bar and TensorBoard\'s ' +
  'batch_loss count them)';

function lossChart(loss, incidents, saves, epochs = [], notes = {}) {
  const width = 1000, height = 280, left = 56, right = 16, top = 22, bottom = 28;
  const names = Object.keys(loss);
  const xs = [];
  for (const n of names) for (const p of loss[n]) xs.push(p[0]);
  for (const e of incidents) if (e.step !== null && e.step !== undefined) xs.push(e.step);
  for (const s of saves) if (s.step !== null && s.step !== undefined) xs.push(s.step);
  const chart = svg('svg', {width: '100%', viewBox: `0 0 ${width} ${height}`});
  if (!xs.length) return el('div', {class: 'muted'}, 'no loss recorded yet');
  const xAxis = niceTicks(Math.min(0, ...xs), Math.max(...xs, 1), 6, true);
  const x0 = xAxis.lo, x1 = xAxis.hi;
  const ys = [];
  for (const n of names) for (const p of loss[n]) ys.push(p[1]);
  const yAxis = niceTicks(ys.length ? Math.min(...ys) : 0, ys.length ? Math.max(...ys) : 1, 6);
  const y0 = yAxis.lo, y1 = yAxis.hi;
  const X = (v) => left + (width - left - right) * (v - x0) / (x1 - x0);
  const Y = (v) => top + (height - top - bottom) * (1 - (v - y0) / (y1 - y0));
  for (const v of yAxis.ticks) {
    chart.append(svg('line', {x1: left, x2: width - right, y1: Y(v), y2: Y(v), stroke: '#eee'}));
    chart.append(svg('text', {x: left - 6, y: Y(v) + 4, 'text-anchor': 'end', class: 'ytick'}, tickLabel(v, yAxis.step)));
  }
  for (const s of xAxis.ticks) {
    chart.append(svg('text', {x: X(s), y: height - 8, 'text-anchor': 'middle', class: 'xtick'}, tickLabel(s, xAxis.step)));
  }
  chart.append(svg('text', {x: left - 6, y: height - 8, 'text-anchor': 'end'}, 'step'));
  for (const e of epochs.slice(0, -1)) {  // epoch boundaries: Keras's running loss mean restarts there
    if (e.step === null || e.step === undefined) continue;
    chart.append(tip(svg('line', {x1: X(e.step), x2: X(e.step), y1: top, y2: height - bottom, stroke: '#bdbdbd',
      'stroke-dasharray': '1 3'}), `end of epoch ${e.epoch + 1} (step ${e.step})`));
  }
  for (const s of saves) {
    if (s.step === null || s.step === undefined) continue;
    chart.append(tip(svg('path', {d: `M${X(s.step)},${height - bottom} l-4,7 h8 z`,
      fill: s.usable ? '#1565c0' : '#b0bec5'}),
    `checkpoint at step ${s.step}: blocked ${secs(s.blocked_s)}${s.on_disk ? '' : ' (no longer on disk)'}`));
  }
  names.forEach((n, i) => {
    const pts = loss[n];
    const color = SERIES_COLORS[i % SERIES_COLORS.length];
    if (pts.length > 1) {
      chart.append(svg('polyline', {points: pts.map((p) => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(' '),
        fill: 'none', stroke: color, 'stroke-width': 1.6}));
    }
    if (pts.length <= 60) {
      for (const p of pts) {
        chart.append(tip(svg('circle', {cx: X(p[0]), cy: Y(p[1]), r: 3, fill: color}),
          `${n} ${fmt(p[1], 4)} at step ${p[0]}`));
      }
    }
  });
  for (const e of incidents) {
    if (e.step === null || e.step === undefined) continue;
    const [color, label] = INCIDENT[e.kind] || ['#424242', e.kind];
    const x = X(e.step);
    chart.append(svg('line', {x1: x, x2: x, y1: top, y2: height - bottom, stroke: color, 'stroke-width': 1,
      'stroke-dasharray': '4 3', opacity: 0.8}));
    chart.append(tip(svg('path', {d: `M${x},${top - 2} l-6,-10 h12 z`, fill: color}),
      `${label} at step ${e.step}: ${describe(e)}`));
  }
  const kinds = [...new Set(incidents.map((e) => e.kind))];
  const keys = el('div', {class: 'legend'},
    ...names.map((n, i) => el('span', {}, el('span', {class: 'sw', style:
      'background:' + SERIES_COLORS[i % SERIES_COLORS.length]}), n)),
    ...kinds.map((k) => el('span', {}, el('span', {class: 'sw', style: 'background:' + (INCIDENT[k] || ['#424242'])[0]}),
      `${(INCIDENT[k] || [0, k])[1]} (${incidents.filter((e) => e.kind === k).length})`)),
    saves.length ? el('span', {}, el('span', {class: 'sw', style: 'background:#1565c0'}), 'checkpoint save') : null);
  const said = names.filter((n) => notes[n]).map((n) => el('div', {class: 'muted note'}, `${n}: ${notes[n]}`));
  return el('div', {}, chart, keys, ...said, el('div', {class: 'muted note'}, STEP_NOTE));
}

function incidentTable(incidents) {
  if (!incidents.length) return el('div', {class: 'muted'}, 'no incidents: no NaN skip, rollback, OOM re-split, ' +
    'preemption or resume recorded');
  const MAX_ROWS = 300;
  const rows = incidents.slice(0, MAX_ROWS).map((e) => {
    const [color, label] = INCIDENT[e.kind] || ['#424242', e.kind];
    return el('tr', {}, el('td', {}, el('span', {class: 'tag', style: 'background:' + color}, label)),
      el('td', {}, e.step === null || e.step === undefined ? '' : String(e.step)),
      el('td', {}, e.epoch === null || e.epoch === undefined ? '' : String(e.epoch + 1)),
      el('td', {}, describe(e)), el('td', {class: 'muted'}, e.advice || ''));
  });
  return el('div', {}, el('table', {}, el('tr', {}, ...['incident', 'step', 'epoch', 'what', 'likely fix']
    .map((h) => el('th', {}, h))), ...rows),
  incidents.length > MAX_ROWS ? el('div', {class: 'muted'},
    `${incidents.length - MAX_ROWS} more incidents (all drawn on the curve above; all in /run data)`) : null);
}

// ---------------------------------------------------------------------------------------------- GPU
function lane(points, label, x0, x1) {
  const width = 1000, height = 54, left = 130, right = 10;
  const chart = svg('svg', {width: '100%', viewBox: `0 0 ${width} ${height}`});
  const ys = points.map((p) => p[1]);
  const y0 = Math.min(0, ...ys), y1 = Math.max(...ys) > y0 ? niceTicks(y0, Math.max(...ys), 3).hi : y0 + 1;
  const X = (v) => left + (width - left - right) * (v - x0) / Math.max(1e-9, x1 - x0);
  const Y = (v) => 4 + (height - 12) * (1 - (v - y0) / (y1 - y0));
  chart.append(svg('text', {x: 0, y: height / 2 + 4}, label));
  chart.append(svg('text', {x: left - 6, y: 12, 'text-anchor': 'end'}, fmt(y1)));
  chart.append(svg('line', {x1: left, x2: width - right, y1: height - 8, y2: height - 8, stroke: '#ddd'}));
  chart.append(svg('polyline', {points: points.map((p) => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(' '),
    fill: 'none', stroke: '#ff7043', 'stroke-width': 1.4}));
  return chart;
}

function gpuSection(gpu) {
  const out = [];
  const gpus = Object.keys(gpu.lanes || {});
  if (!gpus.length) {
    out.push(el('div', {class: 'muted'}, 'No GPU data in this run' +
      (gpu.unavailable ? ` (GpuMonitor: ${gpu.unavailable})` : '') +
      '. With a GPU, GpuMonitor(log_dir=...) draws utilisation, memory, power and throttling here.'));
  } else {
    let x0 = Infinity, x1 = -Infinity;
    for (const g of gpus) for (const pts of Object.values(gpu.lanes[g])) for (const p of pts) {
      x0 = Math.min(x0, p[0]); x1 = Math.max(x1, p[0]);
    }
    for (const g of gpus) {
      for (const [label, pts] of Object.entries(gpu.lanes[g])) out.push(lane(pts, `GPU ${g} ${label}`, x0, x1));
    }
  }
  for (const a of gpu.advice || []) {
    out.push(el('div', {class: 'verdict'}, el('b', {}, a.advice + ': '), a.message));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------- checkpoints, profile
function checkpointSection(ck) {
  if (!ck.saves.length) return [el('div', {class: 'muted'}, 'no checkpoint saved (ChiefCheckpoint records its saves)')];
  const rows = ck.saves.slice(-200).reverse().map((s) => el('tr', {},
    el('td', {}, String(s.step)), el('td', {class: 'saved-at'}, savedAt(s.epoch, s.step_in_epoch)),
    el('td', {}, secs(s.blocked_s)), el('td', {}, s.bytes === null ? '' : fmt(s.bytes / 1e6) + ' MB'),
    el('td', {}, s.async_save ? 'async' : 'sync'), el('td', {}, s.preemption ? 'preemption' : ''),
    el('td', {}, s.best ? `best ${s.best.monitor}=${fmt(s.best.value, 4)}` : ''),
    el('td', {}, s.path === ck.newest_usable ? 'newest usable' : s.on_disk ? 'on disk' : 'removed (max_to_keep)'),
    el('td', {class: 'muted'}, base(s.path))));
  return [el('div', {class: 'totals'}, `${ck.saves.length} saves, training blocked ${secs(ck.blocked_s_total)} in all; ` +
    'newest usable: ', el('b', {}, ck.newest_usable || 'none')),
  el('table', {}, el('tr', {}, ...['step', 'saved at', 'blocked', 'size', 'mode', '', 'best-k', 'state', 'files']
    .map((h) => el('th', {}, h))), ...rows)];
}

function profileSection(profiles) {
  if (!profiles.length) return [el('div', {class: 'muted'}, 'no ProfileWindow capture in this run')];
  const profileTab = new URL('../../../#profile', document.baseURI).href;
  return profiles.map((p) => el('div', {class: 'verdict'},
    el('b', {}, p.verdict || 'unknown'),
    ` at steps ${(p.step_numbers || []).join(', ') || p.step}: step time ${fmt(p.step_time_ms)} ms; input ` +
    `${fmt(p.input_percent, 2)}%, compute ${fmt(p.compute_percent, 2)}%, launch ${fmt(p.launch_percent, 2)}%. `,
    el('div', {class: 'muted'}, p.verdict_line || ''),
    el('div', {class: 'muted'}, base(p.capture_dir) + ' ', el('a', {href: profileTab, target: '_top'},
      'open in the Profile tab'))));
}

// ---------------------------------------------------------------------------------------------- sweep: runs overlaid
const RUN_COLORS = ['#1565c0', '#ef6c00', '#2e7d32', '#6a1b9a', '#c62828', '#00838f', '#5d4037', '#ad1457'];
// run i's colour: the palette, then hues a golden angle apart (never a colour twice, however many runs)
function runColor(i) {
  if (i < RUN_COLORS.length) return RUN_COLORS[i];
  const k = i - RUN_COLORS.length;
  return `hsl(${((k * 137.508 + 20) % 360).toFixed(1)}, ${k % 2 ? 55 : 75}%, ${[32, 42, 52][k % 3]}%)`;
}

// The runs' loss curves on one chart (each run one colour; training loss solid, val_loss dashed), each run's
// incidents as markers of its colour above the curves, and a legend naming the runs.
function compareLoss(details) {
  const width = 1000, height = 260, left = 56, right = 16, top = 26, bottom = 28;
  const curves = [];
  details.forEach((d, i) => {
    const color = runColor(i), label = d.summary.label || d.run;
    const train = d.loss.batch_loss ? 'batch_loss' : (d.loss['loss (epoch mean)'] ? 'loss (epoch mean)' : null);
    if (train) curves.push({run: label, name: train, pts: d.loss[train], color, dash: null});
    if (d.loss.val_loss) curves.push({run: label, name: 'val_loss', pts: d.loss.val_loss, color, dash: '5 4'});
  });
  const xs = [], ys = [];
  for (const c of curves) for (const p of c.pts) { xs.push(p[0]); ys.push(p[1]); }
  for (const d of details) for (const e of d.incidents) if (e.step !== null && e.step !== undefined) xs.push(e.step);
  if (!ys.length) return el('div', {class: 'muted'}, 'no loss recorded in these runs yet');
  const xAxis = niceTicks(Math.min(0, ...xs), Math.max(...xs, 1), 6, true);
  const yAxis = niceTicks(Math.min(...ys), Math.max(...ys), 6);
  const X = (v) => left + (width - left - right) * (v - xAxis.lo) / (xAxis.hi - xAxis.lo);
  const Y = (v) => top + (height - top - bottom) * (1 - (v - yAxis.lo) / (yAxis.hi - yAxis.lo));
  const chart = svg('svg', {width: '100%', viewBox: `0 0 ${width} ${height}`, class: 'sweep-loss'});
  for (const v of yAxis.ticks) {
    chart.append(svg('line', {x1: left, x2: width - right, y1: Y(v), y2: Y(v), stroke: '#eee'}));
    chart.append(svg('text', {x: left - 6, y: Y(v) + 4, 'text-anchor': 'end', class: 'sweep-ytick'}, tickLabel(v, yAxis.step)));
  }
  for (const v of xAxis.ticks) chart.append(svg('text', {x: X(v), y: height - 8, 'text-anchor': 'middle', class: 'sweep-xtick'}, tickLabel(v, xAxis.step)));
  chart.append(svg('text', {x: left - 6, y: height - 8, 'text-anchor': 'end'}, 'step'));
  for (const c of curves) {
    const attrs = {points: c.pts.map((p) => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(' '), fill: 'none',
      stroke: c.color, 'stroke-width': 1.6};
    if (c.dash) attrs['stroke-dasharray'] = c.dash;
    chart.append(tip(svg('polyline', attrs), `${c.run}: ${c.name}`));
    if (c.pts.length === 1) chart.append(svg('circle', {cx: X(c.pts[0][0]), cy: Y(c.pts[0][1]), r: 3, fill: c.color}));
  }
  details.forEach((d, i) => {
    const color = runColor(i);
    for (const e of d.incidents) {
      if (e.step === null || e.step === undefined) continue;
      const label = (INCIDENT[e.kind] || [0, e.kind])[1], x = X(e.step);
      chart.append(svg('line', {x1: x, x2: x, y1: top, y2: height - bottom, stroke: color, 'stroke-width': 1,
        'stroke-dasharray': '2 3', opacity: 0.6}));
      chart.append(tip(svg('path', {d: `M${x},${top - 2} l-5,-9 h10 z`, fill: color}),
        `${d.summary.label || d.run}: ${label} at step ${e.step}: ${describe(e)}`));
    }
  });
  const keys = el('div', {class: 'legend sweep-legend'}, ...details.map((d, i) => {
    const n = d.incidents.length;
    return el('span', {class: 'sweep-run'}, el('span', {class: 'sw', style: 'background:' + runColor(i)}),
      `${d.summary.label || d.run}` + (n ? ` (${n} incident${n === 1 ? '' : 's'} \u25bc)` : ''));
  }), el('span', {class: 'muted'}, 'solid: training loss · dashed: val_loss'));
  const trains = [...new Set(curves.filter((c) => !c.dash).map((c) => c.name))];
  const notes = trains.map((n) => el('div', {class: 'muted note'}, `${n}: ${(details.find((d) => d.loss_notes && d.loss_notes[n]) || {loss_notes: {}}).loss_notes[n] || ''}`));
  return el('div', {}, chart, keys, ...notes, el('div', {class: 'muted note'}, STEP_NOTE));
}

// ---------------------------------------------------------------------------------------------- page
function card(title, ...children) { return el('div', {class: 'card'}, el('h2', {}, title), ...children); }

function runPage(d) {
  const t = d.summary.totals;
  return [
    card(`Goodput per epoch: ${d.summary.label || d.run}`, totalsLine(t), epochBars(d.epochs, d.categories), legend(d.categories)),
    card('Loss and incidents', lossChart(d.loss, d.incidents, d.checkpoints.saves, d.epochs, d.loss_notes || {}),
      incidentTable(d.incidents)),
    card('GPU', ...gpuSection(d.gpu)),
    card('Checkpoints', ...checkpointSection(d.checkpoints)),
    card('Profiler verdicts', ...profileSection(d.profiles)),
  ];
}

export async function render() {
  document.head.append(el('style', {}, CSS));
  const root = el('div', {class: 'ks', id: 'keras-scale-dashboard'});
  document.body.append(root);
  let runs;
  try {
    runs = await getJSON('./runs');
  } catch (err) {
    root.append(el('div', {class: 'card'}, 'keras_scale: could not load runs: ' + err));
    return;
  }
  root.append(el('h1', {}, 'keras_scale'));
  if (!runs.length) {
    root.append(el('div', {class: 'card muted'}, 'No keras_scale run in this log directory.'));
    return;
  }
  const categories = Object.keys(LABELS);
  const compare = el('div');
  const picker = el('div', {class: 'runs'});
  const page = el('div');
  let selected = runs[0].run;
  async function show(name) {
    selected = name;
    compare.replaceChildren(compareBars(runs, categories, selected, show));
    picker.replaceChildren(...(runs.length < 2 ? [] : runs.map((r) => el('button', {
      class: r.run === selected ? 'on' : '', onclick: () => show(r.run)}, r.label || r.run))));
    page.replaceChildren(el('div', {class: 'muted'}, 'loading ' + name + ' ...'));
    try {
      const d = await getJSON('./run?run=' + encodeURIComponent(name));
      page.replaceChildren(...runPage(d));
      root.dataset.loaded = name;
    } catch (err) {
      page.replaceChildren(el('div', {class: 'card'}, 'could not load ' + name + ': ' + err));
    }
  }
  root.append(card(runs.length > 1 ? `Goodput of ${runs.length} runs side by side` : 'Goodput',
    compare, legend(categories)));
  if (runs.length > 1) {
    const overlay = el('div', {class: 'muted'}, 'loading the runs\' loss curves ...');
    root.append(card(`Loss of ${runs.length} runs overlaid, with their incidents`, overlay));
    Promise.all(runs.map((r) => getJSON('./run?run=' + encodeURIComponent(r.run))))
      .then((details) => { overlay.replaceWith(compareLoss(details)); root.dataset.compared = String(details.length); })
      .catch((err) => overlay.replaceWith(el('div', {}, 'could not load the runs: ' + err)));
  }
  root.append(picker, page);
  await show(selected);
}

// for tests (node): the formatting helpers
export { fmt, niceTicks, tickLabel, runColor, savedAt };
