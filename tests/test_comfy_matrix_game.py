"""Matrix-Game 2.0 in a real ComfyUI: the loader and sampler nodes in process (a tiny model at the released
key layout, ComfyUI's Wan VAE with random weights), and a server (``COMFYUI_PATH``'s tree, on the CPU) that
runs the variants' templates from core's Load CLIP Vision / CLIP Vision Encode on a ViT-H/14 file with
random weights, refuses bad actions in the nodes' words, and serves the templates with their thumbnails."""
from __future__ import annotations

import asyncio
import json
import os
import types
import urllib.parse
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from comfyui_fastar.testing import comfy_harness, play_client
from comfyui_fastar.testing.checkpoints import matrix_game_weights

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
pytestmark = [pytest.mark.comfyui]
REPO = Path(__file__).resolve().parents[1]


def _variant_of(path: Path) -> str:
    """The variant whose file a template's loader names."""
    from comfyui_fastar.fastar.models.matrix_game import VARIANTS

    (loader,) = [n for n in json.loads(path.read_text())["nodes"] if n["type"] == "FastARMatrixGameLoader"]
    return next(v.name for v in VARIANTS.values() if Path(v.file).name == loader["widgets_values"][0])


TEMPLATES = {_variant_of(p): p for p in sorted((REPO / "example_workflows").glob("FAST-AR - Matrix-Game 2.0 *.json"))}
# each variant's tiny file: ComfyUI's head count is dim // 128, and the context is ViT-H's 1280 wide
TINY = dict(dim=256, heads=2, layers=2, ffn=256, clip=1280)
W, H = 64, 48  # pixels: a 6x8 latent


def _write_world(folder: Path, variant: str) -> Path:
    from safetensors.torch import save_file

    path = folder / f"fastar_mg_{variant}.safetensors"
    save_file(matrix_game_weights(variant, **TINY), str(path))
    return path


@pytest.fixture(scope="module")
def parts(comfy, tmp_path_factory):
    """A tiny universal model as the loader loads it, ComfyUI's Wan VAE (random) and a start image."""
    import comfy.sd
    import comfy.utils

    from comfyui_fastar.fastar.models import load_wan

    folder = tmp_path_factory.mktemp("mg")
    model = load_wan(_write_world(folder, "universal"))
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(comfy_harness.wan_vae_file(folder / "vae.safetensors"))))
    image = torch.rand(1, 40, 56, 3, generator=torch.Generator().manual_seed(0))
    return types.SimpleNamespace(model=model, vae=vae, image=image)


def _sample(parts, actions: str, tokens=None, **kw):
    from comfyui_fastar.nodes.matrix_game_nodes import MatrixGameSampler
    from comfyui_fastar.nodes.sampler_nodes import StartImage
    from comfyui_fastar.nodes.world_nodes import Actions

    clip = types.SimpleNamespace(penultimate_hidden_states=torch.randn(
        1, 257, 1280, generator=torch.Generator().manual_seed(1)) if tokens is None else tokens)
    return MatrixGameSampler.execute(parts.model, clip, StartImage(parts.image, parts.vae), Actions(actions), 0,
                                     width=W, height=H, **kw).result[0]["samples"]


def test_the_start_image_condition_is_the_whole_videos_encoding(parts):
    """The image followed by black frames, encoded until the black frames' latent stops changing and that one
    repeated: ComfyUI's VAE Encode of the whole video, frame for frame."""
    from comfyui_fastar.nodes.video import start_image_latent

    image = torch.rand(1, 32, 48, 3, generator=torch.Generator().manual_seed(2))
    frames = 40
    whole = parts.vae.encode(torch.cat([image, torch.zeros(4 * (frames - 1), 32, 48, 3)]))
    short = start_image_latent(parts.vae, image, frames, "test")
    assert 2 < short.shape[2] < frames  # it stopped early: the black frames' latent settles
    repeated = torch.cat([short, short[:, :, -1:].expand(-1, -1, frames - short.shape[2], -1, -1)], 2)
    scale = whole.abs().max()
    assert (repeated[:, :, :short.shape[2]] - whole[:, :, :short.shape[2]]).abs().max() <= 1e-5 * scale
    assert (repeated - whole).abs().max() <= 2e-3 * scale


