"""The published causal checkpoints through ComfyUI's own Load Diffusion Model: each converted file
(and Krea Realtime's safetensors file as it is) loads as ComfyUI's Wan model with exactly the weights
the conversion wrote; LongLive's LoRA merged by ``fastar convert`` equals the base with the same
adapters applied by ComfyUI's LoRA loader."""
import pytest
import torch

from comfyui_fastar.fastar.models import KNOWN_CHECKPOINTS, WanConfig, convert_checkpoint
from comfyui_fastar.testing.checkpoints import LORA_RANK, converted, wan_weights, write_checkpoint
from comfyui_fastar.testing.comfy_harness import TINY

pytestmark = pytest.mark.comfyui


def _weights(seed, dtype):  # ComfyUI's Wan detection needs heads of 128
    return wan_weights(seed, dtype, WanConfig(**TINY))


def _comfy_load(comfy, path):
    loaded = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.float32})
    return loaded, loaded.model.diffusion_model.state_dict()


def _causal_model_name(comfy):
    import comfy.model_base

    return "WAN21_CausalAR" if hasattr(comfy.model_base, "WAN21_CausalAR") else "WAN21"


@pytest.mark.parametrize("preset", list(KNOWN_CHECKPOINTS))
def test_a_converted_known_checkpoint_loads_in_comfyui(comfy, tmp_path, preset):
    src, extra, expected = write_checkpoint(preset, tmp_path, _weights)
    dst = tmp_path / f"{preset}.safetensors"
    convert_checkpoint(src, dst, preset=preset, dtype=torch.float32, **extra)  # 2 heads of 128: no --num-heads
    loaded, theirs = _comfy_load(comfy, dst)
    assert type(loaded.model).__name__ == _causal_model_name(comfy)
    written, _ = converted(dst)
    assert theirs.keys() == written.keys() and all(torch.equal(theirs[k], written[k]) for k in theirs)
    assert max((theirs[k].double() - v.double()).abs().max().item() for k, v in expected.items()) < 1e-5


def test_krea_realtimes_file_loads_in_comfyui_as_it_is(comfy, tmp_path):
    """Its ``model.``-prefixed safetensors file, unconverted: ComfyUI strips the prefix and builds its
    plain Wan model (no causal mark) with the file's weights."""
    src, _, expected = write_checkpoint("krea-realtime-14b", tmp_path, _weights)
    loaded, theirs = _comfy_load(comfy, src)
    assert type(loaded.model).__name__ == "WAN21"
    assert theirs.keys() == expected.keys() and all(torch.equal(theirs[k], v.float()) for k, v in expected.items())


def test_longlive_merged_by_convert_equals_its_lora_applied_by_comfyui(comfy, tmp_path):
    """The LoRA merged into the file (``--preset longlive --lora``) against the unmerged base loaded in
    ComfyUI with the same adapters applied by its LoRA loader (peft names as ComfyUI's generic LoRA
    format has them, alpha 256 as LongLive's config sets it)."""
    import comfy.model_management
    import comfy.sd

    src, extra, _ = write_checkpoint("longlive", tmp_path, _weights)
    merged, base = tmp_path / "merged.safetensors", tmp_path / "base.safetensors"
    convert_checkpoint(src, merged, preset="longlive", dtype=torch.float32, **extra)
    convert_checkpoint(src, base, preset="longlive", dtype=torch.float32)
    adapters = torch.load(extra["lora"], weights_only=True)["generator_lora"]
    lora = {k.replace("base_model.model.", "diffusion_model."): v for k, v in adapters.items()}
    for k in [k for k in lora if k.endswith(".lora_A.weight")]:
        lora[k.removesuffix(".lora_A.weight") + ".alpha"] = torch.tensor(256.0)  # scale alpha / rank
    assert lora[k].shape[0] == LORA_RANK

    model, _ = _comfy_load(comfy, base)
    patched, _ = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0.0)
    comfy.model_management.load_models_gpu([patched])  # ComfyUI applies the patches to the weights here
    try:
        theirs = {k: v.detach().clone() for k, v in patched.model.diffusion_model.state_dict().items()}
    finally:
        comfy.model_management.unload_all_models()
    ours, _ = converted(merged)
    changed = [k for k in ours if not torch.equal(ours[k], converted(base)[0][k])]
    assert len(changed) == len(adapters) // 2  # every adapted layer, and only those
    assert theirs.keys() == ours.keys()
    worst = max(((theirs[k] - ours[k]).abs().max() / ours[k].abs().max().clamp_min(1e-3)).item() for k in ours)
    assert worst <= 1e-5, worst  # relative to each tensor's largest weight (zero-initialised biases: absolute)
