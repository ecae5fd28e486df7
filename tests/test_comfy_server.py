"""A headless ComfyUI server (``main.py --cpu``) with the pack in ``custom_nodes/``.

Needs a ComfyUI checkout with ``main.py`` at ``COMFYUI_PATH``; skipped otherwise. The server runs
from a temporary base directory holding the pack (a symlink), a tiny random Wan 2.1 checkpoint in
``models/diffusion_models/`` and a test-only node that emits a conditioning tensor (no text
encoder weights exist here).
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch

from comfyui_fastar.testing import comfy_frontend, comfy_harness

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
pytestmark = [pytest.mark.comfyui,
              pytest.mark.skipif(bool(COMFYUI_PATH) and not Path(COMFYUI_PATH, "main.py").is_file(),
                                 reason="COMFYUI_PATH does not name a ComfyUI checkout with main.py")]

REPO = Path(__file__).resolve().parents[1]
NODES = {"FastARPatchModel", "FastARTempCacheSettings", "FastARWindowCache", "FastARAnnSparsity",
         "FastARAutoregressiveSampler", "FastARARVideo", "FastARPromptSchedule", "FastARSaveVideo",
         "FastARVideoStream", "FastARWorldModel", "FastARActionSchedule", "FastARWorldSampler",
         "FastARMatrixGameLoader", "FastARMatrixGameSampler", "FastARWorldPlay",
         "FastARLoadFastDecoder"}

TEST_NODE = '''
import torch


class FastARTestConditioning:
    """Test only: random prompt features standing in for a text encoder."""
    CATEGORY = "testing"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2**31}),
                             "tokens": ("INT", {"default": 16, "min": 1, "max": 512}),
                             "width": ("INT", {"default": 4096, "min": 1, "max": 8192})}}

    def make(self, seed, tokens, width):
        g = torch.Generator().manual_seed(seed)
        return ([[torch.randn(1, tokens, width, generator=g), {}]],)


class EmptyARVideoLatentLayout:
    """Test only, on a ComfyUI without core's autoregressive nodes: Empty AR Video Latent's inputs, so the
    frontend lays the core-AR template out as a ComfyUI with those nodes does (thumbnails, overlap test)."""
    CATEGORY = "testing"
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"width": ("INT", {"default": 832, "min": 16, "max": 8192, "step": 16}),
                             "height": ("INT", {"default": 480, "min": 16, "max": 8192, "step": 16}),
                             "length": ("INT", {"default": 81, "min": 1, "max": 1024, "step": 4}),
                             "batch_size": ("INT", {"default": 1, "min": 1, "max": 64})}}

    def make(self, width, height, length, batch_size):
        raise RuntimeError("layout stand-in only")


NODE_CLASS_MAPPINGS = {"FastARTestConditioning": FastARTestConditioning}
try:  # a classic checkout; the pip-installable trees that have core's nodes need no stand-in
    import nodes as _core

    if "EmptyARVideoLatent" not in _core.NODE_CLASS_MAPPINGS:
        NODE_CLASS_MAPPINGS["EmptyARVideoLatent"] = EmptyARVideoLatentLayout
except ImportError:
    pass
'''

@pytest.fixture(scope="module")
def server(comfy, tmp_path_factory):
    base = tmp_path_factory.mktemp("comfy_base")
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / "fastar_test_conditioning.py").write_text(TEST_NODE)
    models = base / "models" / "diffusion_models"
    models.mkdir(parents=True)
    # fastar_tiny.safetensors, and fastar_tiny_causal.safetensors that core ComfyUI loads as WAN21_CausalAR
    comfy_harness.write_wan(comfy_harness.tiny_wan(), models, "fastar_tiny")
    (base / "models" / "vae").mkdir()
    comfy_harness.wan_vae_file(base / "models" / "vae" / "fastar_tiny_vae.safetensors")
    with comfy_harness.comfy_server(base, REPO) as url_port:
        yield {**url_port, "base": base}


_free_port, _get, _fetch, _post, _run = (comfy_harness.free_port, comfy_harness.get_json, comfy_harness.fetch,
                                         comfy_harness.post_json, comfy_harness.run_prompt)


def _graph(length=9, chunk="1", cache_mode="unbounded", tempcache=False, ann=False, seed=3):
    graph = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "fastar_tiny.safetensors", "weight_dtype": "default"}},
        "2": {"class_type": "FastARTestConditioning", "inputs": {"seed": 1, "tokens": 16, "width": 4096}},
        "3": {"class_type": "FastARPatchModel", "inputs": {"model": ["1", 0]}},
        "4": {"class_type": "FastARAutoregressiveSampler", "inputs": {
            "model": ["3", 0], "positive": ["2", 0], "width": 32, "height": 32, "length": length, "batch_size": 1,
            "seed": seed, "timesteps": "1000,750,500,250", "shift": 5.0, "frames_per_chunk": chunk,
            "context_noise": 0.0, "cfg": 1.0}},
        "5": {"class_type": "SaveLatent", "inputs": {"samples": ["4", 0], "filename_prefix": f"fastar_{uuid.uuid4().hex[:8]}"}},
    }
    if tempcache:
        graph["6"] = {"class_type": "FastARTempCacheSettings", "inputs": {
            "enabled": True, "merge_threshold": 0.5, "max_cache_frames": 4, "sink_frames": 1}}
    else:
        graph["6"] = {"class_type": "FastARWindowCache", "inputs": {
            "sink_frames": 1, "window_frames": 2, "unbounded": cache_mode == "unbounded"}}
    graph["3"]["inputs"]["cache"] = ["6", 0]
    if ann:  # ANN Sparsity at its defaults
        graph["7"] = {"class_type": "FastARAnnSparsity", "inputs": {
            "annsa": True, "annca": False, "keep_mass": 0.95, "keep_fraction": 0.2, "dense_steps_fraction": 0.3}}
        graph["3"]["inputs"]["ann"] = ["7", 0]
    return graph


def test_object_info_lists_the_nodes(server):
    info = _get(server["url"] + "/object_info")
    assert NODES <= set(info)
    import importlib.util

    if importlib.util.find_spec("comfyui_fastar.fastar.ann") is not None:  # the core has ANN sparsity
        assert info["FastARAnnSparsity"]["output"] == ["FASTAR_ANN"]
        assert "ann" in info["FastARPatchModel"]["input"]["optional"]
    sampler = info["FastARAutoregressiveSampler"]
    assert sampler["category"] == "FAST-AR"
    required = sampler["input"]["required"]
    for name in ("model", "positive", "width", "height", "length", "seed", "timesteps", "shift",
                 "frames_per_chunk", "context_noise", "cfg"):
        assert name in required, name
    assert required["timesteps"][1]["default"] == "1000,750,500,250"
    assert "negative" in sampler["input"]["optional"]
    assert info["FastARPatchModel"]["output"] == ["MODEL"]
    assert info["FastARTempCacheSettings"]["output"] == info["FastARWindowCache"]["output"] == ["FASTAR_CACHE"]
    assert "cache" in info["FastARPatchModel"]["input"]["optional"]
    assert not {"cache_mode", "sink_frames", "window_frames"} & set(required)  # the cache is set in one place
    assert {n: info[n]["display_name"] for n in ("FastARPatchModel", "FastARARVideo", "FastARAnnSparsity")} == {
        "FastARPatchModel": "FAST-AR Patch Model", "FastARARVideo": "FAST-AR AR Video",
        "FastARAnnSparsity": "ANN Sparsity"}
    assert "seed" not in info["FastARAnnSparsity"]["input"]["required"]  # the frontend would randomize it


def test_the_startup_log_has_no_error_from_the_pack(server):
    """The pack loaded (its nodes are served), and the log before the first prompt says nothing bad of it
    (the pip-installable ComfyUI logged an ERROR for a pack without NODE_CLASS_MAPPINGS)."""
    assert NODES <= set(_get(server["url"] + "/object_info"))
    log = (server["base"] / "server.log").read_text().split("got prompt")[0]
    ours = [line for line in log.splitlines() if "ComfyUI-FastAR" in line or "comfyui_fastar" in line]
    assert [line for line in ours if any(w in line for w in ("ERROR", "Traceback", "Skip", "IMPORT FAILED"))] == []


def _latent_of(server, prompt_id):
    from safetensors.torch import load_file

    deadline = time.time() + 60  # the server stores the history just after it says the prompt is done
    while prompt_id not in (history := _get(server["url"] + f"/history/{prompt_id}")) and time.time() < deadline:
        time.sleep(0.2)
    history = history[prompt_id]
    errors = [m[1] for m in history["status"]["messages"] if m[0] == "execution_error"]
    assert history["status"]["status_str"] == "success", [(e.get("node_type"), e.get("exception_message"))
                                                          for e in errors] or history["status"]["messages"]
    files = sorted((server["base"] / "output").glob("**/*.latent"), key=os.path.getmtime)
    return load_file(str(files[-1]))["latent_tensor"]


def test_prompt_runs_and_streams_cache_events(server):
    prompt_id, events = asyncio.run(_run(server["url"], server["port"], _graph(length=9, chunk="1")))
    latent = _latent_of(server, prompt_id)
    assert latent.shape == (1, 16, 3, 4, 4) and torch.isfinite(latent).all()
    cache = [e["data"] for e in events if e["type"] == "fastar.cache"]
    running = [c for c in cache if c["status"] == "running" and c.get("chunk")]
    assert [c["chunk"] for c in running] == [1, 2, 3]
    assert [c["frames_done"] for c in running] == [1, 2, 3] and running[-1]["total_frames"] == 3
    # video frames beside them, what length counts (Wan: 1, then 4 per latent frame)
    assert [c["video_frames_done"] for c in running] == [1 + 4 * (c["frames_done"] - 1) for c in running]
    assert {c["video_total_frames"] for c in cache} == {9}  # the graph's length, from the first event on
    assert all(isinstance(c["gb"], float) and isinstance(c["tokens"], int) for c in running)
    assert all(c["annsa_density"] is None and c["annsa_sparse"] is None for c in running)  # no AnnSA here
    assert cache[-1]["status"] == "done" and cache[0]["node"] == "4"
    progress = [e["data"] for e in events if e["type"] == "progress" and e["data"].get("node") == "4"]
    assert progress and progress[-1]["value"] == progress[-1]["max"] == 3

    # The same graph again (new output name) gives the same latent: runs don't depend on each other.
    prompt_id, _ = asyncio.run(_run(server["url"], server["port"], _graph(length=9, chunk="1")))
    assert torch.equal(_latent_of(server, prompt_id), latent)


def _stream_graph(prefix, length):
    """The Long Sampler with a FAST-AR Video Stream (latent not kept) and nothing after it: its file is the
    graph's output."""
    graph = _graph(length=length, chunk="1", tempcache=True)
    del graph["5"]
    graph["8"] = {"class_type": "VAELoader", "inputs": {"vae_name": "fastar_tiny_vae.safetensors"}}
    graph["9"] = {"class_type": "FastARVideoStream", "inputs": {
        "vae": ["8", 0], "fps": 16.0, "filename_prefix": f"video/{prefix}", "keep_latent": False}}
    graph["4"]["inputs"]["stream"] = ["9", 0]
    return graph