def test_a_chunks_actions_steer_that_chunk_and_not_the_ones_before(parts):
    """W for two chunks against W then S: the first chunk's frames alike, the second's not."""
    a, b = _sample(parts, "W*2"), _sample(parts, "W, S")
    assert a.shape == b.shape == (1, 16, 6, H // 8, W // 8)
    assert torch.equal(a[:, :, :3], b[:, :, :3])
    assert (a[:, :, 3:] - b[:, :, 3:]).abs().amax(dim=(0, 1, 3, 4)).min() > 1e-4


def test_world_play_offline_is_the_samplers_video(parts):
    """FAST-AR World Play with a schedule connected (a replay) plays Matrix-Game 2.0 as its sampler does: the
    sampler's LATENT, decoded, frame for frame; its log is the schedule in frames, its last action held to the
    chunk's end (a chunk's action rows are its frames: the first chunk's 9, then 12 each)."""
    from comfyui_fastar.nodes.play_nodes import WorldPlay
    from comfyui_fastar.nodes.sampler_nodes import StartImage
    from comfyui_fastar.nodes.video import chunk_decoder
    from comfyui_fastar.nodes.world_nodes import Actions

    text = "W*1, A+look_left*6f, S*3f"  # 18 frames (the first chunk's 9): two chunks, S held to the second's end
    latent = _sample(parts, text)
    decoded = torch.cat(list(chunk_decoder(parts.vae)(latent)))
    clip = types.SimpleNamespace(penultimate_hidden_states=torch.randn(1, 257, 1280,
                                                                       generator=torch.Generator().manual_seed(1)))
    out = WorldPlay.execute(parts.model, 0, 24 / 16, actions=Actions(text), clip_vision_output=clip,
                            start=StartImage(parts.image, parts.vae), width=W, height=H)
    frames, log, schedule = out.result
    assert frames.shape == (9 + 12, H, W, 3) and torch.equal(frames, decoded)
    assert log == "W*9f, A+look_left*6f, S*6f" and schedule.text == log


@pytest.mark.taehv
def test_world_play_decodes_with_a_fast_decoder_as_core_decodes_the_whole_latent(parts, comfy, tmp_path):
    """World Play's vae: lighttaew2_1 (random weights at its real layout, as core's Load VAE gives it) decodes
    the frames chunk by chunk; they are core's decode of the sampler's whole LATENT with it."""
    from comfyui_fastar.nodes.play_nodes import WorldPlay
    from comfyui_fastar.nodes.sampler_nodes import StartImage
    from comfyui_fastar.nodes.world_nodes import Actions

    path = comfy_harness.taehv_file(tmp_path / "lighttaew2_1.safetensors")
    fast = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(path)))
    text = "W*1, A+look_left*6f, S*3f"
    with torch.inference_mode():
        whole = fast.decode(_sample(parts, text))[0]
    clip = types.SimpleNamespace(penultimate_hidden_states=torch.randn(1, 257, 1280,
                                                                       generator=torch.Generator().manual_seed(1)))
    frames = WorldPlay.execute(parts.model, 0, 24 / 16, actions=Actions(text), clip_vision_output=clip,
                               start=StartImage(parts.image, parts.vae), vae=fast, width=W, height=H).result[0]
    assert frames.shape == whole.shape == (9 + 12, H, W, 3) and whole.std() > 0.05
    assert ((frames - whole).norm() / whole.norm()).item() <= 1e-5


def test_the_sampler_refuses_what_its_model_cannot_read_in_its_words(parts):
    from comfyui_fastar.fastar import FastARError

    with pytest.raises(FastARError, match=r"^FAST-AR Matrix-Game Sampler: unknown action 'jump'; this world knows "
                                          r"W, S, A, D, idle"):
        _sample(parts, "W, jump")
    with pytest.raises(FastARError, match=r"^FAST-AR Matrix-Game Sampler: clip_vision_output holds tokens "
                                          r"\[1, 257, 1024\]; this model reads \[1, 257, 1280\]"):
        _sample(parts, "W", tokens=torch.zeros(1, 257, 1024))
    with pytest.raises(FastARError, match=r"^FAST-AR Matrix-Game Sampler: .*decreasing"):
        _sample(parts, "W", timesteps="1000,1000")
    fast = types.SimpleNamespace(first_stage_model=type("TAEHV", (torch.nn.Module,), {})())
    with pytest.raises(FastARError, match=r"^FAST-AR Matrix-Game Sampler: the start image's VAE is a TAEHV fast decoder; "
                                          r"the start image is encoded with Wan 2.1's VAE"):
        _sample(types.SimpleNamespace(model=parts.model, vae=fast, image=parts.image), "W")
    with pytest.raises(FastARError, match=r"^FAST-AR Matrix-Game Sampler: the world input is SimpleNamespace, not a "
                                          r"Matrix-Game 2.0 model: load one with FAST-AR Matrix-Game 2\.0 Loader"):
        _sample(types.SimpleNamespace(model=types.SimpleNamespace(), vae=parts.vae, image=parts.image), "W")


