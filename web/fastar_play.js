// FAST-AR World Play: the node's button opens the play page of the session it runs. Queued, the node
// sends `fastar.play` (its id, the page's address with the session's token) to the page that queued
// it only; the button then opens that address in a new tab.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const NODE_TYPE = "FastARWorldPlay";
const IDLE_LABEL = "open the play page (queue first)";

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
  },

  setup() {
    api.addEventListener("fastar.play", (event) => {
      const d = event?.detail;
      if (!d || typeof d.url !== "string" || !d.url.startsWith("/fastar/play/")) return;
      const node = app.graph?.getNodeById?.(Number(d.node));
      if (!node?.fastarPlayButton) return;
      node.fastarPlayUrl = d.url;
      node.fastarPlayButton.label = "▶ play " + String(d.world ?? "the world") + " (session open)";
      node.setDirtyCanvas?.(true, true);
    });
  },
});