def test_the_video_stream_grows_on_disk_while_the_run_goes_on_and_a_cancel_keeps_it(server):
    """The file read back while the server samples: at each chunk's event it decodes to at least the frames
    written but the newest (the writer at most two chunks behind), each the finished file's own, and it is read at least once before the end; the
    finished file is the whole video. Cancelled after three chunks, the same graph leaves a playable file
    of the frames written (at least those written by then), the start of the same video."""
    folder = server["base"] / "output" / "video"
    prefix, length = f"grow_{uuid.uuid4().hex[:8]}", 81  # 21 chunks of 1 latent frame
    reads = []

    def read(m, prefix):
        data = m.get("data", {})
        if m["type"] == "fastar.cache" and data.get("status") == "running" and data.get("chunk"):
            (path,) = folder.glob(f"{prefix}_*.mp4")
            reads.append((data["chunk"], data["video_frames_saved"], comfy_harness.read_video(path)[0]))

    prompt_id, events = asyncio.run(_run(server["url"], server["port"], _stream_graph(prefix, length),
                                         on_message=lambda m: read(m, prefix)))
    assert not [e for e in events if e["type"] == "execution_error"]
    (saved,) = _get(server["url"] + f"/history/{prompt_id}")[prompt_id]["outputs"]["4"]["images"]
    final, rate, size = comfy_harness.read_video(folder / saved["filename"])
    assert (len(final), size, rate) == (length, (32, 32), 16)
    assert [c for c, _, _ in reads] == list(range(1, 22))
    saved_counts = [s for _, s, _ in reads]  # the writer trails the sampler by the chunk waiting and the one at work
    assert saved_counts == sorted(saved_counts) and saved_counts[0] == 1
    assert all(1 + 4 * (max(c - 2, 1) - 1) <= s <= 1 + 4 * (c - 1) for c, s, _ in reads), saved_counts
    for _, written, frames in reads:
        assert written - 1 <= len(frames) <= length
        assert all((a == b).all() for a, b in zip(frames, final))
    assert any(len(frames) < length for _, _, frames in reads)  # read while the run went on

    prefix = f"cut_{uuid.uuid4().hex[:8]}"
    seen = []

    def cancel(m):
        data = m.get("data", {})
        if m["type"] == "fastar.cache" and data.get("status") == "running" and data.get("chunk") == 3:
            seen.append(data["video_frames_saved"])
            req = urllib.request.Request(server["url"] + "/interrupt", data=b"{}", method="POST",
                                         headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=10).close()

    _, events = asyncio.run(_run(server["url"], server["port"], _stream_graph(prefix, length), on_message=cancel))
    assert [e["type"] for e in events if e["type"] == "execution_interrupted"] == ["execution_interrupted"]
    (path,) = folder.glob(f"{prefix}_*.mp4")
    frames, rate, _ = comfy_harness.read_video(path)  # closed on the cancel: it plays
    assert len(seen) == 1 and 1 <= seen[0] <= len(frames) < length and rate == 16  # what was written stays
    assert all((a == b).all() for a, b in zip(frames, final))


def test_tempcache_prompt_runs(server):
    prompt_id, events = asyncio.run(_run(server["url"], server["port"], _graph(length=21, chunk="3", tempcache=True)))
    assert _latent_of(server, prompt_id).shape == (1, 16, 6, 4, 4)


def test_all_of_fastar_prompt_runs_and_reports_annsa_density(server):
    graph = _graph(length=21, chunk="3", tempcache=True, ann=True)
    prompt_id, events = asyncio.run(_run(server["url"], server["port"], graph))
    assert _latent_of(server, prompt_id).shape == (1, 16, 6, 4, 4)
    running = [e["data"] for e in events if e["type"] == "fastar.cache" and e["data"]["status"] == "running"
               and e["data"].get("chunk")]
    assert len(running) == 2 and all(0 < c["annsa_density"] <= 1 for c in running)
    assert all(0 <= c["annsa_sparse"] <= 1 for c in running)  # the share of AnnSA's layers that ran sparse


def test_ann_sparsity_at_its_defaults_runs_with_the_default_cache(server):
    """The graph a user builds first: ANN Sparsity at its defaults into FAST-AR Patch Model, no cache node,
    the sampler at its defaults (the cache is TempCache's, which carries AnnSA)."""
    graph = _graph(length=21, chunk="3", ann=True)
    del graph["3"]["inputs"]["cache"], graph["6"]
    prompt_id, events = asyncio.run(_run(server["url"], server["port"], graph))
    assert _latent_of(server, prompt_id).shape == (1, 16, 6, 4, 4)


def test_settings_that_cannot_run_together_fail_in_the_nodes_words(server):
    graph = _graph(length=9, chunk="1", cache_mode="window", ann=True)
    prompt_id, events = asyncio.run(_run(server["url"], server["port"], graph))
    error = next(e["data"] for e in events if e["type"] == "execution_error")
    assert error["node_type"] == "FastARPatchModel"
    assert error["exception_type"] == "comfyui_fastar.FastARError"  # not the pack folder's path
    assert error["exception_message"].startswith("FAST-AR Patch Model: ANN Sparsity's annsa reads a bucket-sorted "
                                                 "history, which a window cache does not keep")


def test_a_length_of_part_chunks_runs_whole_chunks_cut_to_it(server):
    prompt_id, events = asyncio.run(_run(server["url"], server["port"], _graph(length=13, chunk="3")))
    assert _latent_of(server, prompt_id).shape == (1, 16, 4, 4, 4)  # 6 latent frames generated, 4 kept
    cache = [e["data"] for e in events if e["type"] == "fastar.cache"]
    # the widget counts the video asked for, not the whole chunks' overshoot (6 latent frames: 21 video)
    assert [(c["frames_done"], c["total_frames"]) for c in cache if c.get("chunk")][-1] == (6, 6)
    assert {c["video_total_frames"] for c in cache} == {13} and cache[-1]["video_frames_done"] == 13
    assert [c["video_frames_done"] for c in cache if c["status"] == "running"] == [0, 9, 13]


