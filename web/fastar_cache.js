// FAST-AR cache widget: live KV-cache size on the Autoregressive Long Sampler and FAST-AR AR Video nodes.
//
// The sampler sends `fastar.cache` events (PromptServer.send_sync) after every chunk with plain
// numbers: tokens, GB, dense-equivalent size, frames done / total, chunk latency, AnnSA's density (the
// share of the cached keys its plans read; null without AnnSA), which prompt of a prompt schedule is
// active, and which engine runs the forwards
// ("fused" or "comfy", with the reason as the row's tooltip). Everything shown is formatted here from
// numbers or picked from known words; no string from the server is ever inserted as HTML.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const NODE_TYPES = new Set(["FastARAutoregressiveSampler", "FastARARVideo"]);
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
                                ["frames", "frames"], ["rate", "speed"], ["annsa", "AnnSA reads"],
                                ["prompt", "prompt"], ["engine", "engine"]]) {
      grid.appendChild(el("span", "opacity: 0.7;", label));
      const v = el("span", "text-align: right;", "–");
      v.dataset.field = key;
      grid.appendChild(v);
      this.fields[key] = v;
    }
    this.root.appendChild(grid);
    this.canvas = el("canvas", "width: 100%; height: 48px; display: block; margin-top: 4px;");
    this.canvas.width = 240;
    this.canvas.height = 48;
    this.root.appendChild(this.canvas);
    this.history = [];  // {held, dense} in GB
    this.updates = 0;
  }

  update(d) {
    const status = d.status === "running" || d.status === "done" || d.status === "stopped" ? d.status : "running";
    const done = num(d.frames_done), total = num(d.total_frames);
    const waiting = status === "running" && !(num(d.chunk) >= 1);  // started, no chunk reported yet
    this.status.textContent = "FAST-AR cache: " + (waiting ? "waiting for the first chunk" : status);
    this.fields.tokens.textContent = formatTokens(d.tokens);
    this.fields.gb.textContent = waiting ? "–" : formatGB(d.held_gb) + " (alloc " + formatGB(d.gb) + ")";
    this.fields.relative.textContent = formatPercent(d.relative) + " of " + formatGB(d.dense_gb);
    this.fields.frames.textContent = (Number.isFinite(done) ? done : "–") + " / " + (Number.isFinite(total) ? total : "–");
    this.fields.rate.textContent = formatRate(d.chunks_per_s);
    // null: the rollout runs without AnnSA; absent: no chunk reported yet
    this.fields.annsa.textContent = d.annsa_density === null ? "off" : formatPercent(d.annsa_density);
    const prompt = num(d.prompt), prompts = num(d.prompts);
    this.fields.prompt.textContent = Number.isFinite(prompt) && Number.isFinite(prompts) ? prompt + " of " + prompts : "–";
    this.fields.engine.textContent = d.engine === "fused" || d.engine === "comfy" ? d.engine : "–";
    this.fields.engine.title = typeof d.engine_reason === "string" ? d.engine_reason : "";
    if (status === "running" && Number.isFinite(num(d.held_gb))) {
      if (num(d.chunk) === 1) this.history = [];
      this.history.push({ held: num(d.held_gb), dense: Number.isFinite(num(d.dense_gb)) ? num(d.dense_gb) : 0 });
      if (this.history.length > HISTORY) this.history.shift();
    }
    this.updates += 1;
    this.root.dataset.updates = String(this.updates);
    this.draw();
  }

  draw() {
    const c = this.canvas, g = c.getContext("2d");
    if (!g) return;
    g.clearRect(0, 0, c.width, c.height);
    const h = this.history;
    if (h.length === 0) return;
    const top = Math.max(1e-12, ...h.map((p) => Math.max(p.held, p.dense)));
    const x = (i) => (h.length === 1 ? c.width - 2 : 2 + (i * (c.width - 4)) / (h.length - 1));
    const y = (v) => c.height - 2 - (v / top) * (c.height - 4);
    const line = (key, color) => {
      g.strokeStyle = color;
      g.lineWidth = 1.5;
      g.beginPath();
      h.forEach((p, i) => (i ? g.lineTo(x(i), y(p[key])) : g.moveTo(x(i), y(p[key]))));
      g.stroke();
    };
    line("dense", "rgba(200,200,200,0.5)");  // what a dense cache would hold
    line("held", "#4fc3f7");                 // what this cache holds
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
                                       { serialize: false, getMinHeight: () => 184 });
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
