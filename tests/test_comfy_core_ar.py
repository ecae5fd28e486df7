"""Core ComfyUI's autoregressive video path (``WAN21_CausalAR`` / ``CausalWanModel``, Empty AR Video
Latent, ``SamplerCustom``) with FAST-AR's ``FastARARVideo`` SAMPLER in place of ``SamplerARVideo``.

Needs a ComfyUI tree that has core's autoregressive files (``comfy/ldm/wan/ar_model.py``), named by
``COMFYUI_PATH`` (the ``core-ar-2026`` tree); skipped otherwise. A tiny random Wan 2.1 checkpoint is
written with the metadata that makes ComfyUI's loader pick the causal model.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from comfyui_fastar.testing.comfy_harness import H, W, comfyui_path, prompt, rel, tiny_wan, write_wan

pytestmark = [pytest.mark.comfyui, pytest.mark.core_ar]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny model with core's causal metadata, and without."""
    plain, causal = write_wan(tiny_wan(), tmp_path_factory.mktemp("ckpt"))
    return causal, plain


@pytest.fixture(scope="module")
def causal(comfy, checkpoints):
    return comfy.sd.load_diffusion_model(str(checkpoints[0]), model_options={"dtype": torch.float32})


def _conditioning(seed):
    return [[prompt(seed), {}]]


def _sample_custom(model, sampler, *, frames=6, seed=5, steps=4, cfg=1.0, negative=2):
    """SamplerCustom as a graph runs it: Empty AR Video Latent, BasicScheduler "simple"."""
    from comfy_extras.nodes.nodes_ar_video import EmptyARVideoLatent
    from comfy_extras.nodes.nodes_custom_sampler import BasicScheduler, SamplerCustom

    latent = EmptyARVideoLatent.execute(W, H, (frames - 1) * 4 + 1, 1).result[0]
    sigmas = BasicScheduler.execute(model, "simple", steps, 1.0).result[0]
    out = SamplerCustom.execute(model, True, seed, cfg, _conditioning(1), _conditioning(negative), sampler, sigmas,
                                latent)
    return out.result[0]["samples"]


def test_the_loader_picks_the_causal_model_by_its_metadata(comfy, checkpoints, causal):
    from comfy.ldm.wan.ar_model import CausalWanModel

    assert type(causal.model).__name__ == "WAN21_CausalAR"
    assert type(causal.model.diffusion_model) is CausalWanModel
    plain = comfy.sd.load_diffusion_model(str(checkpoints[1]), model_options={"dtype": torch.float32})
    assert type(plain.model).__name__ == "WAN21" and type(plain.model.diffusion_model).__name__ == "WanModel"


def test_patch_model_accepts_the_causal_model_and_runs_it_fused(causal):
    from comfyui_fastar.nodes.engines import choose_engine
    from comfyui_fastar.nodes.patching import transformer_options
    from comfyui_fastar.nodes.settings_nodes import PatchModel

    patched = PatchModel.execute(causal).result[0]
    options = transformer_options(patched, patched.model_options)
    assert choose_engine(patched, options, patched.model_options, "test").name == "fused"


