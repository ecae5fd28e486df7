"""The ComfyUI bridge, in process, against a real ComfyUI checkout named by ``COMFYUI_PATH``.

A tiny random Wan 2.1 T2V checkpoint is written to disk, loaded by ComfyUI (its own model
detection builds a stock ``comfy.ldm.wan.model.WanModel``) and by ``fastar``; the bridge's rollout
on the ComfyUI model must equal ``fastar``'s own rollout. Skipped without ``COMFYUI_PATH``.
"""
from __future__ import annotations

import gc
import warnings

import pytest
import torch

from comfyui_fastar.testing.comfy_harness import H, TINY, W, engine_for, prompt, rel

pytestmark = pytest.mark.comfyui

TOL = 1e-4


@pytest.fixture(scope="module")
def models(comfy, checkpoint):
    from comfyui_fastar.fastar.models import load_wan

    comfy_model = comfy.sd.load_diffusion_model(str(checkpoint), model_options={"dtype": torch.float32})
    core = load_wan(checkpoint, dtype=torch.float32)
    return comfy_model, core


def _core_rollout(core, context, *, frames, chunk, cfg=1.0, negative=None, cache=None, seed=3, batch=1, start=None):
    from comfyui_fastar.fastar import CacheConfig, FlowMatchSchedule, rollout

    return rollout(core, context.repeat(batch, 1, 1), frames=frames, height=H, width=W, chunk_frames=chunk,
                   schedule=FlowMatchSchedule(), cache=cache or CacheConfig(), seed=seed,
                   negative_context=None if negative is None else negative.repeat(batch, 1, 1), cfg=cfg, start=start)


