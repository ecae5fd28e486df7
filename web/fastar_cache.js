// FAST-AR cache widget: live KV-cache size on the samplers (Autoregressive Long Sampler, FAST-AR AR Video,
// FAST-AR Matrix-Game Sampler, FAST-AR World Sampler) and FAST-AR World Play.
//
// The sampler sends `fastar.cache` events (PromptServer.send_sync) after every chunk with plain
// numbers: tokens, GB, dense-equivalent size, frames done / total (in video frames, what the sampler's
// `length` counts, and in latent frames), chunk latency, AnnSA's density (the share of the cached keys
// its plans read) and the share of its layers that ran sparse (both null without AnnSA), which prompt of
// a prompt schedule is active, and which engine runs the forwards
// ("fused" or "comfy", with the reason as the row's tooltip), and how the chunks are sampled (frames a
// chunk, steps, shift) with where that came from: a model file's record overrides the sampler's widgets
// without changing them, so the node says so. Strings from the server are shown as text
// (textContent), never inserted as HTML.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const NODE_TYPES = new Set(["FastARAutoregressiveSampler", "FastARARVideo", "FastARMatrixGameSampler", "FastARWorldSampler",
                            "FastARWorldPlay"]);
const EVENT = "fastar.cache";
const HISTORY = 120;  // points kept for the graph

const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : Number.NaN);

export function formatTokens(n) {
  n = num(n);
  if (!Number.isFinite(n)) return "–";
  if (n >= 1e6) return (n / 1e6).toFixed(2) + " M";
  if (n >= 1e3) return (n / 1e3).toFixed(1) + " k";
  return String(Math.round(n));
}

export function formatGB(gb) {
  gb = num(gb);
  if (!Number.isFinite(gb)) return "–";
  if (gb >= 100) return gb.toFixed(0) + " GB";
  if (gb >= 1) return gb.toFixed(2) + " GB";
  const mb = gb * 1e3;
  if (mb >= 1) return mb.toFixed(mb >= 10 ? 0 : 1) + " MB";
  return (mb * 1e3).toFixed(1) + " KB";
}

export function formatPercent(x) {
  x = num(x);
  return Number.isFinite(x) ? (100 * x).toFixed(x < 0.1 ? 1 : 0) + " %" : "–";
}

export function formatRate(x) {
  x = num(x);
  return Number.isFinite(x) ? x.toFixed(x >= 10 ? 1 : 2) + " chunks/s" : "–";
}

// "321 / 801": frames done / total
export function formatFrames(done, total) {
  const n = (v) => (Number.isFinite(num(v)) ? String(num(v)) : "–");
  return n(done) + " / " + n(total);
}

// "3 fr · 4 steps · shift 5": latent frames a chunk, denoising steps, shift; whose settings they are
// ("file", "widgets", "graph"); the steps themselves and the whole source ("as X.safetensors records ...")
// as the tooltip
export function formatSampling(s) {
  if (!s || typeof s !== "object") return { text: "–", from: "–", title: "" };
  const steps = Array.isArray(s.timesteps) ? s.timesteps.map((t) => String(Math.round(num(t) * 10) / 10)) : [];
  const source = typeof s.source === "string" ? s.source : "";
  const from = source.startsWith("as the widgets") ? "widgets" : source.startsWith("as the graph") ? "graph"
    : source ? "file" : "–";
  const text = num(s.frames_per_chunk) + " fr · " + steps.length + " step" + (steps.length === 1 ? "" : "s") +
    " · shift " + num(s.shift);
  return { text, from, title: "timesteps " + steps.join(",") + " at shift " + num(s.shift) + ", " + source };
}

const HELD_COLOR = "#4fc3f7", DENSE_COLOR = "rgba(200,200,200,0.6)";

function el(tag, style, text) {
  const e = document.createElement(tag);
  if (style) e.style.cssText = style;
  if (text !== undefined) e.textContent = text;
  return e;
}

