// FAST-AR Prompt Schedule: a start_i whose prompt_i is unconnected does nothing, so its widget says so
// ("start_4 (no prompt_4)", greyed) until a prompt is connected to that slot.
import { app } from "../../scripts/app.js";

const SLOTS = [2, 3, 4];

function showUnusedStarts(node) {
  for (const i of SLOTS) {
    const widget = node.widgets?.find((w) => w.name === "start_" + i);
    const input = node.inputs?.find((s) => s.name === "prompt_" + i);
    if (!widget || !input) continue;
    const used = input.link != null;
    widget.label = used ? undefined : "start_" + i + " (no prompt_" + i + ")";
    widget.disabled = !used;
  }
  node.setDirtyCanvas?.(true, true);
}

app.registerExtension({
  name: "FastAR.PromptSchedule",

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name !== "FastARPromptSchedule") return;
    for (const hook of ["onNodeCreated", "onConfigure", "onConnectionsChange"]) {
      const original = nodeType.prototype[hook];
      nodeType.prototype[hook] = function () {
        const result = original?.apply(this, arguments);
        showUnusedStarts(this);
        return result;
      };
    }
  },
});
