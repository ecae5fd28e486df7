"""The pack without ComfyUI: imports, the web extension and the example workflows' structure. These need no
ComfyUI tree and run everywhere; marked ``comfyui``, they also run in each ComfyUI tree's environment, where
ComfyUI's own packages are importable and must still not be pulled in by importing the pack."""
import json
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.comfyui

REPO = Path(__file__).resolve().parents[1]
# the template files: their names are the titles ComfyUI shows on the template cards
FASTAR = "FAST-AR - long video (TempCache)"
DENSE = "FAST-AR - dense baseline (every frame kept)"
CORE_AR = "FAST-AR - ComfyUI AR video graph (needs Empty AR Video Latent)"
STOCK_AR = "FAST-AR - AR video graph on stock nodes (Empty Hunyuan Latent Video)"
WORLD = "FAST-AR - world model, no download (TempCache against the window)"
MATRIX_GAME = "FAST-AR - Matrix-Game 2.0 "  # a template per published file
PLAY = "FAST-AR - play the world live (no download)"
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
    for page in (js, (REPO / "web" / "fastar_play.js").read_text(), (REPO / "web" / "fastar_play.html").read_text()):
        assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write", page)


def test_example_workflows_are_wired():
    paths = sorted((REPO / "example_workflows").glob("*.json"))
    assert len(paths) >= 2
    for path in paths:
        wf = json.loads(path.read_text())
        nodes = {n["id"]: n for n in wf["nodes"]}
        types = {n["type"] for n in nodes.values()}
        if path.stem == WORLD:
            assert {"FastARWorldModel", "FastARActionSchedule", "FastARWorldSampler"} <= types
        elif path.stem == PLAY:
            assert {"FastARWorldModel", "FastARWorldPlay"} <= types
        elif path.stem.startswith(MATRIX_GAME):
            assert {"FastARMatrixGameLoader", "CLIPVisionEncode", "FastARStartImage", "FastARActionSchedule",
                    "FastARMatrixGameSampler"} <= types
        else:
            sampler = "FastARARVideo" if "SamplerCustom" in types else "FastARAutoregressiveSampler"
            assert {"FastARPatchModel", sampler} <= types
        for link_id, origin, slot, target, target_slot, type_ in wf["links"]:
            assert nodes[origin]["outputs"][slot]["type"] == type_
            assert link_id in nodes[origin]["outputs"][slot]["links"]
            assert nodes[target]["inputs"][target_slot]["link"] == link_id
    modes = {p.stem: {n["type"]: n["mode"] for n in json.loads(p.read_text())["nodes"]} for p in paths}
    assert set(modes[DENSE].values()) == {0}  # nothing bypassed
    assert modes[FASTAR]["FastARPatchModel"] == 0
    assert modes[CORE_AR]["FastARARVideo"] == 0
    assert "SamplerARVideo" not in modes[CORE_AR]  # ours in its place
    # the stock-node variant: the same graph but for the latent node
    assert {**modes[CORE_AR], "EmptyHunyuanLatentVideo": 0} == {**modes[STOCK_AR], "EmptyARVideoLatent": 0}


def test_fastar_workflows_run_fastar_at_the_defaults():
    """The FAST-AR templates feed TempCache Settings at the library's defaults into the patch, and no ANN
    Sparsity (off by default: it does not pay at the default budget)."""
    for path in sorted((REPO / "example_workflows").glob("*.json")):
        if path.stem not in (DENSE, WORLD, PLAY) and not path.stem.startswith(MATRIX_GAME):
            _check_fastar_at_the_defaults(json.loads(path.read_text()))


