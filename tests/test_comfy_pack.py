"""The pack without ComfyUI: imports, the web extension and the example workflows' structure."""
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NODE_TYPES = {"FastARPatchModel", "FastARTempCacheSettings", "FastARAutoregressiveSampler"}


def test_pack_imports_without_comfyui():
    import comfyui_fastar
    import comfyui_fastar.nodes

    assert comfyui_fastar.WEB_DIRECTORY == "./web"
    assert callable(comfyui_fastar.comfy_entrypoint) and callable(comfyui_fastar.nodes.node_list)
    if "comfy" not in sys.modules:  # nothing above pulled ComfyUI in
        assert not any(m == "comfy_api" or m.startswith("comfy_api.") for m in sys.modules)


def test_web_extension_formats_numbers_itself():
    js = (REPO / "web" / "fastar_cache.js").read_text()
    assert 'api.addEventListener(EVENT' in js and 'const EVENT = "fastar.cache"' in js
    # text goes in through textContent only: no HTML built from what the server sends
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write", js)


def test_example_workflows_are_wired():
    paths = sorted((REPO / "example_workflows").glob("*.json"))
    assert len(paths) >= 2
    for path in paths:
        wf = json.loads(path.read_text())
        nodes = {n["id"]: n for n in wf["nodes"]}
        assert {"FastARPatchModel", "FastARAutoregressiveSampler"} <= {n["type"] for n in nodes.values()}
        for link_id, origin, slot, target, target_slot, type_ in wf["links"]:
            assert nodes[origin]["outputs"][slot]["type"] == type_
            assert link_id in nodes[origin]["outputs"][slot]["links"]
            assert nodes[target]["inputs"][target_slot]["link"] == link_id
    modes = {p.stem: {n["type"]: n["mode"] for n in json.loads(p.read_text())["nodes"]} for p in paths}
    assert modes["fastar_long_t2v_wan21_dense_baseline"]["FastARPatchModel"] == 4  # bypassed
    assert modes["fastar_long_t2v_wan21_self_forcing"]["FastARPatchModel"] == 0