class CacheView {
  constructor() {
    this.root = el("div", "font: 11px monospace; color: var(--input-text, #ddd); padding: 4px 6px;" +
      "background: var(--comfy-input-bg, #222); border-radius: 4px; box-sizing: border-box;");
    this.root.className = "fastar-cache";
    this.status = el("div", "opacity: 0.8; margin-bottom: 2px;", "FAST-AR cache: idle");
    this.status.dataset.field = "status";
    this.root.appendChild(this.status);
    const grid = el("div", "display: grid; grid-template-columns: auto 1fr; column-gap: 8px;");
    this.fields = {};
    for (const [key, label] of [["tokens", "tokens"], ["gb", "size"], ["relative", "vs dense"],
                                ["frames", "frames"], ["latent", "latent"], ["rate", "speed"], ["annsa", "AnnSA reads"],
                                ["annsa_sparse", "AnnSA sparse"], ["prompt", "prompt"], ["engine", "engine"],
                                ["sampling", "sampling"], ["sampled_from", "from"], ["saved", "on disk"]]) {
      grid.appendChild(el("span", "opacity: 0.7;", label));
      const v = el("span", "text-align: right;", "–");
      v.dataset.field = key;
      grid.appendChild(v);
      this.fields[key] = v;
    }
    this.root.appendChild(grid);
    // the history graph: cache size (y, GB) against video frames done (x); its legend over the top left,
    // where the lines (growing from the bottom left) leave room
    const legend = el("div", "position: absolute; left: 4px; top: 0; display: flex; gap: 8px; font-size: 9px;" +
                             "line-height: 11px; opacity: 0.85;");
    legend.dataset.field = "legend";
    for (const [color, text, tip] of [[HELD_COLOR, "held", "the KV cache this rollout holds"],
                                      [DENSE_COLOR, "dense", "the KV cache a dense rollout would hold: every frame kept"]]) {
      const item = el("span", "white-space: nowrap;");
      item.title = tip;
      item.appendChild(el("span", "display: inline-block; width: 10px; height: 2px; vertical-align: middle;" +
                              "margin-right: 3px; background: " + color + ";"));
      item.appendChild(document.createTextNode(text));
      legend.appendChild(item);
    }
    const plot = el("div", "display: grid; grid-template-columns: auto 1fr; column-gap: 3px; margin-top: 4px;");
    const yAxis = el("div", "display: flex; flex-direction: column; justify-content: space-between;" +
                            "text-align: right; opacity: 0.7; font-size: 9px;");
    this.axis = { yMax: el("span", "", ""), yMin: el("span", "", "") };
    yAxis.append(this.axis.yMax, this.axis.yMin);
    this.axis.yMax.dataset.field = "y_max";
    this.axis.yMin.dataset.field = "y_min";
    plot.appendChild(yAxis);
    const area = el("div", "position: relative;");
    this.canvas = el("canvas", "width: 100%; height: 44px; display: block;");
    this.canvas.width = 240;
    this.canvas.height = 44;
    area.append(this.canvas, legend);
    plot.appendChild(area);
    plot.appendChild(el("span"));
    const xAxis = el("div", "display: flex; justify-content: space-between; opacity: 0.7; font-size: 9px;" +
                            "line-height: 11px;");
    this.axis.xMin = el("span", "", "");
    this.axis.xMax = el("span", "", "");
    this.axis.xMin.dataset.field = "x_min";
    this.axis.xMax.dataset.field = "x_max";
    const xTitle = el("span", "", "video frames");
    xTitle.dataset.field = "x_title";
    xAxis.append(this.axis.xMin, xTitle, this.axis.xMax);
    plot.appendChild(xAxis);
    this.root.appendChild(plot);
    this.history = [];  // {x: video frames done, held, dense in GB}
    this.updates = 0;
  }