def test_the_world_template_flies_the_demos_route_with_tempcache_and_the_window():
    """The no-download template: the pack's world over the demo's out-and-back (``fastar``'s default route),
    one sampler on TempCache at its defaults and one on LongLive's sink 3 + window 12."""
    import torch

    from comfyui_fastar.fastar import CacheConfig, TempCacheConfig
    from comfyui_fastar.fastar.actions import ActionSpec, integrate, parse_actions

    wf = json.loads((REPO / "example_workflows" / f"{WORLD}.json").read_text())
    nodes = {n["id"]: n for n in wf["nodes"]}
    by_type = {}
    for n in nodes.values():
        by_type.setdefault(n["type"], []).append(n)
    (schedule,) = by_type["FastARActionSchedule"]
    text = parse_actions(schedule["widgets_values"][0], ActionSpec(), 12)
    poses = integrate(torch.from_numpy(text), ActionSpec())
    assert len(text) == 24 + 96 + 12  # a lead-in, the loop, the way back over its start
    assert all(torch.allclose(poses[f], poses[f - 96]) for f in range(120, 132))
    assert (poses[24:120, 0] - poses[23, 0]).abs().max() > 64  # the loop takes the place out of view
    t, w = TempCacheConfig(), CacheConfig()
    assert by_type["FastARTempCacheSettings"][0]["widgets_values"] == [t.enabled, t.merge_threshold, t.max_cache_frames,
                                                                       t.sink_frames, t.recall_frames]
    assert by_type["FastARWindowCache"][0]["widgets_values"] == [w.sink_frames, w.window_frames, False]
    assert [n["widgets_values"][0] for n in by_type["FastARWorldSampler"]] == [36, 36]  # shown up to the loop
    # a fair comparison on every Run: one noise seed, saved fixed (the frontend would add "randomize"), one route_seed
    assert [n["widgets_values"][1:] for n in by_type["FastARWorldSampler"]] == [[0, "fixed", 0]] * 2
    (note,) = by_type["Note"]
    assert "same route with the same noise on every Run" in note["widgets_values"][0]
    assert len(by_type["SaveAnimatedWEBP"]) == 3


def _check_fastar_at_the_defaults(wf):
    from comfyui_fastar.fastar import TempCacheConfig

    nodes = {n["id"]: n for n in wf["nodes"]}
    patch = next(n for n in nodes.values() if n["type"] == "FastARPatchModel")
    feeds = {i["name"]: nodes[next(l[1] for l in wf["links"] if l[0] == i["link"])]["type"]
             for i in patch["inputs"] if i["link"] is not None}
    assert feeds == {"model": "UNETLoader", "cache": "FastARTempCacheSettings"}
    t = TempCacheConfig()
    by_type = {n["type"]: n["widgets_values"] for n in nodes.values()}
    assert "FastARAnnSparsity" not in by_type
    assert by_type["FastARTempCacheSettings"] == [t.enabled, t.merge_threshold, t.max_cache_frames, t.sink_frames,
                                                  t.recall_frames]


def test_dense_baseline_workflow_keeps_every_frame_without_sparsity():
    wf = json.loads((REPO / "example_workflows" / f"{DENSE}.json").read_text())
    nodes = {n["id"]: n for n in wf["nodes"]}
    patch = next(n for n in nodes.values() if n["type"] == "FastARPatchModel")
    feeds = {i["name"]: nodes[next(l[1] for l in wf["links"] if l[0] == i["link"])]
             for i in patch["inputs"] if i["link"] is not None}
    assert set(feeds) == {"model", "cache"} and feeds["cache"]["type"] == "FastARWindowCache"
    assert feeds["cache"]["widgets_values"][-1] is True  # unbounded


def test_the_error_type_is_named_by_the_package():
    """ComfyUI shows an error's type by its module path: the package's name, not the folder's path."""
    import pickle

    from comfyui_fastar.fastar import FastARError

    assert f"{FastARError.__module__}.{FastARError.__qualname__}" == "comfyui_fastar.FastARError"
    err = pickle.loads(pickle.dumps(FastARError("length 22 is not 1 + 4k")))
    assert type(err) is FastARError and str(err) == "length 22 is not 1 + 4k"