@pytest.mark.parametrize("name, value, expected", [
    ("batch_size", 0, "value_smaller_than_min"),       # ComfyUI's own checks stay on for the inputs
    ("cfg", 0.5, "value_smaller_than_min"),            # validate_inputs does not read
    ("seed", -1, "value_smaller_than_min"),
    ("width", -32, "value_smaller_than_min"),
    ("height", 8192, "value_bigger_than_max"),
    ("length", 0, "value_smaller_than_min"),
])
def test_comfyuis_own_checks_give_one_error_on_the_input(server, name, value, expected):
    graph = _graph(length=9, chunk="1")
    graph["4"]["inputs"][name] = value
    status, body = _post(server["url"] + "/prompt", {"prompt": graph})
    assert status == 400, body
    errors = body["node_errors"]["4"]["errors"]
    assert [(e["extra_info"]["input_name"], e["type"]) for e in errors] == [(name, expected)], errors


# the timesteps a user typed that the pack refuses at /prompt, and the message that names the input
BAD_TIMESTEPS = [
    ("1000,1000", "Autoregressive Long Sampler: timesteps must be strictly decreasing, got [1000.0, 1000.0]"),
    ("250,500", "Autoregressive Long Sampler: timesteps must be strictly decreasing, got [250.0, 500.0]"),
    ("abc", "Autoregressive Long Sampler: timesteps must be comma-separated numbers, got 'abc'"),
    ("1200,500", "Autoregressive Long Sampler: timesteps must lie in (0, 1000], got [1200.0, 500.0]"),
    ("", "Autoregressive Long Sampler: timesteps: at least one denoising step is needed"),
]


def _refused(server, graph, node):
    """The errors /prompt returns for ``node`` of ``graph``: refused with a 400, nothing queued, no other
    node marked."""
    status, body = _post(server["url"] + "/prompt", {"prompt": graph})
    assert status == 400, body
    assert set(body["node_errors"]) == {node}, body["node_errors"]
    return body["node_errors"][node]["errors"]


def _custom_errors(errors, names, message):
    """ComfyUI puts a node's validate_inputs message on each input that function reads: exactly the
    inputs ``names`` the check is about, each with that one message."""
    assert sorted(e["extra_info"]["input_name"] for e in errors) == sorted(names), errors
    assert {e["type"] for e in errors} == {"custom_validation_failed"}, errors
    assert {e["details"].split(" - ", 1)[1] for e in errors} == {message}, errors


@pytest.mark.parametrize("value, message", BAD_TIMESTEPS, ids=[repr(v) for v, _ in BAD_TIMESTEPS])
def test_bad_timesteps_are_refused_at_prompt_in_one_message(server, value, message):
    graph = _graph(length=9, chunk="1")
    graph["4"]["inputs"]["timesteps"] = value
    _custom_errors(_refused(server, graph, "4"), ["timesteps"], message)


# what the page cannot send (it rounds width and height to 16 pixels and length to 1 + 4k frames, and
# offers the combo's options only) but a script can: refused as the node runs, before the rollout
SCRIPT_VALUES = [
    ("width", 100, "Autoregressive Long Sampler: width 100 is not a multiple of 16 pixels"),
    ("height", 40, "Autoregressive Long Sampler: height 40 is not a multiple of 16 pixels"),
    ("length", 22, "Autoregressive Long Sampler: length 22 is not 1 + 4k video frames (what Wan's VAE decodes to); "
                   "use 21 or 25"),
    ("frames_per_chunk", "2", "Autoregressive Long Sampler: frames_per_chunk '2' is not one of 3, 1"),
]


@pytest.mark.parametrize("name, value, message", SCRIPT_VALUES, ids=[f"{n}={v!r}" for n, v, _ in SCRIPT_VALUES])
def test_a_value_only_a_script_can_send_gives_one_error_in_the_nodes_words(server, name, value, message):
    graph = _graph(length=9, chunk="1")
    graph["4"]["inputs"][name] = value
    status, body = _post(server["url"] + "/prompt", {"prompt": graph})
    if status == 400:  # ComfyUI's own combo check (2026 on): one error, on that input
        errors = body["node_errors"]["4"]["errors"]
        assert name == "frames_per_chunk" and [(e["extra_info"]["input_name"], e["type"]) for e in errors] == [
            (name, "value_not_in_list")], errors
        return
    assert status == 200, body
    _, events = asyncio.run(_run(server["url"], server["port"], graph))
    (error,) = [e["data"] for e in events if e["type"] == "execution_error"]
    assert error["node_id"] == "4" and error["exception_message"].strip() == message, error


def test_a_tempcache_budget_with_no_room_for_a_chunk_is_refused_at_prompt(server):
    graph = _graph(length=9, chunk="3", tempcache=True)
    graph["6"]["inputs"].update(max_cache_frames=4, sink_frames=3)
    _custom_errors(_refused(server, graph, "6"), ["max_cache_frames", "sink_frames"],
                   "TempCache Settings: max_cache_frames 4 leaves 1 frame of history beside 3 frames of sink, less "
                   "than one chunk of 3 frames; set max_cache_frames to at least 6 or sink_frames to at most 1")


def _start_image_graph(vae=True):
    graph = _graph(length=9, chunk="1")
    graph["10"] = {"class_type": "EmptyImage", "inputs": {"width": 48, "height": 32, "batch_size": 1, "color": 0x7f3f1f}}
    graph["11"] = {"class_type": "FastARStartImage", "inputs": {"image": ["10", 0]}}
    if vae:
        graph["12"] = {"class_type": "VAELoader", "inputs": {"vae_name": "fastar_tiny_vae.safetensors"}}
        graph["11"]["inputs"]["vae"] = ["12", 0]
    graph["4"]["inputs"]["start"] = ["11", 0]
    return graph


def test_a_start_image_without_its_vae_is_refused_at_prompt_and_with_it_runs(server):
    errors = _refused(server, _start_image_graph(vae=False), "11")
    assert [(e["extra_info"]["input_name"], e["type"]) for e in errors] == [("vae", "required_input_missing")], errors
    prompt_id, events = asyncio.run(_run(server["url"], server["port"], _start_image_graph()))
    assert _latent_of(server, prompt_id).shape == (1, 16, 3, 4, 4)  # the image's latent frame, then 2 chunks of 1


def _recorded_model(server, name):
    """The tiny model as ``name`` in the server's diffusion_models, recording CausVid's sampling (3 latent
    frames a block, steps 1000,757,522, shift 1), as ``fastar convert --preset causvid`` records it."""
    from safetensors.torch import save_file

    from comfyui_fastar.fastar.models import SAMPLING_METADATA_KEY, Sampling
    from comfyui_fastar.testing.comfy_harness import tiny_wan

    save_file({k: v.contiguous() for k, v in tiny_wan().state_dict().items()},
              str(server["base"] / "models" / "diffusion_models" / name),
              metadata={SAMPLING_METADATA_KEY: Sampling(3, (1000, 757, 522), 1.0, "causvid").to_json()})


def test_the_node_shows_how_it_sampled_and_whose_settings_those_were(server):
    """The cache widget's events carry the sampling the rollout used and where it came from: the widgets
    where the model's file records none, the file's record over widgets that say otherwise (the file
    found through the graph's Load Diffusion Model, on every ComfyUI)."""
    def sampling_shown(graph):
        _, events = asyncio.run(_run(server["url"], server["port"], graph))
        shown = [e["data"]["sampling"] for e in events if e["type"] == "fastar.cache"]
        assert shown and all(s == shown[0] for s in shown), shown
        return shown[0]

    assert sampling_shown(_graph(length=9, chunk="1")) == {
        "frames_per_chunk": 1, "timesteps": [1000, 750, 500, 250], "shift": 5.0,
        "source": "as the widgets say: fastar_tiny.safetensors records no sampling (fastar convert --preset writes it)"}
    name = "recorded_tiny.safetensors"
    _recorded_model(server, name)
    graph = _graph(length=9, chunk="1")
    graph["1"]["inputs"]["unet_name"] = name
    assert sampling_shown(graph) == {"frames_per_chunk": 3, "timesteps": [1000, 757, 522], "shift": 1.0,
                                     "source": f"as {name} records (checkpoint_sampling), not the widgets"}
    graph["4"]["inputs"]["checkpoint_sampling"] = False
    graph["4"]["inputs"]["frames_per_chunk"] = "3"
    assert sampling_shown(graph)["source"] == "as the widgets say (checkpoint_sampling off)"


def _schedule_graph(starts: dict, connected=(2, 3)):
    graph = _graph(length=45, chunk="3")
    graph["8"] = {"class_type": "FastARPromptSchedule", "inputs": {"prompt_1": ["2", 0]}}
    for i in (2, 3, 4):
        graph["8"]["inputs"][f"start_{i}"] = starts.get(i, 80 * (i - 1))
        if i in connected:
            graph[f"9{i}"] = {"class_type": "FastARTestConditioning", "inputs": {"seed": i, "tokens": 16, "width": 4096}}
            graph["8"]["inputs"][f"prompt_{i}"] = [f"9{i}", 0]
    graph["4"]["inputs"]["prompts"] = ["8", 0]
    return graph