  update(d) {
    const status = d.status === "running" || d.status === "done" || d.status === "stopped" ? d.status : "running";
    const waiting = status === "running" && !(num(d.chunk) >= 1);  // started, no chunk reported yet
    this.status.textContent = "FAST-AR cache: " + (waiting ? "waiting for the first chunk" : status);
    this.fields.tokens.textContent = formatTokens(d.tokens);
    // the memory tier's archive (TempCache's recall_frames) lives in host memory, beside the device's
    this.fields.gb.textContent = waiting ? "–" : formatGB(d.held_gb) + " (alloc " + formatGB(d.gb) + ")" +
      (num(d.host_gb) > 0 ? " + host " + formatGB(d.host_gb) : "");
    this.fields.relative.textContent = formatPercent(d.relative) + " of " + formatGB(d.dense_gb);
    // video frames (what the sampler's length counts), the latent frames the model generates below them
    this.fields.frames.textContent = formatFrames(d.video_frames_done, d.video_total_frames) + " video";
    this.fields.latent.textContent = formatFrames(d.frames_done, d.total_frames);
    this.fields.latent.title = "latent frames: the first decodes to 1 video frame, every later one to 4";
    this.fields.rate.textContent = formatRate(d.chunks_per_s);
    // null: the rollout runs without AnnSA; absent: no chunk reported yet
    this.fields.annsa.textContent = d.annsa_density === null ? "off" : formatPercent(d.annsa_density);
    this.fields.annsa_sparse.textContent = d.annsa_sparse === null ? "off"
      : Number.isFinite(num(d.annsa_sparse)) ? formatPercent(d.annsa_sparse) + " of layers" : "–";
    const prompt = num(d.prompt), prompts = num(d.prompts);
    this.fields.prompt.textContent = Number.isFinite(prompt) && Number.isFinite(prompts) ? prompt + " of " + prompts : "–";
    this.fields.engine.textContent = d.engine === "fused" || d.engine === "comfy" ? d.engine : "–";
    // a FAST-AR Video Stream's file: the video frames written so far (null / absent: no stream)
    const saved = num(d.video_frames_saved);
    const files = Array.isArray(d.video_files) ? d.video_files : [];
    this.fields.saved.textContent = Number.isFinite(saved) && files.length
      ? saved + " frames, " + files[0] + (files.length > 1 ? " +" + (files.length - 1) : "") : "–";
    this.fields.engine.title = typeof d.engine_reason === "string" ? d.engine_reason : "";
    const sampling = formatSampling(d.sampling);
    this.fields.sampling.textContent = sampling.text;
    this.fields.sampled_from.textContent = sampling.from;
    this.fields.sampling.title = this.fields.sampled_from.title = sampling.title;
    if (status === "running" && Number.isFinite(num(d.held_gb))) {
      if (num(d.chunk) === 1) this.history = [];
      const x = num(d.video_frames_done);
      this.history.push({ x: Number.isFinite(x) ? x : this.history.length + 1, held: num(d.held_gb),
                          dense: Number.isFinite(num(d.dense_gb)) ? num(d.dense_gb) : 0 });
      if (this.history.length > HISTORY) this.history.shift();
    }
    this.updates += 1;
    this.root.dataset.updates = String(this.updates);
    this.draw();
  }

  draw() {
    const c = this.canvas, g = c.getContext("2d");
    const h = this.history, a = this.axis;
    if (h.length === 0) {
      for (const k of ["yMax", "yMin", "xMin", "xMax"]) a[k].textContent = "";
      g?.clearRect(0, 0, c.width, c.height);
      return;
    }
    const top = Math.max(1e-12, ...h.map((p) => Math.max(p.held, p.dense)));
    const x0 = h.length === HISTORY ? h[0].x : 0, x1 = Math.max(h[h.length - 1].x, x0 + 1);
    a.yMax.textContent = formatGB(top);
    a.yMin.textContent = "0";
    a.xMin.textContent = String(x0);
    a.xMax.textContent = String(h[h.length - 1].x);
    if (!g) return;
    g.clearRect(0, 0, c.width, c.height);
    g.strokeStyle = "rgba(200,200,200,0.35)";  // the axes: y at the left, x at the bottom
    g.lineWidth = 1;
    g.beginPath();
    g.moveTo(0.5, 0);
    g.lineTo(0.5, c.height - 0.5);
    g.lineTo(c.width, c.height - 0.5);
    g.stroke();
    const x = (v) => 2 + ((v - x0) * (c.width - 4)) / (x1 - x0);
    const y = (v) => c.height - 2 - (v / top) * (c.height - 4);
    const line = (key, color) => {
      g.strokeStyle = color;
      g.lineWidth = 1.5;
      g.beginPath();
      h.forEach((p, i) => (i ? g.lineTo(x(p.x), y(p[key])) : g.moveTo(x(p.x), y(p[key]))));
      if (h.length === 1) g.lineTo(x(h[0].x) - 3, y(h[0][key]));  // one point: a short tick, still visible
      g.stroke();
    };
    line("dense", DENSE_COLOR);  // what a dense cache would hold
    line("held", HELD_COLOR);    // what this cache holds
  }
}

const views = new Map();  // node id -> CacheView

app.registerExtension({
  name: "FastAR.CacheWidget",

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!NODE_TYPES.has(nodeData?.name)) return;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = onNodeCreated?.apply(this, arguments);
      const view = new CacheView();
      const widget = this.addDOMWidget("fastar_cache", "fastar_cache", view.root,
                                       { serialize: false, getMinHeight: () => 276 });
      if (widget) widget.serialize = false;
      this.fastarCacheView = view;
      views.set(String(this.id), view);
      const onRemoved = this.onRemoved;
      this.onRemoved = function () {
        views.delete(String(this.id));
        return onRemoved?.apply(this, arguments);
      };
      return result;
    };
  },

  setup() {
    api.addEventListener(EVENT, (event) => {
      const d = event?.detail;
      if (!d || typeof d !== "object") return;
      let view = views.get(String(d.node));
      if (!view) {
        const node = app.graph?.getNodeById?.(Number(d.node));
        view = node?.fastarCacheView;
      }
      view?.update(d);
    });
  },
});
