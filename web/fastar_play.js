// FAST-AR World Play: the node's button opens the play page of the session it runs. Queued, the node
// sends `fastar.play` (its id, the page's address with the session's token) to the page that queued
// it only; the button then opens that address in a new tab, until the session ends (its page is gone then).
// The width / height widgets are Matrix-Game 2.0's: hidden while the world comes from FAST-AR World Model.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const NODE_TYPE = "FastARWorldPlay";
const IDLE_LABEL = "open the play page (queue first)";
const ENDED_LABEL = "session ended: queue again to play";
const SIZE_WIDGETS = ["width", "height"];
const FIXED_SIZE_WORLDS = ["FastARWorldModel"];  // worlds of their own size: the size widgets do nothing

// Hidden widgets: `hidden` is what both frontends' layouts and drawing skip; the older one (1.27) still
// leaves a hidden widget its height when it arranges them, unless its computeSize says none.
function showSizeWidgets(node) {
  const slot = node.inputs?.findIndex((i) => i.name === "world") ?? -1;
  const source = slot >= 0 ? node.getInputNode?.(slot) : null;
  const hide = !!source && FIXED_SIZE_WORLDS.includes(source.type);
  let changed = false;
  for (const widget of node.widgets ?? []) {
    if (!SIZE_WIDGETS.includes(widget.name) || !!widget.hidden === hide) continue;
    changed = true;
    widget.hidden = hide;
    if (widget.options) widget.options.hidden = hide;
    if (hide) {
      widget.fastarComputeSize = widget.computeSize;
      widget.computeSize = () => [0, -4];
    } else {
      widget.computeSize = widget.fastarComputeSize;
      if (!widget.computeSize) delete widget.computeSize;
    }
  }
  if (changed) {
    node.setSize?.([node.size[0], node.computeSize()[1]]);
    node.setDirtyCanvas?.(true, true);
  }
}

app.registerExtension({
  name: "FastAR.WorldPlay",

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name !== NODE_TYPE) return;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = onNodeCreated?.apply(this, arguments);
      const button = this.addWidget("button", "fastar_play", null, () => {
        if (this.fastarPlayUrl) window.open(this.fastarPlayUrl, "_blank");
      }, { serialize: false });
      button.label = IDLE_LABEL;
      button.serialize = false;
      this.fastarPlayButton = button;
      return result;
    };
    const onConnectionsChange = nodeType.prototype.onConnectionsChange;
    nodeType.prototype.onConnectionsChange = function () {
      const result = onConnectionsChange?.apply(this, arguments);
      showSizeWidgets(this);
      return result;
    };
  },

  loadedGraphNode(node) {
    if (node.type === NODE_TYPE) showSizeWidgets(node);
  },

  setup() {
    api.addEventListener("fastar.play", (event) => {
      const d = event?.detail;
      const node = d && app.graph?.getNodeById?.(Number(d.node));
      if (!node?.fastarPlayButton) return;
      if (d.state === "ended") {
        if (d.session !== node.fastarPlaySession) return;  // an older session's end
        node.fastarPlayUrl = null;
        node.fastarPlayButton.label = ENDED_LABEL;
      } else {
        if (typeof d.url !== "string" || !d.url.startsWith("/fastar/play/")) return;
        node.fastarPlayUrl = d.url;
        node.fastarPlaySession = d.session;
        node.fastarPlayButton.label = "▶ play " + String(d.world ?? "the world") + " (session open)";
      }
      node.setDirtyCanvas?.(true, true);
    });
  },
});