def test_comfyui_builds_the_stock_wan_model(models):
    from comfy.ldm.wan.model import WanModel

    comfy_model, core = models
    dm = comfy_model.model.diffusion_model
    assert type(dm) is WanModel and dm.model_type == "t2v"
    assert (dm.dim, dm.num_heads, len(dm.blocks)) == (core.config.dim, core.config.num_heads, core.config.num_layers)


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("cfg", [1.0, 2.5])
def test_bridge_rollout_equals_core_rollout(models, pack, chunk, cfg):
    from comfyui_fastar.fastar import CacheConfig

    comfy_model, core = models
    pos, neg = prompt(1), prompt(2)
    frames = 6
    dense = pack.patching.patch_model(comfy_model, pack.settings.FastARSettings(cache=CacheConfig()))
    settings = pack.samplers.SampleSettings(width=W, height=H, frames=frames, seed=3, chunk_frames=chunk, cfg=cfg)
    out = pack.samplers.sample(dense, [[pos, {}]], [[neg, {}]], settings)["samples"]
    ref = _core_rollout(core, pos, frames=frames, chunk=chunk, cfg=cfg, negative=neg if cfg != 1.0 else None)
    # The LATENT leaves in the VAE's space: the model's latent format maps it out of the model's.
    assert out.shape == (1, 16, frames, H // 8, W // 8)
    assert rel(out, comfy_model.model.process_latent_out(ref)) <= TOL
    # ... and back: the core rollout's latent is what the model sampled.
    assert rel(comfy_model.model.process_latent_in(out), ref) <= TOL


def test_bridge_window_cache_and_batch_equal_core(models, pack):
    from comfyui_fastar.fastar import CacheConfig

    comfy_model, core = models
    pos = prompt(4)
    cache = CacheConfig("window", sink_frames=1, window_frames=2)
    window = pack.patching.patch_model(comfy_model, pack.settings.FastARSettings(cache=cache))
    settings = pack.samplers.SampleSettings(width=W, height=H, frames=6, batch_size=2, seed=5, chunk_frames=1)
    out = pack.samplers.sample(window, [[pos, {}]], None, settings)["samples"]
    ref = _core_rollout(core, pos, frames=6, chunk=1, cache=cache, seed=5, batch=2)
    assert out.shape[0] == 2
    assert rel(out, comfy_model.model.process_latent_out(ref)) <= TOL


def test_bridge_tempcache_equals_core(models, pack):
    from comfyui_fastar.fastar import TempCacheConfig

    comfy_model, core = models
    pos = prompt(6)
    cache = TempCacheConfig(merge_threshold=0.5, max_cache_frames=3, sink_frames=1)
    tempcache = pack.patching.patch_model(comfy_model, pack.settings.FastARSettings(cache=cache))
    settings = pack.samplers.SampleSettings(width=W, height=H, frames=6, seed=9, chunk_frames=1)
    out = pack.samplers.sample(tempcache, [[pos, {}]], None, settings)["samples"]
    ref = _core_rollout(core, pos, frames=6, chunk=1, cache=cache, seed=9)
    assert rel(out, comfy_model.model.process_latent_out(ref)) <= TOL


def test_bridge_ann_sparsity_equals_core(models, pack):
    from comfyui_fastar.fastar import AnnConfig, CacheConfig, FlowMatchSchedule, rollout
    from comfyui_fastar.nodes.settings_nodes import AnnSparsity, PatchModel

    comfy_model, core = models
    pos = prompt(8)
    config = AnnSparsity.execute(True, True, 0.9, 0.5, 0.25).result[0]
    assert config == AnnConfig(dense_steps_fraction=0.25, keep_fraction=0.5, keep_mass=0.9, annca=True)
    patched = PatchModel.execute(comfy_model, CacheConfig(), config).result[0]
    settings = pack.samplers.SampleSettings(width=W, height=H, frames=4, seed=2, chunk_frames=1)
    out = pack.samplers.sample(patched, [[pos, {}]], None, settings)["samples"]
    ref = rollout(core, pos, frames=4, height=H, width=W, chunk_frames=1, schedule=FlowMatchSchedule(), seed=2,
                  ann=config)
    assert rel(out, comfy_model.model.process_latent_out(ref)) <= TOL
    dense = _core_rollout(core, pos, frames=4, chunk=1, seed=2)
    assert rel(ref, dense) > 0  # the sparse path was taken


def _ksampler(comfy, model, pos, neg, cfg):
    import comfy.sample

    latent = torch.zeros(1, 16, 3, H // 8, W // 8)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(11))
    return comfy.sample.sample(model, noise, 3, cfg, "euler", "simple", [[pos, {}]], [[neg, {}]], latent,
                               disable_pbar=True, seed=11)


def test_patched_model_outside_rollout_is_bitwise_stock(comfy, models, pack):
    comfy_model, _ = models
    pos, neg = prompt(1), prompt(2)
    before = repr(comfy_model.model_options), repr(comfy_model.wrappers)
    patched = pack.patching.patch_model(comfy_model)
    assert patched is not comfy_model and patched.model is comfy_model.model
    assert (repr(comfy_model.model_options), repr(comfy_model.wrappers)) == before  # input never mutated
    assert pack.patching.is_patched(patched) and not pack.patching.is_patched(comfy_model)
    for cfg in (1.0, 3.0):
        stock = _ksampler(comfy, comfy_model, pos, neg, cfg)
        ours = _ksampler(comfy, patched, pos, neg, cfg)
        assert torch.equal(stock, ours)
    # a plain forward of the diffusion model, with the patched model's transformer_options
    dm = comfy_model.model.diffusion_model
    x = torch.randn(1, 16, 3, H // 8, W // 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([500.0])
    options = pack.patching.transformer_options(patched, patched.model_options)
    with torch.no_grad():
        assert torch.equal(dm(x, t, pos), dm(x, t, pos, transformer_options=options))


def test_existing_attention_override_is_chained(comfy, models, pack):
    comfy_model, _ = models
    pos, neg = prompt(1), prompt(2)
    calls = []

    def other_override(func, *args, **kwargs):  # e.g. a SageAttention patch
        calls.append(args[0].shape)
        return func(*args, **kwargs)

    other = comfy_model.clone()
    other.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = other_override
    stock = _ksampler(comfy, other, pos, neg, 1.0)
    n_stock = len(calls)
    assert n_stock > 0
    patched = pack.patching.patch_model(other)
    assert torch.equal(_ksampler(comfy, patched, pos, neg, 1.0), stock)
    assert len(calls) == 2 * n_stock  # still called for every attention outside a rollout
    # patching twice chains to the original override, not to ourselves
    twice = pack.patching.patch_model(patched)
    assert twice.model_options["transformer_options"]["optimized_attention_override"].fastar_previous is other_override
    # inside a rollout FAST-AR owns the Wan attention calls
    calls.clear()
    pack.samplers.sample(patched, [[pos, {}]], None,
                         pack.samplers.SampleSettings(width=W, height=H, frames=1, chunk_frames=1))
    assert calls == []


def test_non_wan_model_gets_one_clear_error(comfy, pack):
    import comfy.model_patcher

    from comfyui_fastar.fastar import FastARError

    class NotWan(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.diffusion_model = torch.nn.Linear(2, 2)

    patcher = comfy.model_patcher.ModelPatcher(NotWan(), torch.device("cpu"), torch.device("cpu"))
    with pytest.raises(FastARError, match=r"Wan 2\.1 text-to-video.*NotWan / Linear"):
        pack.patching.patch_model(patcher)


def test_cancel_between_chunks_frees_the_cache(comfy, models, pack):
    from comfyui_fastar.fastar import KVCache

    comfy_model, _ = models
    pos = prompt(1)
    seen = []

    def cancel_after_first(report):
        seen.append(report.chunk)
        comfy.model_management.interrupt_current_processing(True)

    settings = pack.samplers.SampleSettings(width=W, height=H, frames=6, chunk_frames=1)
    try:
        with pytest.raises(Exception) as info:
            pack.samplers.sample(comfy_model, [[pos, {}]], None, settings, on_chunk=cancel_after_first)
    finally:
        comfy.model_management.interrupt_current_processing(False)
    assert type(info.value).__name__ == "InterruptProcessingException"
    assert seen == [0]
    del info
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is KVCache]
    # the next run is unaffected by the cancelled one
    again = pack.samplers.sample(comfy_model, [[pos, {}]], None, settings)["samples"]
    fresh = pack.samplers.sample(comfy_model, [[pos, {}]], None, settings)["samples"]
    assert torch.equal(again, fresh)


def test_nodes(comfy, models, pack):
    from comfyui_fastar import comfy_entrypoint
    from comfyui_fastar.fastar import CacheConfig, FastARError, TempCacheConfig
    from comfyui_fastar.nodes.sampler_nodes import AutoregressiveLongSampler
    from comfyui_fastar.nodes.settings_nodes import PatchModel, TempCacheSettings, WindowCache

    import asyncio

    ext = asyncio.run(comfy_entrypoint())
    nodes = asyncio.run(ext.get_node_list())
    expected = {"FastARPatchModel", "FastARTempCacheSettings", "FastARWindowCache", "FastARAnnSparsity",
                "FastARAutoregressiveSampler", "FastARARVideo", "FastARPromptSchedule", "FastARSaveVideo",
                "FastARVideoStream", "FastARWorldModel", "FastARActionSchedule", "FastARWorldSampler",
                "FastARStartImage", "FastARMatrixGameLoader", "FastARMatrixGameSampler", "FastARWorldPlay",
                "FastARLoadFastDecoder"}
    assert {n.define_schema().node_id for n in nodes} == expected
    for n in nodes:
        schema = n.define_schema()
        schema.validate()
        assert schema.category == "FAST-AR"
        assert all(i.tooltip for i in schema.inputs)

    comfy_model, core = models
    tc = TempCacheSettings.execute(True, 0.5, 3, 1).result[0]
    assert tc == TempCacheConfig(merge_threshold=0.5, max_cache_frames=3, sink_frames=1)
    patched = PatchModel.execute(comfy_model, tc).result[0]
    assert pack.patching.is_patched(patched) and not pack.patching.is_patched(comfy_model)

    pos = prompt(1)
    latent = AutoregressiveLongSampler.execute(patched, [[pos, {}]], W, H, 9, 1, 3, "1000,750,500,250", 5.0, "1",
                                               0.0, 1.0).result[0]
    ref = _core_rollout(core, pos, frames=3, chunk=1, cache=tc)
    assert rel(latent["samples"], comfy_model.model.process_latent_out(ref)) <= TOL

    # the window, from the cache node
    window = WindowCache.execute(1, 2, False).result[0]
    assert window == CacheConfig("window", 1, 2)
    assert WindowCache.execute(1, 2, True).result[0] == CacheConfig("unbounded", 1, 2)
    latent = AutoregressiveLongSampler.execute(PatchModel.execute(comfy_model, window).result[0], [[pos, {}]], W, H,
                                               13, 1, 3, "1000,750,500,250", 5.0, "1", 0.0, 1.0).result[0]
    ref = _core_rollout(core, pos, frames=4, chunk=1, cache=window)
    assert rel(latent["samples"], comfy_model.model.process_latent_out(ref)) <= TOL

    # an unpatched model: patched on the fly, with TempCache at its defaults
    latent = AutoregressiveLongSampler.execute(comfy_model, [[pos, {}]], W, H, 21, 1, 3, "1000,750,500,250", 5.0,
                                               "3", 0.0, 1.0).result[0]
    ref = _core_rollout(core, pos, frames=6, chunk=3, cache=TempCacheConfig())
    assert rel(latent["samples"], comfy_model.model.process_latent_out(ref)) <= TOL

    # a last chunk that is not whole: generated whole, then cut (13 frames = 4 latent frames of 6)
    latent = AutoregressiveLongSampler.execute(comfy_model, [[pos, {}]], W, H, 13, 1, 3, "1000,750,500,250", 5.0,
                                               "3", 0.0, 1.0).result[0]
    assert latent["samples"].shape[2] == 4
    assert rel(latent["samples"], comfy_model.model.process_latent_out(ref)[:, :, :4]) <= TOL

    assert AutoregressiveLongSampler.validate_inputs(timesteps="250,500") == (  # the one input it reads
        "Autoregressive Long Sampler: timesteps must be strictly decreasing, got [250.0, 500.0]")
    assert AutoregressiveLongSampler.validate_inputs(timesteps="1000,750,500,250") is True
    for i, value, message in ((7, "250,500", "timesteps must be strictly decreasing"),
                              (2, 40, "width 40 is not a multiple of 16 pixels"),
                              (4, 22, r"length 22 is not 1 \+ 4k video frames"),
                              (9, "2", "frames_per_chunk '2' is not one of 3, 1")):
        args = [comfy_model, [[pos, {}]], W, H, 9, 1, 3, "1000,750,500,250", 5.0, "3", 0.0, 1.0]
        args[i] = value
        with pytest.raises(FastARError, match=f"^Autoregressive Long Sampler: {message}"):
            AutoregressiveLongSampler.execute(*args)
    with pytest.raises(FastARError, match="needs a negative prompt"):
        AutoregressiveLongSampler.execute(comfy_model, [[pos, {}]], W, H, 9, 1, 3, "1000", 5.0, "3", 0.0, 2.0)


def test_a_prompt_schedule_switches_the_prompt_along_the_video(models, pack):
    """Through the nodes: a schedule of one prompt is the plain sampler bit for bit; a switch at a video
    frame keeps every frame before it the first prompt's, bit for bit, changes the frames after, and
    matches the library's rollout with that switch; bad schedules get one error in the nodes' words."""
    from comfyui_fastar.fastar import FastARError, TempCacheConfig
    from comfyui_fastar.nodes.prompt_nodes import PromptSchedule
    from comfyui_fastar.nodes.sampler_nodes import AutoregressiveLongSampler
    from comfyui_fastar.nodes.settings_nodes import PatchModel

    comfy_model, core = models
    pos, other = prompt(1), prompt(5)
    model = PatchModel.execute(comfy_model, TempCacheConfig(max_cache_frames=4, sink_frames=1)).result[0]

    def sample(length=29, first=True, **schedule):
        prompts = PromptSchedule.execute(*([[[pos, {}]]] if first else []), **schedule).result[0] if schedule else None
        return AutoregressiveLongSampler.execute(model, [[pos, {}]], W, H, length, 1, 3, "1000,750,500,250", 5.0,
                                                 "1", 0.0, 1.0, prompts=prompts).result[0]["samples"]

    plain = sample()  # 29 frames: 8 latent frames, chunks of 1
    assert torch.equal(sample(start_2=9), plain)  # prompt_2 unconnected: a schedule of one prompt
    switched = sample(prompt_2=[[other, {}]], start_2=10)  # frame 10 lies in latent 3 (frames 9-12): the switch waits to latent 4
    assert torch.equal(switched[:, :, :4], plain[:, :, :4])  # video frames 0..12, every one before frame 13
    assert rel(switched[:, :, 4:], plain[:, :, 4:]) > 1e-3
    # prompt_1 unconnected: the sampler's positive (the same prompt here) comes first
    assert torch.equal(sample(first=False, prompt_2=[[other, {}]], start_2=10), switched)
    from comfyui_fastar.fastar import FlowMatchSchedule, rollout
    ref = rollout(core, pos, frames=8, height=H, width=W, chunk_frames=1, schedule=FlowMatchSchedule(),
                  cache=TempCacheConfig(max_cache_frames=4, sink_frames=1), seed=3, prompts=[(4, other)])
    assert rel(switched, comfy_model.model.process_latent_out(ref)) <= TOL

    with pytest.raises(FastARError, match=r"^FAST-AR Prompt Schedule: start_3 \(9\) must come after start_2 \(20\)"):
        PromptSchedule.execute([[pos, {}]], prompt_2=[[other, {}]], start_2=20, prompt_3=[[pos, {}]], start_3=9)
    with pytest.raises(FastARError, match="prompt 2 starts at frame 40, past the video's end \\(its last frame is 28\\)"):
        sample(prompt_2=[[other, {}]], start_2=40)
    with pytest.raises(FastARError, match="prompts 2 and 3 both start with the chunk at frame 9"):
        sample(prompt_2=[[other, {}]], start_2=6, prompt_3=[[pos, {}]], start_3=8)


def test_a_converted_training_checkpoint_loads_in_comfyui(comfy, models, tmp_path):
    """fastar convert's file through ComfyUI's own loader: the same weights, and ComfyUI's causal Wan
    model where core's autoregressive nodes exist (the plain Wan model before)."""
    import comfy.model_base

    from comfyui_fastar.fastar.models import convert_checkpoint

    comfy_model, core = models
    src, dst = tmp_path / "self_forcing_dmd.pt", tmp_path / "self_forcing_dmd.safetensors"
    torch.save({"generator_ema": {"model." + k: v for k, v in core.state_dict().items()}, "step": 1}, src)
    convert_checkpoint(src, dst, dtype=torch.float32, num_heads=TINY["num_heads"])
    loaded = comfy.sd.load_diffusion_model(str(dst), model_options={"dtype": torch.float32})
    expected = "WAN21_CausalAR" if hasattr(comfy.model_base, "WAN21_CausalAR") else "WAN21"
    assert type(loaded.model).__name__ == expected
    ours, theirs = loaded.model.diffusion_model.state_dict(), comfy_model.model.diffusion_model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


# -- the engine ---------------------------------------------------------------------------
def test_fused_engine_runs_over_the_models_own_tensors(models, pack):
    comfy_model, _ = models
    engine = engine_for(comfy_model)
    assert (engine.name, engine.reason) == ("fused", None)
    theirs = dict(comfy_model.model.diffusion_model.named_parameters())
    ours = dict(engine.model.named_parameters())
    assert ours.keys() == theirs.keys()
    assert [n for n in ours if ours[n].data_ptr() != theirs[n].data_ptr()] == []  # no second copy


def test_fused_forward_equals_comfyuis_forward(models, pack):
    comfy_model, _ = models
    dm = comfy_model.model.diffusion_model
    engine = engine_for(comfy_model)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 16, 3, H // 8, W // 8, generator=g)
    t = torch.tensor([620.0])
    context = prompt(5)
    with torch.inference_mode():
        ref = dm(x, t, context)            # ComfyUI's own forward: the chunk attends to itself
        out = engine.model(x, t, context)  # the fused forward, no cache
    assert rel(out, ref) <= 1e-5


@pytest.mark.parametrize("cache", ["tempcache", "window"])
def test_fused_and_comfy_engines_sample_alike(models, pack, monkeypatch, cache):
    from comfyui_fastar.fastar import CacheConfig, TempCacheConfig

    comfy_model, _ = models
    config = TempCacheConfig(merge_threshold=0.5, max_cache_frames=3, sink_frames=1) if cache == "tempcache" \
        else CacheConfig("window", sink_frames=1, window_frames=2)
    model = pack.patching.patch_model(comfy_model, pack.settings.FastARSettings(cache=config))
    settings = pack.samplers.SampleSettings(width=W, height=H, frames=6, seed=4, chunk_frames=1)
    pos = prompt(9)
    seen = []
    fused = pack.samplers.sample(model, [[pos, {}]], None, settings, on_engine=seen.append)["samples"]
    monkeypatch.setattr(pack.engines, "_fused_blocker", lambda *a: "forced for the test")
    comfy = pack.samplers.sample(model, [[pos, {}]], None, settings, on_engine=seen.append)["samples"]
    assert [(e.name, e.reason) for e in seen] == [("fused", None), ("comfy", "forced for the test")]
    assert rel(fused, comfy) <= 1e-5


def test_engine_falls_back_to_comfyui_and_says_why_once(comfy, models, pack, caplog):
    import logging

    from comfyui_fastar.fastar import TempCacheConfig

    comfy_model, core = models
    other = comfy_model.clone()
    other.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = \
        lambda func, *args, **kwargs: func(*args, **kwargs)
    engine = engine_for(other)
    assert engine.name == "comfy" and "overrides its attention" in engine.reason

    pos = prompt(1)
    settings = pack.samplers.SampleSettings(width=W, height=H, frames=2, chunk_frames=1, seed=3)
    with caplog.at_level(logging.INFO):
        out = [pack.samplers.sample(other, [[pos, {}]], None, settings)["samples"] for _ in range(2)]
    said = [r.getMessage() for r in caplog.records if "engine comfy" in r.getMessage()]
    assert len(said) == 1 and "overrides its attention" in said[0]
    ref = _core_rollout(core, pos, frames=2, chunk=1, seed=3, cache=TempCacheConfig())  # patched at the defaults
    assert rel(out[1], comfy_model.model.process_latent_out(ref)) <= TOL  # still correct


def test_weights_patched_per_call_run_on_comfyuis_forward(models, pack):
    comfy_model, _ = models
    q = comfy_model.model.diffusion_model.blocks[0].self_attn.q
    q.weight_function = [lambda w: w]  # what ComfyUI sets on a module when it loads it in low-VRAM mode
    try:
        engine = engine_for(comfy_model)
    finally:
        q.weight_function = []
    assert engine.name == "comfy" and "blocks.0.self_attn.q" in engine.reason


def test_rollout_runs_without_autograd_however_it_is_called(models, pack):
    comfy_model, _ = models
    modes = []
    settings = pack.samplers.SampleSettings(width=W, height=H, frames=2, chunk_frames=1)
    assert not torch.is_inference_mode_enabled()
    out = pack.samplers.sample(comfy_model, [[prompt(1), {}]], None, settings,
                               on_chunk=lambda r: modes.append(torch.is_inference_mode_enabled()))
    assert modes == [True, True] and not out["samples"].requires_grad


class _PlainWan(torch.nn.Module):
    """A Wan 2.1 T2V DiT as a plain ``nn.Module`` with Wan's parts and names, as core's first
    ``CausalWanModel`` was: no ``WanModel`` base class, no ``forward_orig``."""

    def __init__(self, wan):
        super().__init__()
        for name in ("patch_embedding", "text_embedding", "time_embedding", "time_projection", "blocks", "head"):
            setattr(self, name, getattr(wan, name))
        self.dim, self.num_heads, self.patch_size, self.eps = wan.dim, wan.num_heads, wan.patch_size, wan.eps
        self.dtype = wan.dtype  # BaseModel.get_dtype reads it
        self.model_type = "t2v"

    def forward(self, *args, **kwargs):
        raise AssertionError("the fused engine does not call the model's own forward")


def test_a_wan_shaped_plain_module_is_recognised_and_runs_fused(comfy, models, pack):
    import copy

    import comfy.model_patcher

    from comfyui_fastar.fastar import TempCacheConfig

    comfy_model, core = models
    base = copy.copy(comfy_model.model)
    base._modules = dict(base._modules)  # (a shallow copy shares its submodule table with the original)
    base.diffusion_model = _PlainWan(comfy_model.model.diffusion_model)
    patcher = comfy.model_patcher.ModelPatcher(base, torch.device("cpu"), torch.device("cpu"))
    patched = pack.patching.patch_model(patcher)
    pos = prompt(2)
    seen = []
    settings = pack.samplers.SampleSettings(width=W, height=H, frames=3, chunk_frames=3, seed=6)
    out = pack.samplers.sample(patched, [[pos, {}]], None, settings, on_engine=seen.append)["samples"]
    assert [e.name for e in seen] == ["fused"]
    ref = _core_rollout(core, pos, frames=3, chunk=3, seed=6, cache=TempCacheConfig())  # patched at the defaults
    assert rel(out, comfy_model.model.process_latent_out(ref)) <= TOL


def test_settings_that_cannot_run_together_are_named_as_the_graph_shows_them(models):
    from comfyui_fastar.fastar import AnnConfig, FastARError
    from comfyui_fastar.nodes.settings_nodes import AnnSparsity, PatchModel, TempCacheSettings, WindowCache

    comfy_model, _ = models
    a = AnnConfig()
    widgets = [a.annsa, a.annca, a.keep_mass, a.keep_fraction, a.dense_steps_fraction]
    ann = AnnSparsity.execute(*widgets).result[0]
    assert ann == a
    window = WindowCache.execute(3, 12, False).result[0]
    with pytest.raises(FastARError, match=r"^FAST-AR Patch Model: ANN Sparsity's annsa reads a bucket-sorted history, "
                                          r"which a window cache does not keep .*or turn ANN Sparsity's annsa off$"):
        PatchModel.execute(comfy_model, window, ann)
    PatchModel.execute(comfy_model, WindowCache.execute(3, 12, True).result[0], ann)  # unbounded: fine
    PatchModel.execute(comfy_model, None, ann)  # the default cache (TempCache) carries AnnSA
    with pytest.raises(FastARError, match=r"^TempCache Settings: max_cache_frames must be an integer > sink_frames"):
        TempCacheSettings.execute(True, 0.5, 3, 3)
    widgets[3] = 0.0
    with pytest.raises(FastARError, match=r"^ANN Sparsity: keep_fraction must lie in \(0, 1\]"):
        AnnSparsity.execute(*widgets)


@pytest.mark.parametrize("engine", ["fused", "comfy"])
def test_nothing_accumulates_from_chunk_to_chunk(models, pack, monkeypatch, engine):
    """Per-chunk cost stays flat only if nothing piles up: the live tensors and Python objects after
    every chunk, once the cache is full, are the same."""
    from comfyui_fastar.fastar import TempCacheConfig

    comfy_model, _ = models
    if engine == "comfy":
        monkeypatch.setattr(pack.engines, "_fused_blocker", lambda *a: "forced for the test")
    live = []

    def count(report):
        gc.collect()
        objects = gc.get_objects()
        with warnings.catch_warnings():  # (isinstance on some torch module objects warns of deprecations)
            warnings.simplefilter("ignore")
            live.append((sum(isinstance(o, torch.Tensor) for o in objects), len(objects)))

    cache = TempCacheConfig(merge_threshold=0.5, max_cache_frames=3, sink_frames=1)
    model = pack.patching.patch_model(comfy_model, pack.settings.FastARSettings(cache=cache))
    settings = pack.samplers.SampleSettings(width=W, height=H, frames=10, chunk_frames=1, seed=1)
    pack.samplers.sample(model, [[prompt(3), {}]], None, settings, on_chunk=count)
    tensors, objects = zip(*live[4:])
    assert len(set(tensors)) == 1, tensors
    assert max(objects[1:]) <= objects[0] + 10, objects  # not one more object a chunk


def test_fp8_stored_weights_run_fused_and_stay_the_models_own(comfy, checkpoint, pack, monkeypatch):
    """ComfyUI's Load Diffusion Model with weight_dtype fp8_e4m3fn stores the weights in fp8 and casts
    each to the compute dtype when a layer runs; the fused engine reads them the same way."""
    fp8 = comfy.sd.load_diffusion_model(str(checkpoint), model_options={"dtype": torch.float8_e4m3fn})
    dm = fp8.model.diffusion_model
    assert dm.blocks[0].self_attn.q.weight.dtype == torch.float8_e4m3fn
    engine = engine_for(fp8)
    assert (engine.name, engine.reason) == ("fused", None)
    theirs = dict(dm.named_parameters())
    ours = dict(engine.model.named_parameters())
    assert ours.keys() == theirs.keys() and all(ours[n].data_ptr() == theirs[n].data_ptr() for n in ours)
    assert engine.model.dtype == pack.wan.compute_dtype(fp8) == torch.float32  # (on a CPU ComfyUI computes in fp32)

    pos = prompt(4)
    settings = pack.samplers.SampleSettings(width=W, height=H, frames=3, chunk_frames=1, seed=2)
    fused = pack.samplers.sample(fp8, [[pos, {}]], None, settings)["samples"]
    monkeypatch.setattr(pack.engines, "_fused_blocker", lambda *a: "forced for the test")
    ref = pack.samplers.sample(fp8, [[pos, {}]], None, settings)["samples"]
    assert rel(fused, ref) <= 1e-5


def test_weight_patches_are_used_as_comfyui_applied_them(models, pack, monkeypatch):
    """A LoRA-style weight patch (a diff on one projection): ComfyUI applies it to the tensor when it loads
    the model, and the fused engine runs over that very tensor, so it samples what ComfyUI's forward samples."""
    comfy_model, _ = models
    dm = comfy_model.model.diffusion_model
    original = dm.blocks[0].self_attn.q.weight.detach().clone()
    delta = 0.05 * torch.randn(original.shape, generator=torch.Generator().manual_seed(8))
    lora = comfy_model.clone()
    lora.add_patches({"diffusion_model.blocks.0.self_attn.q.weight": (delta,)}, 1.0)
    pos = prompt(5)
    settings = pack.samplers.SampleSettings(width=W, height=H, frames=3, chunk_frames=1, seed=4)
    read = []

    def on_engine(engine):  # what the forward reads, while ComfyUI has the model loaded for this rollout
        ours, theirs = engine.model.blocks[0].self_attn.q.weight, dm.blocks[0].self_attn.q.weight
        read.append((engine.name, ours.data_ptr() == theirs.data_ptr(), not torch.equal(theirs, original)))

    plain = pack.samplers.sample(comfy_model, [[pos, {}]], None, settings)["samples"]
    fused = pack.samplers.sample(lora, [[pos, {}]], None, settings, on_engine=on_engine)["samples"]
    monkeypatch.setattr(pack.engines, "_fused_blocker", lambda *a: "forced for the test")
    comfy = pack.samplers.sample(lora, [[pos, {}]], None, settings)["samples"]
    (name, same_tensor, patched), = read
    assert name == "fused" and same_tensor
    assert rel(fused, comfy) <= 1e-5
    if patched:  # (the pip-installable ComfyUI keeps a model loaded for one patcher as it is for the next)
        assert rel(fused, plain) > 1e-3  # the patch is in


def test_the_long_sampler_starts_from_an_image(comfy, models, checkpoint, vae):
    """FAST-AR Start Image: the image encoded as core's AR Video I2V encodes it is the video's first latent
    frame, cached before the first chunk; the rollout is the library's with that start latent. (A model
    of its own: the pip-installable ComfyUI may keep the shared one loaded as an earlier test patched it.)"""
    from comfyui_fastar.fastar import FastARError, TempCacheConfig
    from comfyui_fastar.nodes.sampler_nodes import AutoregressiveLongSampler, StartImageNode
    from comfyui_fastar.nodes.samplers import encode_start_image
    from comfyui_fastar.nodes.settings_nodes import PatchModel

    core = models[1]
    comfy_model = comfy.sd.load_diffusion_model(str(checkpoint), model_options={"dtype": torch.float32})
    image = torch.rand(1, 2 * H, W, 3, generator=torch.Generator().manual_seed(3))  # resized to the video's size
    tc = TempCacheConfig(max_cache_frames=3, sink_frames=1, merge_threshold=0.5)
    patched = PatchModel.execute(comfy_model, tc).result[0]
    pos = prompt(1)

    def sample(length, **kw):
        return AutoregressiveLongSampler.execute(patched, [[pos, {}]], W, H, length, 1, 3, "1000,750,500,250", 5.0,
                                                 "1", 0.0, 1.0, **kw).result[0]["samples"]

    first = StartImageNode.execute(image, vae).result[0]
    latent = sample(13, start=first)  # 4 latent frames: the image's, then 3 chunks of 1
    start = encode_start_image(vae, image, W, H)
    assert latent.shape[2] == 4 and rel(latent[:, :, :1], start) <= 1e-5
    ref = _core_rollout(core, pos, frames=4, chunk=1, cache=tc, start=comfy_model.model.process_latent_in(start))
    assert rel(latent, comfy_model.model.process_latent_out(ref)) <= TOL
    assert rel(latent[:, :, 1:], sample(13)[:, :, 1:]) > 1e-3  # the image conditions what follows
    with pytest.raises(FastARError, match="length 1 holds only the start image"):
        sample(1, start=first)


def test_the_samplers_keep_the_block_size_the_checkpoint_records(comfy, tmp_path, caplog):
    """A file ``fastar convert --preset`` wrote records its sampling: where ComfyUI says which file the
    MODEL came from (newer trees; 0.3.x keep no trace of it), the Long Sampler takes its block size, steps
    and shift from it (and says so); with checkpoint_sampling off, another block size is refused before it
    runs, and other steps or shift are logged."""
    import logging

    from safetensors.torch import save_file

    from comfyui_fastar.fastar import FastARError
    from comfyui_fastar.fastar.models import SAMPLING_METADATA_KEY, Sampling
    from comfyui_fastar.nodes.progress import comfy_module
    from comfyui_fastar.nodes.sampler_nodes import AutoregressiveLongSampler
    from comfyui_fastar.nodes.wan import recorded_sampling
    from comfyui_fastar.testing.comfy_harness import tiny_wan

    sampling = Sampling(3, (1000, 757, 522), 1.0, "causvid")
    path = tmp_path / "causvid_tiny.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_wan().state_dict().items()}, str(path),
              metadata={SAMPLING_METADATA_KEY: sampling.to_json()})
    comfy_module("folder_paths").add_model_folder_path("diffusion_models", str(tmp_path))
    model = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.float32})

    def sample(block, timesteps="1000,757,522", shift=1.0, checkpoint_sampling=False):
        return AutoregressiveLongSampler.execute(model, [[prompt(1), {}]], W, H, 9, 1, 3, timesteps, shift, block,
                                                 0.0, 1.0, checkpoint_sampling=checkpoint_sampling).result[0]["samples"]

    if getattr(model, "ckpt_name", None) is None:  # this ComfyUI keeps no trace of the file
        assert recorded_sampling(model) is None
        assert torch.equal(sample("1", checkpoint_sampling=True), sample("1"))  # the widgets, either way
        return
    assert recorded_sampling(model) == ("causvid_tiny.safetensors", sampling)
    with caplog.at_level(logging.INFO):  # the file's sampling, whatever the widgets say
        taken = sample("1", "1000,750,500,250", 5.0, checkpoint_sampling=True)
    assert "sampling as causvid_tiny.safetensors records (3 frames per block, timesteps 1000,757,522, shift 1)" \
           in caplog.text
    assert torch.equal(taken, sample("3"))
    assert not torch.equal(taken, sample("3", "1000,750,500,250", 5.0))
    caplog.clear()
    with pytest.raises(FastARError, match=r"frames_per_chunk is 1, but causvid_tiny.safetensors records 3 latent "
                                          r"frames per block \(3 frames per block, timesteps 1000,757,522, shift 1\)"):
        sample("1")
    with caplog.at_level(logging.WARNING):
        assert sample("3").shape[2] == 3
    assert "records 3 frames per block" not in caplog.text
    with caplog.at_level(logging.WARNING):
        sample("3", "1000,750,500,250", 5.0)
    assert "causvid_tiny.safetensors records 3 frames per block, timesteps 1000,757,522, shift 1; the sampler's" \
           in caplog.text


def test_the_world_sampler_places_the_route_by_route_seed_and_draws_the_noise_by_seed(pack, twins):
    """Two World Samplers compared on one graph fly one route whatever their noise: route_seed alone places
    the route on the photograph (the ground truth), seed alone draws the noise (the frames made)."""
    from comfyui_fastar.nodes.world_nodes import BUNDLED, Actions, WorldModelLoader, WorldSampler

    world = WorldModelLoader.execute(BUNDLED).result[0]

    def fly(seed, route_seed):
        return WorldSampler.execute(world, Actions("A+S, D"), 12, seed, route_seed).result

    frames, truth = fly(0, 0)
    assert truth.shape == frames.shape == (24, 64, 64, 3)
    again, same_truth = fly(0, 0)
    assert torch.equal(again, frames) and torch.equal(same_truth, truth)
    other_noise, noise_truth = fly(1, 0)
    assert torch.equal(noise_truth, truth) and not torch.equal(other_noise[12:], frames[12:])
    assert not torch.equal(fly(0, 1)[1], truth)  # another route_seed: another place on the photograph