def test_the_action_schedule_previews_its_timeline_and_the_worlds_that_know_it(comfy):
    from comfyui_fastar.fastar import FastARError
    from comfyui_fastar.nodes.world_nodes import ActionSchedule, timeline

    text = ActionSchedule.execute("W*2, W+look_left*6f, idle*0.5s").ui.as_dict()["text"][0]
    assert text.splitlines() == ["  0.00-  1.50 s  W", "  1.50-  1.88 s  W+look_left", "  1.88-  2.38 s  idle",
                                 "38 video frames = 4 chunks of 12 = 2.4 s at 16 fps",
                                 "runs on: the pack's world, Matrix-Game 2.0 universal, Matrix-Game 2.0 gta, "
                                 "Matrix-Game 2.0 foundation"]
    assert timeline("jump*2", 16.0).endswith("runs on: Matrix-Game 2.0 templerun")
    assert timeline("jump, W", 16.0).endswith("runs on: no one world: its keys come from different worlds")
    assert ActionSchedule.validate_inputs("jump, W") is True  # the loaded world's sampler names the key it lacks
    with pytest.raises(FastARError, match=r"^W\*0\.01s holds no frame"):
        timeline("W*0.01s", 16.0)
    assert timeline("W*0.01s", 120.0).startswith("  0.00-  0.01 s  W\n1 video frames")
    with pytest.raises(FastARError, match=r"^unknown action 'jmp': no world knows it"):
        timeline("W, jmp", 16.0)
    assert ActionSchedule.validate_inputs("W*2, jmp") == ("FAST-AR Action Schedule: unknown action 'jmp': no world "
                                                          "knows it (the node's description lists each world's keys)")