def test_prompt_schedule_starts_that_decrease_are_refused_at_prompt(server):
    errors = _refused(server, _schedule_graph({2: 21, 3: 9}), "8")
    # the order of the starts is one check over all of them: on each start and each connected prompt
    _custom_errors(errors, ["start_2", "start_3", "start_4", "prompt_2", "prompt_3"],
                   "FAST-AR Prompt Schedule: start_3 (9) must come after start_2 (21); the prompts start in order")
    # the start of a slot whose prompt is not connected is not part of the schedule: nothing refused
    status, body = _post(server["url"] + "/prompt", {"prompt": _schedule_graph({2: 21, 3: 9}, connected=(2,))})
    assert status == 200, body


def _ar_video_graph(block):
    """FAST-AR AR Video as SamplerCustom's sampler on the tiny model (stock nodes only around it)."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "fastar_tiny.safetensors", "weight_dtype": "default"}},
        "2": {"class_type": "FastARTestConditioning", "inputs": {"seed": 1, "tokens": 16, "width": 4096}},
        "3": {"class_type": "FastARPatchModel", "inputs": {"model": ["1", 0]}},
        "4": {"class_type": "FastARARVideo", "inputs": {"num_frame_per_block": block}},
        "5": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 32, "height": 32, "length": 9,
                                                                  "batch_size": 1}},
        "6": {"class_type": "BasicScheduler", "inputs": {"model": ["3", 0], "scheduler": "simple", "steps": 4,
                                                         "denoise": 1.0}},
        "7": {"class_type": "SamplerCustom", "inputs": {
            "model": ["3", 0], "add_noise": True, "noise_seed": 0, "cfg": 1.0, "positive": ["2", 0],
            "negative": ["2", 0], "sampler": ["4", 0], "sigmas": ["6", 0], "latent_image": ["5", 0]}},
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": f"fastar_{uuid.uuid4().hex[:8]}"}},
    }


@pytest.mark.parametrize("block", [2, 4, 64])
def test_ar_video_refuses_a_block_size_no_causal_checkpoint_has_at_prompt(server, block):
    errors = _refused(server, _ar_video_graph(block), "4")
    assert [(e["extra_info"]["input_name"], e["type"]) for e in errors] == [
        ("num_frame_per_block", "custom_validation_failed")], errors  # its one input: one error
    assert errors[0]["details"].startswith(f"num_frame_per_block - FAST-AR AR Video: num_frame_per_block {block} "
                                           f"is not a block size a causal Wan 2.1 checkpoint is trained with: 1 "
                                           f"(framewise")


def test_ar_video_runs_a_trained_block_size_and_warns_of_a_model_without_causal_metadata(server):
    """Block 1 over a stock-latent graph runs; the log says the model is not known to be causal (a plain
    Wan 2.1 file here), and on a CPU server the engine line speaks of no CUDA graphs."""
    log = server["base"] / "server.log"
    before = len(log.read_text())
    prompt_id, events = asyncio.run(_run(server["url"], server["port"], _ar_video_graph(1)))
    assert _latent_of(server, prompt_id).shape == (1, 16, 3, 4, 4)
    said = log.read_text()[before:]
    if CORE_AR:  # a ComfyUI that loads marked files as its causal model: this file carries no mark
        assert "FAST-AR AR Video: the model carries no causal metadata" in said, said[-3000:]
    else:  # said once a server, by whichever sampler ran first
        said = log.read_text()
        assert said.count("this ComfyUI loads every Wan 2.1 T2V file as WanModel") == 1, said[-3000:]


def test_the_engine_line_on_a_cpu_server_names_the_cpu_and_no_cuda_graphs(server):
    prompt_id, events = asyncio.run(_run(server["url"], server["port"], _graph(length=9, chunk="1")))
    _latent_of(server, prompt_id)
    lines = [line for line in (server["base"] / "server.log").read_text().splitlines() if ": engine " in line]
    assert lines, "no engine line in the log"
    assert all("CUDA graphs" not in line or "no CUDA graphs" in line for line in lines), lines
    assert any("engine fused (FAST-AR's forward over the model's weights on cpu, op by op, no CUDA graphs)" in line
               for line in lines), lines


def test_convert_in_the_comfyui_python_refuses_a_pt_in_the_packs_words(server, tmp_path):
    """The README's convert line, run with ComfyUI's Python in the ComfyUI folder on a .pt carrying code and
    on one carrying a config object: refused, nothing written, no advice to switch the check off."""
    import argparse

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)

    for name, extra in (("evil.pt", Payload()), ("trained.pt", argparse.Namespace(lr=1e-5))):
        src, dst = tmp_path / name, server["base"] / "models" / "diffusion_models" / f"{name}.safetensors"
        torch.save({"generator_ema": {"blocks.0.self_attn.q.weight": torch.zeros(4, 4)}, "extra": extra}, src)
        run = subprocess.run([sys.executable, str(server["base"] / "custom_nodes" / "ComfyUI-FastAR" / "convert.py"),
                              str(src), str(dst)], cwd=server["base"], capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and not dst.exists() and not (tmp_path / "ran").exists(), run
        said = run.stderr
        assert said.startswith(f"fastar: error: {name} ") and "Traceback" not in said, said
        assert "weights_only=False" not in said and "weights_only set to False" not in said, said
        if name == "evil.pt":
            assert "carries code: loading it would call" in said and "python -c" not in said, said
        else:
            assert "holds an object of argparse.Namespace" in said and "nothing in the file ran" in said, said
            assert "torch.serialization.add_safe_globals([argparse.Namespace])" in said, said


def test_a_refused_pts_pasted_commands_run_in_the_comfyui_folder_and_convert_it(server, tmp_path):
    """A .pt holding a config object beside a model's weights, converted as the README says (ComfyUI's
    Python, the ComfyUI folder): the refusal's two commands, pasted as they are, re-save the weights and
    convert them into a file the Long Sampler runs. (The tiny test model has 2 heads of 16 channels: its
    conversion is told so, as the refusal of a model off the 128-per-head rule says to.)"""
    import argparse
    import shlex

    from comfyui_fastar.testing.comfy_harness import tiny_wan

    src, name = tmp_path / "trained.pt", "pasted.safetensors"
    dst = Path("models") / "diffusion_models" / name
    torch.save({"model": tiny_wan().state_dict(), "config": argparse.Namespace(lr=1e-5)}, src)
    convert = server["base"] / "custom_nodes" / "ComfyUI-FastAR" / "convert.py"
    run = subprocess.run([sys.executable, str(convert), str(src), str(dst)], cwd=server["base"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2, run
    said = run.stderr.strip()
    assert "its entries: model (" in said and "config (an argparse.Namespace)" in said, said
    resave, then = said.split("with the Python and packages the checkpoint was made with: ", 1)[1].split(
        " ; then convert that file: ", 1)
    assert then == f"python {convert} {tmp_path / 'trained_weights.pt'} {dst}", then
    for line in (resave, then + " --num-heads 2 --dtype float32"):
        run = subprocess.run(line.replace("python", shlex.quote(sys.executable), 1), shell=True, cwd=server["base"],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, (line, run.stdout, run.stderr)
    graph = _graph(length=9, chunk="1")
    graph["1"]["inputs"]["unet_name"] = name
    prompt_id, _ = asyncio.run(_run(server["url"], server["port"], graph))
    assert _latent_of(server, prompt_id).shape == (1, 16, 3, 4, 4)


# -- example workflows ------------------------------------------------------------------------
# core's autoregressive nodes (Empty AR Video Latent, SamplerCustom's AR graph) exist from 2026 on
CORE_AR = bool(COMFYUI_PATH) and Path(COMFYUI_PATH, "comfy/ldm/wan/ar_model.py").is_file()
CORE_AR_WORKFLOW = REPO / "example_workflows" / "FAST-AR - ComfyUI AR video graph (needs Empty AR Video Latent).json"
# the same graph on the stock Empty Hunyuan Latent Video: every ComfyUI runs it
STOCK_AR_WORKFLOW = REPO / "example_workflows" / "FAST-AR - AR video graph on stock nodes (Empty Hunyuan Latent Video).json"
# the pack's world model: no model file to download
WORLD_WORKFLOW = REPO / "example_workflows" / "FAST-AR - world model, no download (TempCache against the window).json"
# Matrix-Game 2.0's templates and the live one: their own tests (test_comfy_matrix_game.py, test_comfy_play.py)
OWN_TESTS = sorted((REPO / "example_workflows").glob("FAST-AR - Matrix-Game 2.0 *.json")) + [
    REPO / "example_workflows" / "FAST-AR - play the world live (no download).json"]
WORKFLOWS = [p for p in sorted((REPO / "example_workflows").glob("*.json"))
             if (CORE_AR or p != CORE_AR_WORKFLOW) and p != WORLD_WORKFLOW and p not in OWN_TESTS]
# every template, the core AR one marked core_ar: it runs only where core's autoregressive nodes exist
TEMPLATES = [pytest.param(p, id=p.stem, marks=[pytest.mark.core_ar] if p == CORE_AR_WORKFLOW else [])
             for p in sorted((REPO / "example_workflows").glob("*.json"))
             if p != WORLD_WORKFLOW and p not in OWN_TESTS]
FILE_INPUTS = comfy_harness.FILE_INPUTS


def _to_api_prompt(workflow: dict, info: dict) -> dict:
    return comfy_harness.api_prompt(workflow, info)


@pytest.mark.parametrize("path", TEMPLATES)
def test_example_workflow_validates(server, path):
    info = _get(server["url"] + "/object_info")
    workflow = json.loads(path.read_text())
    prompt = _to_api_prompt(workflow, info)
    types = {n["class_type"] for n in prompt.values()}
    sampler = {"SamplerCustom", "FastARARVideo", "EmptyARVideoLatent"} if path == CORE_AR_WORKFLOW \
        else {"SamplerCustom", "FastARARVideo", "EmptyHunyuanLatentVideo"} if path == STOCK_AR_WORKFLOW \
        else {"FastARAutoregressiveSampler"}
    output = {"FastARSaveVideo"} if "FastARSaveVideo" in types else {"VAEDecode", "SaveVideo"}
    assert {"UNETLoader", "CLIPLoader", "CLIPTextEncode"} | sampler | output <= types
    status, body = _post(server["url"] + "/prompt", {"prompt": prompt})
    # The only complaints allowed are the model files this machine does not have.
    assert status == 400, body
    failed = {e["extra_info"]["input_name"] for errors in body["node_errors"].values() for e in errors["errors"]}
    assert failed and failed <= FILE_INPUTS, body["node_errors"]  # (some ComfyUIs know downloadable names)
    for node_id, errors in body.get("node_errors", {}).items():
        for e in errors["errors"]:
            assert e["type"] == "value_not_in_list" and e["extra_info"]["input_name"] in FILE_INPUTS, (node_id, e)


def _core_ar_workflow_runs_to_a_latent(server, path=CORE_AR_WORKFLOW, latent="EmptyARVideoLatent"):
    """The core AR template as a prompt, on the test checkpoint that loads as WAN21_CausalAR: the
    text encoder is the test conditioning, and the LATENT is saved instead of decoded."""
    info = _get(server["url"] + "/object_info")
    prompt = _to_api_prompt(json.loads(path.read_text()), info)
    by_type = {n["class_type"]: k for k, n in prompt.items()}
    prompt[by_type["UNETLoader"]]["inputs"]["unet_name"] = "fastar_tiny_causal.safetensors"
    for node_id, node in list(prompt.items()):
        if node["class_type"] in ("CLIPLoader", "VAELoader", "VAEDecode", "CreateVideo", "SaveVideo"):
            del prompt[node_id]
        elif node["class_type"] == "CLIPTextEncode":
            prompt[node_id] = {"class_type": "FastARTestConditioning",
                               "inputs": {"seed": int(node_id), "tokens": 512, "width": 4096}}
    prompt[by_type[latent]]["inputs"].update(width=32, height=32, length=21)
    prompt[by_type["FastARTempCacheSettings"]]["inputs"].update(max_cache_frames=4, sink_frames=1)
    sampler = by_type["SamplerCustom"]
    prompt["99"] = {"class_type": "SaveLatent", "inputs": {"samples": [sampler, 0],
                                                          "filename_prefix": f"fastar_{uuid.uuid4().hex[:8]}"}}
    prompt_id, events = asyncio.run(_run(server["url"], server["port"], prompt))
    assert _latent_of(server, prompt_id).shape == (1, 16, 6, 4, 4)
    cache = [e["data"] for e in events if e["type"] == "fastar.cache"]
    assert cache[-1]["status"] == "done" and cache[-1]["node"] == by_type["FastARARVideo"]
    assert {c["engine"] for c in cache if c.get("chunk")} == {"fused"}


STORY_WORKFLOW = REPO / "example_workflows" / "FAST-AR - story in three prompts (prompt schedule, streaming save).json"


def test_the_story_workflow_runs_to_a_playable_file(server):
    """The story template as a prompt on the tiny model and a tiny Wan VAE, shortened: three prompts
    switch on schedule (the widget says which is active) and FAST-AR Save Video writes a file that
    plays back whole, shown as the node's output."""
    prompt = _to_api_prompt(json.loads(STORY_WORKFLOW.read_text()), _get(server["url"] + "/object_info"))
    by_type = {}
    for node_id, node in prompt.items():
        by_type.setdefault(node["class_type"], []).append(node_id)
    (unet,), (vae,), (sampler,) = by_type["UNETLoader"], by_type["VAELoader"], by_type["FastARAutoregressiveSampler"]
    prompt[unet]["inputs"]["unet_name"] = "fastar_tiny.safetensors"
    prompt[vae]["inputs"]["vae_name"] = "fastar_tiny_vae.safetensors"
    del prompt[by_type["CLIPLoader"][0]]
    for node_id in by_type["CLIPTextEncode"]:
        prompt[node_id] = {"class_type": "FastARTestConditioning", "inputs": {"seed": int(node_id), "tokens": 16,
                                                                              "width": 4096}}
    prompt[sampler]["inputs"].update(width=32, height=32, length=45)  # 12 latent frames: 4 chunks of 3
    prompt[by_type["FastARPromptSchedule"][0]]["inputs"].update(start_2=9, start_3=21)  # chunks 1 and 2
    prompt[by_type["FastARTempCacheSettings"][0]]["inputs"].update(max_cache_frames=6, sink_frames=1)
    prompt_id, events = asyncio.run(_run(server["url"], server["port"], prompt))
    cache = [e["data"] for e in events if e["type"] == "fastar.cache" and e["data"].get("chunk")]
    assert [(c["chunk"], c["prompt"], c["prompts"]) for c in cache if c["status"] == "running"] == [
        (1, 1, 3), (2, 2, 3), (3, 3, 3), (4, 3, 3)]
    history = _get(server["url"] + f"/history/{prompt_id}")[prompt_id]
    (saved,) = history["outputs"][by_type["FastARSaveVideo"][0]]["images"]
    frames, rate, size = comfy_harness.read_video(server["base"] / "output" / saved["subfolder"] / saved["filename"])
    assert (len(frames), size, rate) == (45, (32, 32), 16)