@pytest.mark.parametrize("block", [1, 3])
@pytest.mark.parametrize("engine", ["fused", "comfy"])
def test_fastar_sampler_matches_cores_sampler_on_a_dense_cache(causal, block, engine, monkeypatch):
    from comfy_extras.nodes.nodes_ar_video import SamplerARVideo

    from comfyui_fastar.nodes import engines
    from comfyui_fastar.nodes.sampler_nodes import ARVideo
    from comfyui_fastar.nodes.settings_nodes import PatchModel, WindowCache

    core = _sample_custom(causal, SamplerARVideo.execute(block).result[0])
    dense = PatchModel.execute(causal, WindowCache.execute(3, 12, True).result[0]).result[0]  # every frame kept
    seen = []
    monkeypatch.setattr(engines, "log_engine", lambda e, node, *how: seen.append(e.name))
    if engine == "comfy":
        monkeypatch.setattr(engines, "_fused_blocker", lambda *a: "forced for the test")
    ours = _sample_custom(dense, ARVideo.execute(block).result[0])
    assert seen == [engine]
    assert ours.shape == core.shape == (1, 16, 6, H // 8, W // 8)
    assert rel(ours, core) <= 1e-4


def test_an_unpatched_model_gets_the_default_cache_on_either_engine(causal, monkeypatch):
    """No FAST-AR Patch Model in the graph: TempCache at its defaults, and on ComfyUI's forward the
    sampler routes the attention itself."""
    from comfyui_fastar.nodes import engines
    from comfyui_fastar.nodes.sampler_nodes import ARVideo

    fused = _sample_custom(causal, ARVideo.execute(3).result[0])
    monkeypatch.setattr(engines, "_fused_blocker", lambda *a: "forced for the test")
    assert rel(_sample_custom(causal, ARVideo.execute(3).result[0]), fused) <= 1e-5


def test_fastar_sampler_guides_with_the_graphs_cfg_and_negative(causal):
    """cfg > 1 (which core's sampler refuses): both prompts run as one batch over one cache. With the
    positive prompt as the negative, guidance is the identity; with another one it moves the video."""
    from comfyui_fastar.nodes.sampler_nodes import ARVideo

    sampler = ARVideo.execute(3).result[0]
    plain = _sample_custom(causal, sampler)
    assert rel(_sample_custom(causal, sampler, cfg=2.5, negative=1), plain) <= 1e-5
    assert rel(_sample_custom(causal, sampler, cfg=2.5, negative=2), plain) > 1e-3


def test_fastar_sampler_follows_a_prompt_schedule_in_cores_graph(causal):
    """The schedule replaces SamplerCustom's positive: its first prompt equal to the graph's is the
    plain graph bit for bit; a switch keeps the frames before it and moves the ones after."""
    from comfyui_fastar.nodes.prompt_nodes import PromptSchedule
    from comfyui_fastar.nodes.sampler_nodes import ARVideo

    plain = _sample_custom(causal, ARVideo.execute(1).result[0])  # 6 latent frames: video frames 0..20
    one = PromptSchedule.execute(_conditioning(1)).result[0]
    assert torch.equal(_sample_custom(causal, ARVideo.execute(1, prompts=one).result[0]), plain)
    story = PromptSchedule.execute(_conditioning(1), prompt_2=_conditioning(7), start_2=9).result[0]
    switched = _sample_custom(causal, ARVideo.execute(1, prompts=story).result[0])
    assert torch.equal(switched[:, :, :3], plain[:, :, :3])  # latent 3 starts at video frame 9
    assert rel(switched[:, :, 3:], plain[:, :, 3:]) > 1e-3
    # prompt_1 unconnected: the graph's positive (the same prompt here) comes first
    after_positive = PromptSchedule.execute(prompt_2=_conditioning(7), start_2=9).result[0]
    assert torch.equal(_sample_custom(causal, ARVideo.execute(1, prompts=after_positive).result[0]), switched)


def test_fastar_sampler_bounds_the_cache_with_the_patched_models_settings(causal):
    from comfyui_fastar.fastar import TempCacheConfig
    from comfyui_fastar.nodes.sampler_nodes import ARVideo
    from comfyui_fastar.nodes.settings_nodes import PatchModel, TempCacheSettings

    tc = TempCacheSettings.execute(True, 0.5, 3, 1).result[0]
    patched = PatchModel.execute(causal, tc).result[0]
    stats = []

    class Events:
        def sampling(self, frames_per_chunk, timesteps, shift, source):
            stats.append(("sampling", frames_per_chunk, len(timesteps), source.split(" (")[0]))

        def start(self, frames, chunks, prompts):
            stats.append(("start", frames, chunks, prompts))

        def engine(self, e):
            stats.append(("engine", e.name))

        def __call__(self, r):
            stats.append(r.cache.tokens_held)

        def finish(self, status):
            stats.append(status)

    sampler = ARVideo.execute(1).result[0]
    sampler.events = Events()
    out = _sample_custom(patched, sampler, frames=6)
    assert isinstance(tc, TempCacheConfig) and out.shape[2] == 6
    tokens_per_frame = (H // 16) * (W // 16)
    assert stats[:3] == [("sampling", 1, 4, "as the graph says"), ("start", 6, 6, 1), ("engine", "fused")]  # 4 steps
    assert stats[-1] == "done"
    assert max(stats[3:-1]) <= 3 * tokens_per_frame  # TempCache's budget, not the whole video


def test_fastar_sampler_errors_name_the_node_and_input(causal):
    from comfyui_fastar.fastar import FastARError
    from comfyui_fastar.nodes.sampler_nodes import ARVideo

    with pytest.raises(FastARError, match=r"FAST-AR AR Video: the latent has 5 frames, not a multiple of "
                                          r"num_frame_per_block 3; set Empty AR Video Latent's length to 9 or 21"):
        _sample_custom(causal, ARVideo.execute(3).result[0], frames=5)
    i2v = causal.clone()  # what AR Video I2V leaves on the model: 6 latent frames are 1 + 5, not whole blocks
    i2v.model_options.setdefault("transformer_options", {})["ar_config"] = {"initial_latent": torch.zeros(1, 16, 1, 4, 4)}
    with pytest.raises(FastARError, match=r"FAST-AR AR Video: the latent has 6 frames, not a whole number of blocks "
                                          r"of num_frame_per_block 3 after AR Video I2V's start image \(1 latent "
                                          r"frame\); set AR Video I2V's length to 13 or 25"):
        _sample_custom(i2v, ARVideo.execute(3).result[0])


def test_comfy_bench_runs_every_path_on_the_engine_it_names(comfy, tmp_path, twins):
    """bench/comfy_bench.py --smoke: every ComfyUI path it times runs where its table says."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import comfy_bench

    results = comfy_bench.main(["--comfyui", comfyui_path(), "--smoke", "--out", str(tmp_path)])
    engines = {name: r["engine"] for name, r in results["runs"].items()}
    assert engines.pop("core-sampler/dense") == "core"
    assert engines.pop("comfy-fallback/fastar") == "comfy"
    assert {n for n, e in engines.items() if e == "library"} == {"library/fastar", "library/window"}
    assert {e for n, e in engines.items() if not n.startswith("library")} == {"fused"}
    assert all(r["finite"] for n, r in results["runs"].items() if n != "core-sampler/dense")
    assert (tmp_path / "comfy_bench.json").is_file()


@pytest.mark.parametrize("block", [1, 3])
@pytest.mark.parametrize("engine", ["fused", "comfy"])
def test_fastar_sampler_matches_cores_sampler_from_a_start_image(causal, vae, block, engine, monkeypatch):
    """AR Video I2V's start image: core seeds its cache with the image's latent and samples the blocks
    after it; FAST-AR AR Video on an unbounded cache does the same, within 1e-4."""
    from comfy_extras.nodes.nodes_ar_video import ARVideoI2V, SamplerARVideo
    from comfy_extras.nodes.nodes_custom_sampler import BasicScheduler, SamplerCustom

    from comfyui_fastar.nodes import engines
    from comfyui_fastar.nodes.sampler_nodes import ARVideo
    from comfyui_fastar.nodes.settings_nodes import PatchModel, WindowCache

    image = torch.rand(1, H, W, 3, generator=torch.Generator().manual_seed(4))
    length = 25  # 7 latent frames: the image's, then 2 blocks of 3 or 6 of 1

    def run(model, sampler, image=image):
        model, latent = ARVideoI2V.execute(model, vae, image, W, H, length, 1).result
        sigmas = BasicScheduler.execute(model, "simple", 4, 1.0).result[0]
        return SamplerCustom.execute(model, True, 5, 1.0, _conditioning(1), _conditioning(2), sampler, sigmas,
                                     latent).result[0]["samples"]

    core = run(causal, SamplerARVideo.execute(block).result[0])
    if engine == "comfy":
        monkeypatch.setattr(engines, "_fused_blocker", lambda *a: "forced for the test")
    dense = PatchModel.execute(causal, WindowCache.execute(3, 12, True).result[0]).result[0]  # every frame kept
    ours = run(dense, ARVideo.execute(block).result[0])
    assert ours.shape == core.shape == (1, 16, 7, H // 8, W // 8)
    assert rel(ours, core) <= 1e-4
    other = run(dense, ARVideo.execute(block).result[0], 1 - image)
    assert rel(ours[:, :, 1:], other[:, :, 1:]) > 1e-3  # the image conditions what follows


def test_fastar_sampler_streams_its_blocks_to_a_file_from_a_start_image(causal, vae, tmp_path, monkeypatch):
    """FAST-AR AR Video with a FAST-AR Video Stream in core's I2V graph: the graph's latent is unchanged,
    the file holds the start image's frame and every block's, and the frames written are VAE Decode's of
    that latent."""
    from comfy_extras.nodes.nodes_ar_video import ARVideoI2V
    from comfy_extras.nodes.nodes_custom_sampler import BasicScheduler, SamplerCustom

    from comfyui_fastar.nodes import video
    from comfyui_fastar.nodes.sampler_nodes import ARVideo
    from comfyui_fastar.nodes.video_nodes import VideoStream
    from comfyui_fastar.testing.comfy_harness import read_video

    try:
        import folder_paths
    except ImportError:
        from comfy.cmd import folder_paths
    monkeypatch.setattr(folder_paths, "get_output_directory", lambda: str(tmp_path))
    image = torch.rand(1, H, W, 3, generator=torch.Generator().manual_seed(4))

    def run(stream=None):
        model, latent = ARVideoI2V.execute(causal, vae, image, W, H, 25, 1).result
        sigmas = BasicScheduler.execute(model, "simple", 4, 1.0).result[0]
        return SamplerCustom.execute(model, True, 5, 1.0, _conditioning(1), _conditioning(2),
                                     ARVideo.execute(3, stream=stream).result[0], sigmas, latent).result[0]["samples"]

    plain = run()
    written = []
    real_write = video.VideoWriter.write
    monkeypatch.setattr(video.VideoWriter, "write", lambda self, frame: (written.append(frame), real_write(self, frame)))
    streamed = run(VideoStream.execute(vae, 16.0, "video/ar", True).result[0])
    assert torch.equal(streamed, plain)
    (path,) = (tmp_path / "video").glob("ar_*.mp4")
    assert len(read_video(path)[0]) == 25
    with torch.inference_mode():
        stock = vae.decode(plain)[0]
    assert rel(torch.stack(written), stock) <= 1e-5