# -- a server ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(comfy, tmp_path_factory):
    from PIL import Image

    base = tmp_path_factory.mktemp("comfy_mg")
    models = base / "models"
    for folder in ("diffusion_models", "clip_vision", "vae", "vae_approx"):
        (models / folder).mkdir(parents=True)
    for variant in ("universal", "templerun"):
        _write_world(models / "diffusion_models", variant)
    comfy_harness.write_wan(comfy_harness.tiny_wan(), models / "diffusion_models", "fastar_tiny")  # no world model
    comfy_harness.clip_vision_h_file(models / "clip_vision" / "fastar_vit_h.safetensors")
    comfy_harness.wan_vae_file(models / "vae" / "fastar_tiny_vae.safetensors")
    comfy_harness.taehv_file(models / "vae_approx" / "taew2_1.safetensors", dtype=torch.float16)
    (base / "input").mkdir()
    pixels = np.random.default_rng(0).integers(0, 255, (90, 120, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(base / "input" / "example.png")
    with comfy_harness.comfy_server(base, REPO) as url_port:
        yield {**url_port, "base": base}


def _template_prompt(server, variant: str, actions: str | None = None) -> tuple[dict, dict]:
    """A variant's template as a prompt on the tiny files, small and short; and its node ids by type."""
    info = comfy_harness.get_json(server["url"] + "/object_info")
    prompt = comfy_harness.api_prompt(json.loads(TEMPLATES[variant].read_text()), info)
    by_type = {n["class_type"]: k for k, n in prompt.items()}
    inputs = lambda t: prompt[by_type[t]]["inputs"]  # noqa: E731
    inputs("FastARMatrixGameLoader")["model_name"] = f"fastar_mg_{variant}.safetensors"
    inputs("CLIPVisionLoader")["clip_name"] = "fastar_vit_h.safetensors"
    inputs("VAELoader")["vae_name"] = "fastar_tiny_vae.safetensors"
    inputs("FastARMatrixGameSampler").update(width=W, height=H)
    inputs("FastARVideoStream")["filename_prefix"] = f"video/mg_{uuid.uuid4().hex[:8]}"
    if actions is not None:
        inputs("FastARActionSchedule")["actions"] = actions
    return prompt, by_type


def test_each_template_names_its_files_and_has_a_thumbnail(server):
    assert set(TEMPLATES) == {"universal", "gta", "templerun", "foundation"}
    from comfyui_fastar.fastar.models.matrix_game import VARIANTS

    listed = comfy_harness.get_json(server["url"] + "/workflow_templates")
    pack = next(name for name, stems in listed.items() if TEMPLATES["gta"].stem in stems)
    for variant, path in TEMPLATES.items():
        nodes = {n["type"]: n for n in json.loads(path.read_text())["nodes"]}
        note = nodes["Note"]["widgets_values"][0]
        file = VARIANTS[variant].file
        (model,) = nodes["FastARMatrixGameLoader"]["properties"]["models"]
        assert model == {"name": Path(file).name, "directory": "diffusion_models",
                         "url": f"https://huggingface.co/Skywork/Matrix-Game-2.0/resolve/main/{file}"}
        assert file in note and "models/diffusion_models" in note and "clip_vision_h.safetensors" in note
        for loader, name, directory in (("CLIPVisionLoader", "clip_vision_h.safetensors", "clip_vision"),
                                        ("VAELoader", "wan_2.1_vae.safetensors", "vae")):
            (model,) = nodes[loader]["properties"]["models"]
            assert (model["name"], model["directory"]) == (name, directory) and model["url"].endswith(name)
        assert nodes["CLIPVisionEncode"]["widgets_values"] == ["none"]
        served = {suffix: comfy_harness.fetch(f"{server['url']}/api/workflow_templates/{pack}/"
                                              f"{urllib.parse.quote(path.stem)}{suffix}") for suffix in (".json", ".jpg")}
        if Path(COMFYUI_PATH, "server.py").is_file():  # (the pip-installable ComfyUI serves no pack's templates)
            assert served[".json"] is not None and served[".jpg"][:3] == b"\xff\xd8\xff"


def test_the_universal_template_plays_to_a_video_with_the_cache_widget(server):
    """From Load Image / Load CLIP Vision / CLIP Vision Encode (crop none) / Load VAE through the sampler to the
    streamed file: the frames the schedule asks for, the schedule's timeline on its node, the widget's events."""
    prompt, by_type = _template_prompt(server, "universal", "W*2, look_left*6f")
    prompt_id, events = asyncio.run(comfy_harness.run_prompt(server["url"], server["port"], prompt, timeout=600))
    errors = [e for e in events if e["type"] == "execution_error"]
    assert not errors, errors[0]["data"]["exception_message"]
    shown = {e["data"]["node"]: e["data"]["output"] for e in events if e["type"] == "executed"}
    assert shown[by_type["FastARActionSchedule"]]["text"][0].startswith("  0.00-  1.50 s  W\n")
    (saved,) = shown[by_type["FastARMatrixGameSampler"]]["images"]
    frames, rate, size = comfy_harness.read_video(server["base"] / "output" / saved["subfolder"] / saved["filename"])
    assert (len(frames), rate, size) == (1 + 4 * (9 - 1), 12, (W, H))  # 27 action frames: 3 chunks, 9 latent frames
    cache = [e["data"] for e in events if e["type"] == "fastar.cache"]
    assert cache[-1]["status"] == "done" and cache[-1]["chunks"] == 3 and cache[-1]["chunk"] == 3
    assert cache[-1]["sampling"]["timesteps"] == [1000.0, 666.0, 333.0]


def test_a_key_the_loaded_variant_lacks_fails_naming_it_and_an_unknown_one_at_prompt(server):
    prompt, by_type = _template_prompt(server, "templerun", "jump, W")
    _, events = asyncio.run(comfy_harness.run_prompt(server["url"], server["port"], prompt, timeout=600))
    (error,) = [e["data"] for e in events if e["type"] == "execution_error"]
    assert error["node_id"] == by_type["FastARMatrixGameSampler"]
    assert error["exception_message"].startswith("FAST-AR Matrix-Game Sampler: unknown action 'W'; this world knows "
                                                 "nomove, jump, slide"), error["exception_message"]
    prompt, by_type = _template_prompt(server, "templerun", "jump, jmup*2")
    status, body = comfy_harness.post_json(server["url"] + "/prompt", {"prompt": prompt})
    assert status == 400
    (err,) = body["node_errors"][by_type["FastARActionSchedule"]]["errors"]
    assert err["details"] == ("actions - FAST-AR Action Schedule: unknown action 'jmup': no world knows it (the "
                              "node's description lists each world's keys)")


def _play_prompt(server, variant: str, actions: str | None = None) -> dict:
    """The variant's template with FAST-AR World Play in the sampler's place (live, or playing ``actions``),
    its frames saved as images (node "99")."""
    prompt, by_type = _template_prompt(server, variant)
    sampler = prompt.pop(by_type["FastARMatrixGameSampler"])["inputs"]
    for t in ("FastARVideoStream", "FastARActionSchedule"):
        del prompt[by_type[t]]
    prompt["98"] = {"class_type": "FastARWorldPlay", "inputs": {
        **{k: sampler[k] for k in ("world", "clip_vision_output", "start", "cache")},
        "seed": 0, "max_seconds": 6.0, "width": W, "height": H}}
    if actions is not None:
        prompt["97"] = {"class_type": "FastARActionSchedule", "inputs": {"actions": actions}}
        prompt["98"]["inputs"]["actions"] = ["97", 0]
    prompt["99"] = {"class_type": "SaveImage", "inputs": {"images": ["98", 0],
                                                         "filename_prefix": f"mg_play_{uuid.uuid4().hex[:8]}"}}
    return prompt


def test_a_live_session_plays_matrix_game_and_replays_from_its_log(server):
    """A session over the tiny universal file: keys and a look posted as it plays, the first chunk's 9 frames
    then 12 a chunk, stopped from the page; its log, played by the same node, makes the same frames."""
    def plan(m):
        return {-1: [{"action": "W"}], 0: [{"action": "A+look_left"}], 2: [{"stop": True}]}.get(m["chunk"], [])

    got, events = asyncio.run(play_client.session(server["url"], server["port"], _play_prompt(server, "universal"),
                                                  plan))
    assert got["hello"]["world"] == "Matrix-Game 2.0 universal" and got["hello"]["size"] == [H, W]
    keys = got["hello"]["keys"]
    assert ["W", "W", "walk forward"] in keys and ["mouse", "look", "look around"] in keys
    assert got["end"]["reason"] == "stopped" and not got["errors"]
    chunks = got["chunks"]
    assert [c["frames"] for c in chunks] == [[0, 9]] + [[9 + 12 * i, 12] for i in range(len(chunks) - 1)]
    assert got["frames"] == list(range(9 + 12 * (len(chunks) - 1)))
    for c in chunks:
        assert c["seq"] == max([a["seq"] for a in got["acks"] if a["received"] < c["taken"]], default=0)
    live = play_client.saved(server["base"], events, "99")
    assert live.shape == (len(got["frames"]), H, W, 3)
    log = got["end"]["log"]
    assert "A+look_left*" in log and len(log.split(", ")) >= 2
    _, replay = asyncio.run(comfy_harness.run_prompt(server["url"], server["port"],
                                                     _play_prompt(server, "universal", log), timeout=600))
    assert not [e for e in replay if e["type"] == "execution_error"]
    assert np.array_equal(play_client.saved(server["base"], replay, "99"), live)


def test_a_fast_decoder_streams_and_plays_cores_frames_or_is_refused_in_one_line(server):
    """FAST-AR Load Fast Decoder's taew2_1 (random weights at its real layout, float16 as released) on the
    universal template's Video Stream and on World Play playing the same schedule: the file holds the
    sampler's frames, and World Play's are core's decode of the sampler's whole LATENT (saved) with that
    decoder. A ComfyUI without TAEHV (v0.3.64) answers at the loader, in one line."""
    import safetensors.torch

    from comfyui_fastar.nodes.fast_decoder_nodes import load_fast_decoder

    text = "W*2, look_left*6f"
    prompt, by_type = _template_prompt(server, "universal", text)
    sampler = prompt[by_type["FastARMatrixGameSampler"]]["inputs"]
    prefix = f"fast_{uuid.uuid4().hex[:8]}"
    prompt["90"] = {"class_type": "FastARLoadFastDecoder", "inputs": {"decoder_name": "taew2_1.safetensors"}}
    prompt[by_type["FastARVideoStream"]]["inputs"]["vae"] = ["90", 0]
    prompt["91"] = {"class_type": "SaveLatent", "inputs": {"samples": [by_type["FastARMatrixGameSampler"], 0],
                                                            "filename_prefix": f"latents/{prefix}"}}
    prompt["92"] = {"class_type": "FastARWorldPlay", "inputs": {
        **{k: sampler[k] for k in ("world", "clip_vision_output", "start", "cache", "seed", "actions")},
        "vae": ["90", 0], "max_seconds": 30 / 16, "width": W, "height": H}}
    prompt["93"] = {"class_type": "SaveImage", "inputs": {"images": ["92", 0], "filename_prefix": prefix}}
    _, events = asyncio.run(comfy_harness.run_prompt(server["url"], server["port"], prompt, timeout=600))
    errors = [e["data"] for e in events if e["type"] == "execution_error"]
    if not Path(COMFYUI_PATH, "comfy", "taesd", "taehv.py").is_file():
        (error,) = errors
        assert error["node_id"] == "90" and "\n" not in error["exception_message"].strip()
        assert error["exception_message"].startswith("FAST-AR Load Fast Decoder: this ComfyUI has no TAEHV")
        return
    assert not errors, errors[0]["exception_message"]
    (latent_file,) = (server["base"] / "output" / "latents").glob(f"{prefix}_*.latent")
    latent = safetensors.torch.load_file(str(latent_file))["latent_tensor"]
    fast = load_fast_decoder(str(server["base"] / "models" / "vae_approx" / "taew2_1.safetensors"))
    with torch.inference_mode():
        whole = fast.decode(latent)[0].clamp(0, 1).numpy()
    played = play_client.saved(server["base"], events, "93") / 255.0
    assert played.shape == whole.shape == (1 + 4 * (9 - 1), H, W, 3) and whole.std() > 0.05
    assert np.abs(played - whole).max() <= 1.01 / 255  # SaveImage's 8 bits: truncated, not rounded
    shown = {e["data"]["node"]: e["data"]["output"] for e in events if e["type"] == "executed"}
    (saved,) = shown[by_type["FastARMatrixGameSampler"]]["images"]
    frames, _, _ = comfy_harness.read_video(server["base"] / "output" / saved["subfolder"] / saved["filename"])
    assert len(frames) == len(whole) and np.abs(np.stack(frames) / 255.0 - whole).mean() < 0.1  # a lossy codec


def test_the_loader_refuses_a_wan_text_to_video_file_in_its_words(server):
    prompt, by_type = _template_prompt(server, "universal")
    prompt[by_type["FastARMatrixGameLoader"]]["inputs"]["model_name"] = "fastar_tiny.safetensors"
    _, events = asyncio.run(comfy_harness.run_prompt(server["url"], server["port"], prompt))
    (error,) = [e["data"] for e in events if e["type"] == "execution_error"]
    assert error["node_id"] == by_type["FastARMatrixGameLoader"]
    assert error["exception_message"].startswith("FAST-AR Matrix-Game 2.0 Loader: fastar_tiny.safetensors is a "
                                                 "WanModel, not a Matrix-Game 2.0 model"), error["exception_message"]


def test_the_play_pages_legend_maps_keys_to_each_variants_actions(comfy):
    """What the play page binds: the variant's keys (Temple Run's to keys a player reaches), GTA's steering on
    A / D, the mouse where the model has one, each said in words of its world; every action one the session
    reads, and every variant's described."""
    from comfyui_fastar.fastar.models.matrix_game import VARIANTS
    from comfyui_fastar.fastar.play import Session
    from comfyui_fastar.fastar.actions import ActionSpec
    from comfyui_fastar.nodes.play_worlds import MATRIX_GAME_WORDS, PACK_WORDS, legend

    def words(name):
        return legend(VARIANTS[name].actions, MATRIX_GAME_WORDS[name])

    assert words("universal") == [["W", "W", "walk forward"], ["S", "S", "walk back"], ["A", "A", "walk left"],
                                  ["D", "D", "walk right"], ["mouse", "look", "look around"]]
    assert words("gta") == [["W", "forward", "drive forward"], ["S", "back", "drive back"],
                            ["A", "look_left", "steer left"], ["D", "look_right", "steer right"],
                            ["mouse", "look", "look around"]]
    assert words("templerun") == [["Space", "jump", "jump"], ["C", "slide", "slide"], ["Q", "turnleft", "turn left"],
                                  ["E", "turnright", "turn right"], ["A", "leftside", "step left"],
                                  ["D", "rightside", "step right"]]
    assert [row[2] for row in legend(ActionSpec(), PACK_WORDS)] == [
        "pan up", "pan down", "pan left", "pan right", "zoom in", "zoom out", "look around (pans the view)"]
    assert set(MATRIX_GAME_WORDS) == set(VARIANTS)
    for variant in VARIANTS.values():
        session = Session(variant.actions)
        for _, action, _ in legend(variant.actions, MATRIX_GAME_WORDS[variant.name]):
            assert action in MATRIX_GAME_WORDS[variant.name], (variant.name, action)  # none falls back to its name
            if action != "look":
                session.post(action)