# a hang guard, not a speed claim: several times the template's time on 2 cores (bench/cpu_figures.py --comfyui,
# quiet and beside a busy process); the figure itself lives there
WORLD_TEMPLATE_HANG_S = 900


def test_the_world_template_runs_with_no_download_on_a_cpu(server):
    """The no-download template as the frontend queues it: the pack's world model flies the demo's route with
    TempCache and with the window, each sampler's progress and cache widget events shown, and the three
    animations saved as the nodes' outputs; TempCache recalls the revisited place better than the window (the
    pack's README picture)."""
    prompt = _to_api_prompt(json.loads(WORLD_WORKFLOW.read_text()), _get(server["url"] + "/object_info"))
    by_type = {}
    for node_id, node in prompt.items():
        by_type.setdefault(node["class_type"], []).append(node_id)
    prompt_id, events = asyncio.run(_run(server["url"], server["port"], prompt, timeout=WORLD_TEMPLATE_HANG_S))
    progress = [e["data"] for e in events if e["type"] == "progress"]
    assert {p["node"] for p in progress} >= set(by_type["FastARWorldSampler"]) and max(p["max"] for p in progress) == 8
    cache = [e["data"] for e in events if e["type"] == "fastar.cache"]
    for node_id in by_type["FastARWorldSampler"]:  # each sampler's widget: from waiting to done, in video frames
        mine = [c for c in cache if c["node"] == node_id]
        assert [c["status"] for c in mine] == ["running"] * 9 + ["done"], mine
        assert [c["video_frames_done"] for c in mine[1:-1]] == list(range(48, 133, 12)), mine
        assert mine[-1]["video_total_frames"] == 132 and mine[-1]["chunks"] == 8 and mine[-1]["tokens"] > 0
        assert mine[-1]["sampling"] == {"frames_per_chunk": 3, "timesteps": [1000.0, 666.0, 333.0], "shift": 5.0,
                                        "source": "as the pack's world is trained"}
    outputs = _get(server["url"] + f"/history/{prompt_id}")[prompt_id]["outputs"]
    from PIL import Image

    frames = {}
    for node_id in by_type["SaveAnimatedWEBP"]:
        (saved,) = outputs[node_id]["images"]
        with Image.open(server["base"] / "output" / saved["subfolder"] / saved["filename"]) as im:
            assert im.n_frames == 132 and im.size == (64, 64)
            im.seek(125)
            frames[prompt[node_id]["inputs"]["filename_prefix"]] = torch.tensor(list(im.convert("RGB").getdata()),
                                                                                 dtype=torch.float32)
    truth = frames["fastar/world_truth"]
    error = {k: (v - truth).pow(2).mean().item() for k, v in frames.items() if k != "fastar/world_truth"}
    assert error["fastar/world_tempcache"] < error["fastar/world_window"], error


def test_the_world_nodes_refuse_bad_input_at_prompt_in_their_words(server):
    prompt = _to_api_prompt(json.loads(WORLD_WORKFLOW.read_text()), _get(server["url"] + "/object_info"))
    schedule = next(k for k, n in prompt.items() if n["class_type"] == "FastARActionSchedule")
    prompt[schedule]["inputs"]["actions"] = "W*2, jmp"
    status, body = _post(server["url"] + "/prompt", {"prompt": prompt})
    assert status == 400
    (errors,) = [e["errors"] for k, e in body["node_errors"].items() if k == schedule]
    assert [e["details"] for e in errors] == [  # one message, on the one input it reads
        "actions - FAST-AR Action Schedule: unknown action 'jmp': no world knows it (the node's description lists "
        "each world's keys)"]
    # a key of another world (Temple Run's) passes the queue; the sampler names the keys its world has
    prompt[schedule]["inputs"]["actions"] = "W*2, jump"
    _, events = asyncio.run(_run(server["url"], server["port"], prompt))
    (error,) = [e["data"] for e in events if e["type"] == "execution_error"]
    assert error["node_type"] == "FastARWorldSampler" and error["exception_message"].startswith(
        "FAST-AR World Sampler: unknown action 'jump'; this world knows W, S, A, D, zoom_in, zoom_out, idle, "
        "look_up, look_down, look_left, look_right"), error
    prompt[schedule]["inputs"]["actions"] = "W*2"
    samplers = [k for k, n in prompt.items() if n["class_type"] == "FastARWorldSampler"]
    for observe, said in ((30, "observe 30 must be a multiple of 12 video frames"),
                          (0, "observe 0 is smaller than its minimum 12")):
        for sampler in samplers:  # both: a prompt with one valid output would run that one
            prompt[sampler]["inputs"]["observe"] = observe
        status, body = _post(server["url"] + "/prompt", {"prompt": prompt})
        assert status == 400 and all([e["details"] for e in body["node_errors"][k]["errors"]] == [
            f"observe - FAST-AR World Sampler: {said}"] for k in samplers), body


def test_example_workflows_teach_what_to_download_and_have_thumbnails(server):
    """Each template: a Note on the files it needs, the download metadata ComfyUI reads for the text encoder
    and the VAE, and a thumbnail ComfyUI serves beside it."""
    listed = _get(server["url"] + "/workflow_templates")
    pack = next(name for name, stems in listed.items() if CORE_AR_WORKFLOW.stem in stems)
    assert set(listed[pack]) == {p.stem for p in sorted((REPO / "example_workflows").glob("*.json"))}
    for path in WORKFLOWS:
        nodes = {n["type"]: n for n in json.loads(path.read_text())["nodes"]}
        note = nodes["Note"]["widgets_values"][0]
        assert "models/diffusion_models" in note and "fastar convert" in note  # the causal model: where, how
        unet = nodes["UNETLoader"]
        if unet["widgets_values"][0] == "causal_forcing-framewise.safetensors":  # one download ComfyUI offers
            (model,) = unet["properties"]["models"]
            assert model["directory"] == "diffusion_models" and model["url"].endswith(model["name"])
            assert nodes["FastARARVideo"]["widgets_values"] == [1]  # framewise: one latent frame per block
        else:  # a chunkwise model, converted from its .pt
            assert unet["widgets_values"][0] == "self_forcing_dmd.safetensors" and unet["widgets_values"][0] in note
        for loader, directory in (("CLIPLoader", "text_encoders"), ("VAELoader", "vae")):
            (model,) = nodes[loader]["properties"]["models"]
            assert model["name"] == nodes[loader]["widgets_values"][0] and model["directory"] == directory
            assert model["url"].startswith("https://huggingface.co/Comfy-Org/") and model["url"].endswith(model["name"])
        served = {suffix: _fetch(f"{server['url']}/api/workflow_templates/{pack}/{urllib.parse.quote(path.stem)}{suffix}")
                  for suffix in (".json", ".jpg")}
        if Path(COMFYUI_PATH, "server.py").is_file():  # (the pip-installable ComfyUI serves no pack's templates)
            assert served[".json"] is not None
        if served[".json"] is not None:
            assert served[".jpg"] is not None and served[".jpg"][:3] == b"\xff\xd8\xff"  # a JPEG beside it


@pytest.mark.core_ar
def test_core_ar_workflow_runs_to_a_latent(server):
    _core_ar_workflow_runs_to_a_latent(server)


def test_the_stock_node_ar_graph_template_runs_on_every_comfyui(server):
    """The AR graph on Empty Hunyuan Latent Video, for a ComfyUI without core's autoregressive nodes."""
    _core_ar_workflow_runs_to_a_latent(server, STOCK_AR_WORKFLOW, "EmptyHunyuanLatentVideo")


def test_the_readme_lists_the_templates_each_comfyui_serves(server):
    """The README's template list is the example_workflows folder, which this ComfyUI lists; where it
    serves none of the files the README says so and how to open them instead."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("**Templates.**", 1)[1].split("**Model files.**", 1)[0]
    listed = set(re.findall(r"^- \*\*(FAST-AR - [^*]+)\*\*", section, re.M))
    stems = {p.stem for p in (REPO / "example_workflows").glob("*.json")}
    assert listed == stems, (listed ^ stems)
    served = _get(server["url"] + "/workflow_templates")
    pack = next(name for name, names in served.items() if set(names) == stems)
    opens = {stem: _fetch(f"{server['url']}/api/workflow_templates/{pack}/{urllib.parse.quote(stem)}.json")
             is not None for stem in stems}
    assert len(set(opens.values())) == 1, opens  # all or none
    if not all(opens.values()):
        assert "pip-installable ComfyUI" in section and "example_workflows/" in section and "drag" in section
    assert "needs Empty AR Video Latent" in section and "Empty Hunyuan Latent Video" in section

_chromium, _screenshot = comfy_frontend.chromium, comfy_frontend.screenshot
FIT_GRAPH, CLOSE_DIALOGS = comfy_frontend.FIT_GRAPH, comfy_frontend.CLOSE_DIALOGS


def _frontend(p, server, sync_api):
    return comfy_frontend.frontend(p, server["url"], sync_api, COMFYUI_PATH)



@pytest.mark.skipif(_chromium() is None, reason="no Chromium here")
def test_the_world_template_plays_in_the_frontend(server):
    """The no-download template as a user runs it: opened, queued from the page, its three animations shown
    on their nodes."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser, page = _frontend(p, server, sync_api)
        try:
            page.evaluate("(wf) => window.app.loadGraphData(wf)", json.loads(WORLD_WORKFLOW.read_text()))
            page.wait_for_timeout(800)
            page.evaluate(CLOSE_DIALOGS)
            page.evaluate("() => window.app.queuePrompt(0)")
            page.wait_for_function("""() => { const saves = window.app.graph._nodes.filter((n) => n.type === 'SaveAnimatedWEBP');
                return saves.length === 3 && saves.every((n) => n.imgs && n.imgs.length && n.imgs[0].complete
                                                              && n.imgs[0].naturalWidth > 0); }""", timeout=1000 * WORLD_TEMPLATE_HANG_S)
            shown = page.evaluate("""() => window.app.graph._nodes.filter((n) => n.type === 'SaveAnimatedWEBP')
                                           .map((n) => [n.title, n.imgs[0].naturalWidth, n.imgs[0].naturalHeight])""")
            page.evaluate(FIT_GRAPH)
            page.wait_for_timeout(500)
            _screenshot(page, "world_template_result.png")
        finally:
            browser.close()
    assert sorted(t for t, _, _ in shown) == ["Ground truth", "Sink + window", "TempCache"], shown
    assert all((w, h) == (64, 64) for _, w, h in shown), shown


def _webp(path):
    """An animated WebP's frames, RGB arrays."""
    import numpy as np
    from PIL import Image, ImageSequence

    with Image.open(path) as im:
        return np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(im)])


def _finished(server, before, prefix):
    """The prompts that finished on the server since ``before`` (its history's ids then) saving under
    ``prefix`` (none queued by another test), oldest first."""
    history = _get(server["url"] + "/history")
    done = [(h["prompt"][0], k) for k, h in history.items() if k not in before and h.get("status", {}).get("completed")
            and any(n["inputs"].get("filename_prefix") == prefix for n in h["prompt"][2].values())]
    return [k for _, k in sorted(done)]


WINDOW_TRUTH = "fastar/world_truth_window"  # the window's ground truth, saved by a node the test adds


@pytest.mark.skipif(_chromium() is None, reason="no Chromium here")
def test_the_world_template_compares_the_same_route_run_after_run_in_the_frontend(server):
    """The no-download template Run twice from the page, as a user compares TempCache against the window:
    both samplers fly one route over one ground truth with one noise on every Run (their seeds saved fixed,
    the route placed by route_seed), so a second Run shows what the first did; each sampler's cache widget
    follows its flight to the end."""
    import numpy as np

    sync_api = pytest.importorskip("playwright.sync_api")
    before = set(_get(server["url"] + "/history"))
    seeds = "() => [5, 6].map((id) => window.app.graph.getNodeById(id).widgets.map((w) => [w.name, w.value]))"
    with sync_api.sync_playwright() as p:
        browser, page = _frontend(p, server, sync_api)
        try:
            page.evaluate("(wf) => window.app.loadGraphData(wf)", json.loads(WORLD_WORKFLOW.read_text()))
            page.wait_for_timeout(800)
            page.evaluate(CLOSE_DIALOGS)
            # the window's ground truth saved too, beside the template's (TempCache's)
            page.evaluate("""(prefix) => { const g = window.app.graph, save = window.LiteGraph.createNode('SaveAnimatedWEBP');
                g.add(save);
                save.pos = [760, 1300];
                g.getNodeById(6).connect(1, save, 0);
                for (const w of g.getNodeById(7).widgets) {  // encoded as the template's ground truth is
                    const mine = save.widgets.find((x) => x.name === w.name);
                    if (mine) mine.value = w.name === 'filename_prefix' ? prefix : w.value;
                } }""", WINDOW_TRUTH)
            # one noise seed no earlier test ran, on both samplers as the template has it: the server's cache of
            # an earlier run of this template would otherwise answer the first Run without sampling
            page.evaluate("""(seed) => [5, 6].forEach((id) => {
                window.app.graph.getNodeById(id).widgets.find((w) => w.name === 'seed').value = seed; })""",
                          int(time.time()) % 100000 + 1000)
            loaded = page.evaluate(seeds)
            runs = []
            for n in (1, 2):
                page.evaluate("() => window.app.queuePrompt(0)")
                deadline = time.time() + WORLD_TEMPLATE_HANG_S
                while len(_finished(server, before, WINDOW_TRUTH)) < n and time.time() < deadline:
                    time.sleep(1)
                runs.append(page.evaluate(seeds))
            widgets = page.evaluate("""() => [5, 6].map((id) => { const r = window.app.graph.getNodeById(id)
                .fastarCacheView.root; const f = (k) => r.querySelector('[data-field=' + k + ']').textContent;
                return [f('status'), f('frames'), f('sampling')]; })""")
        finally:
            browser.close()
    ids = _finished(server, before, WINDOW_TRUTH)
    assert len(ids) == 2, ids
    # the seeds as saved: the noise seed fixed after every Run, route_seed beside it
    assert loaded == runs[0] == runs[1], (loaded, runs)
    for widgets_of in loaded:
        assert dict(widgets_of)["control_after_generate"] == "fixed" and dict(widgets_of)["route_seed"] == 0
    saved = []
    for prompt_id in ids:
        history = _get(server["url"] + f"/history/{prompt_id}")[prompt_id]
        graph = history["prompt"][2]
        files = {}
        for node_id, out in history["outputs"].items():
            if graph[node_id]["class_type"] == "SaveAnimatedWEBP":
                (image,) = out["images"]
                files[graph[node_id]["inputs"]["filename_prefix"]] = _webp(
                    server["base"] / "output" / image["subfolder"] / image["filename"])
        saved.append(files)
    first, second = saved
    assert set(first) == {"fastar/world_truth", "fastar/world_truth_window", "fastar/world_tempcache",
                          "fastar/world_window"}
    # one ground truth for both samplers, the same on both Runs; each cache's frames the same on both Runs
    assert np.array_equal(first["fastar/world_truth"], first["fastar/world_truth_window"])
    for name in first:
        assert np.array_equal(first[name], second[name]), name
    assert not np.array_equal(first["fastar/world_tempcache"], first["fastar/world_window"])  # two caches compared
    assert widgets == [["FAST-AR cache: done", "132 / 132 video", "3 fr · 3 steps · shift 5"]] * 2, widgets


@pytest.mark.skipif(_chromium() is None, reason="no Chromium here")
def test_the_node_shows_a_files_sampling_in_the_frontend(server):
    """A file that records its sampling, run from the page with widgets that say otherwise: the cache widget's
    sampling row shows the file's (3 latent frames a chunk, its steps and shift) and says whose it is."""
    sync_api = pytest.importorskip("playwright.sync_api")
    name = "causvid_tiny.safetensors"
    _recorded_model(server, name)
    graph = _graph(length=21, chunk="1")
    graph["1"]["inputs"]["unet_name"] = name
    with sync_api.sync_playwright() as p:
        browser, page = _frontend(p, server, sync_api)
        try:
            page.evaluate("(g) => window.app.loadApiJson(g, 'fastar_sampling_test')", graph)
            page.wait_for_selector(".fastar-cache", state="attached", timeout=20000)
            page.evaluate("() => window.app.queuePrompt(0)")
            page.wait_for_function("() => document.querySelector('.fastar-cache [data-field=status]')"
                                   ".textContent.endsWith('done')", timeout=240000)
            row = page.evaluate("""() => { const f = (k) => document.querySelector('.fastar-cache [data-field=' + k + ']');
                                           return [f('sampling').textContent, f('sampled_from').textContent,
                                                   f('sampled_from').title]; }""")
            widget = page.evaluate("() => window.app.graph.getNodeById(4).widgets.find((w) => w.name === "
                                   "'frames_per_chunk').value")
            page.evaluate(CLOSE_DIALOGS)
            page.evaluate("""() => { const n = window.app.graph.getNodeById(4);
                                     if (n && window.app.canvas.centerOnNode) window.app.canvas.centerOnNode(n);
                                     window.app.canvas.setDirty(true, true); }""")
            page.wait_for_timeout(500)
            _screenshot(page, "sampling_from_file.png")
        finally:
            browser.close()
    assert widget == "1"  # the widget as the user left it; the row says what ran
    assert row == ["3 fr · 3 steps · shift 1", "file", f"timesteps 1000,757,522 at shift 1, as {name} records "
                                                       f"(checkpoint_sampling), not the widgets"], row


@pytest.mark.skipif(_chromium() is None, reason="no Chromium here")
def test_templates_open_in_the_frontend_with_no_node_over_another(server):
    """Each template as the frontend lays it out (titles and widgets included): no two nodes overlap.
    With FASTAR_TEMPLATE_THUMBNAILS set, the canvas of each is written as the template's thumbnail."""
    sync_api = pytest.importorskip("playwright.sync_api")
    overlaps = {}
    with sync_api.sync_playwright() as p:
        browser, page = _frontend(p, server, sync_api)
        try:
            for path in sorted((REPO / "example_workflows").glob("*.json")):
                page.evaluate("(wf) => window.app.loadGraphData(wf)", json.loads(path.read_text()))
                page.wait_for_timeout(800)
                page.keyboard.press("Escape")  # a missing-models dialog
                page.evaluate("""() => document.querySelectorAll('.p-dialog-close-button, .p-dialog [aria-label=Close]')
                                        .forEach((b) => b.click())""")
                boxes = page.evaluate("""() => window.app.graph._nodes.map((n) => {
                    const b = n.getBounding(); return [n.id, n.type, b[0], b[1], b[2], b[3]]; })""")
                assert len(boxes) == len(json.loads(path.read_text())["nodes"])
                overlaps[path.stem] = [(a[1], b[1]) for i, a in enumerate(boxes) for b in boxes[i + 1:]
                                       if a[2] < b[2] + b[4] and b[2] < a[2] + a[4] and a[3] < b[3] + b[5]
                                       and b[3] < a[3] + a[5]]
                if os.environ.get("FASTAR_TEMPLATE_THUMBNAILS"):
                    page.evaluate("""async () => {  // the graph alone on a thumbnail: no badges, tabs, minimap
                        const set = async (k, v) => { try { await window.app.ui.settings.setSettingValueAsync(k, v); }
                                                      catch (e) {} };
                        await set('Comfy.NodeBadge.NodeSourceBadgeMode', 'None');
                        await set('Comfy.Workflow.WorkflowTabsPosition', 'Sidebar');
                        await set('Comfy.Minimap.Visible', false);
                        await set('Comfy.Graph.CanvasInfo', false); }""")
                    page.evaluate(FIT_GRAPH)
                    page.wait_for_timeout(500)
                    page.locator("canvas#graph-canvas").screenshot(path=str(path.with_suffix(".jpg")), type="jpeg",
                                                                   quality=80)
        finally:
            browser.close()
    assert overlaps == {stem: [] for stem in overlaps}, overlaps

# the fastar.cache payloads the page's api delivers (what the widget got), kept in window.__fastarEvents
CAPTURE_EVENTS = """async () => { const { api } = await import('/scripts/api.js');
    window.__fastarEvents = [];
    api.addEventListener('fastar.cache', (e) => window.__fastarEvents.push(e.detail)); }"""


def _kb(n_bytes):
    """The widget's formatGB below 1 MB."""
    return f"{n_bytes / 1e3:.1f} KB"


@pytest.mark.skipif(_chromium() is None, reason="no Chromium here")
def test_cache_widget_updates_live_in_the_frontend(server, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    graph = _graph(length=45, chunk="1", cache_mode="window")  # 12 chunks of 1 frame, sink 1 + window 2
    del graph["5"]["inputs"]["filename_prefix"]
    graph["5"]["inputs"]["filename_prefix"] = "fastar_widget"
    with sync_api.sync_playwright() as p:
        browser, page = _frontend(p, server, sync_api)
        try:
            page.evaluate("(g) => window.app.loadApiJson(g, 'fastar_widget_test')", graph)
            page.wait_for_selector(".fastar-cache", state="attached", timeout=20000)
            assert page.evaluate("() => document.querySelectorAll('.fastar-cache').length") == 1
            assert page.text_content(".fastar-cache [data-field=status]").strip() == "FAST-AR cache: idle"
            # every state the widget shows, recorded in the page as it changes (polling from here can
            # miss states when the chunks come faster than the round trips)
            page.evaluate("""() => {
                const root = document.querySelector('.fastar-cache');
                const field = (k) => root.querySelector('[data-field=' + k + ']').textContent;
                window.__fastarSeen = [];
                const record = () => {
                    const now = [field('frames'), field('status')], seen = window.__fastarSeen;
                    const last = seen[seen.length - 1];
                    if (!last || last[0] !== now[0] || last[1] !== now[1]) seen.push(now);
                };
                new MutationObserver(record).observe(root, {subtree: true, childList: true, characterData: true});
                record(); }""")
            page.evaluate(CAPTURE_EVENTS)
            page.evaluate("() => window.app.queuePrompt(0)")
            page.wait_for_function("() => document.querySelector('.fastar-cache [data-field=status]')"
                                   ".textContent.endsWith('done')", timeout=240000)
            seen = [tuple(x) for x in page.evaluate("() => window.__fastarSeen")]
            last = [e for e in page.evaluate("() => window.__fastarEvents") if e.get("chunk")][-1]
            page.keyboard.press("Escape")
            page.evaluate("""() => { document.querySelectorAll('.p-dialog-close-button, .p-dialog [aria-label=Close]')
                                        .forEach((b) => b.click());
                                     const n = window.app.graph.getNodeById(4);
                                     if (n && window.app.canvas.centerOnNode) window.app.canvas.centerOnNode(n);
                                     window.app.canvas.setDirty(true, true); }""")
            page.wait_for_timeout(500)
            shot = tmp_path / "fastar_cache_widget.png"
            page.screenshot(path=str(shot))
            if os.environ.get("FASTAR_WIDGET_SCREENSHOT"):  # for the README
                page.screenshot(path=os.environ["FASTAR_WIDGET_SCREENSHOT"])
            texts = {k: page.text_content(f".fastar-cache [data-field={k}]") for k in
                     ("tokens", "gb", "relative", "frames", "latent", "rate", "annsa", "annsa_sparse", "prompt",
                      "sampling", "sampled_from", "legend",
                      "y_max", "y_min", "x_min", "x_max", "x_title")}
            # how far the widget's last line (the graph's x axis) runs past the widget's own box (px)
            overflow = page.evaluate("""() => { const root = document.querySelector('.fastar-cache');
                const axis = root.querySelector('[data-field=x_title]').parentElement;
                return [axis.getBoundingClientRect().bottom - root.getBoundingClientRect().bottom,
                        root.scrollHeight - root.clientHeight]; }""")
            canvas_ink = page.evaluate("""() => {
                const c = document.querySelector('.fastar-cache canvas');
                const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                let n = 0; for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n; }""")
        finally:
            browser.close()
    running = [f for f, s in seen if s.endswith("running")]
    assert len(set(running)) >= 3, seen          # the numbers changed while the rollout ran
    # frames in video frames, what the sampler's length counts, latent frames beside them
    length = graph["4"]["inputs"]["length"]
    latent = 1 + (length - 1) // 4
    assert seen[-1] == (f"{length} / {length} video", "FAST-AR cache: done"), seen
    assert (f"0 / {length} video", "FAST-AR cache: waiting for the first chunk") in seen, seen
    assert f"{1 + 4} / {length} video" in running, seen  # chunk 2 of 1 latent frame each
    assert texts["latent"] == f"{latent} / {latent}"
    assert texts["tokens"] == "12"                # (1 sink + 2 window) frames x 4 tokens, formatted here
    assert texts["prompt"] == "1 of 1"            # no prompt schedule
    assert texts["relative"].startswith("25 %")   # of the 48 tokens a dense cache would hold
    assert texts["rate"].endswith("chunks/s")
    # 12 tokens x K+V of 256 fp32 channels x 2 layers held; the allocation as the last event reported it
    assert texts["gb"] == f"{_kb(12 * 2 * 256 * 4 * 2)} (alloc {_kb(last['gb'] * 1e9)})", (texts, last)
    assert texts["annsa"] == "off" and texts["annsa_sparse"] == "off"  # a window cache without AnnSA
    assert (texts["sampling"], texts["sampled_from"]) == ("1 fr · 4 steps · shift 5", "widgets")  # the file records none
    assert canvas_ink > 0                         # the history graph was drawn
    assert max(overflow) <= 1, overflow           # all of it inside the widget: nothing spills over the node
    # its legend names both lines; its x axis runs over the video frames done, its y axis up to the largest size
    assert texts["legend"] == "helddense"  # two swatches, each with its name (and a tooltip)
    assert (texts["x_title"], texts["x_min"], texts["x_max"]) == ("video frames", "0", str(length))
    assert texts["y_min"] == "0" and texts["y_max"] == texts["relative"].split(" of ")[1]  # the dense size at the end


def _percent(x):
    """The widget's formatPercent."""
    return f"{100 * x:.{1 if x < 0.1 else 0}f} %"


@pytest.mark.skipif(_chromium() is None, reason="no Chromium here")
def test_cache_widget_shows_annsa_sparse_layers_in_the_frontend(server):
    """With AnnSA on, the widget says which share of its layers ran sparse in the last chunk: the event's
    annsa_sparse, in words, and the frames in video frames of the sampler's length."""
    sync_api = pytest.importorskip("playwright.sync_api")
    graph = _graph(length=21, chunk="3", tempcache=True, ann=True)  # 6 latent frames: 2 chunks of 3
    with sync_api.sync_playwright() as p:
        browser, page = _frontend(p, server, sync_api)
        try:
            page.evaluate("(g) => window.app.loadApiJson(g, 'fastar_widget_annsa')", graph)
            page.wait_for_selector(".fastar-cache", state="attached", timeout=20000)
            page.evaluate(CAPTURE_EVENTS)
            page.evaluate("() => window.app.queuePrompt(0)")
            page.wait_for_function("() => document.querySelector('.fastar-cache [data-field=status]')"
                                   ".textContent.endsWith('done')", timeout=240000)
            events = page.evaluate("() => window.__fastarEvents")
            texts = {k: page.text_content(f".fastar-cache [data-field={k}]") for k in
                     ("annsa", "annsa_sparse", "frames", "latent", "x_max")}
        finally:
            browser.close()
    last = [e for e in events if e.get("chunk")][-1]
    assert isinstance(last["annsa_sparse"], (int, float)) and 0 <= last["annsa_sparse"] <= 1, last
    assert texts["annsa_sparse"] == _percent(last["annsa_sparse"]) + " of layers"
    assert texts["annsa"] == _percent(last["annsa_density"])
    length = graph["4"]["inputs"]["length"]
    latent = 1 + (length - 1) // 4
    assert (texts["frames"], texts["latent"]) == (f"{length} / {length} video", f"{latent} / {latent}")
    assert texts["x_max"] == str(length)
