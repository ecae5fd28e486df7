"""The published causal checkpoints through ComfyUI's own Load Diffusion Model: each converted file
(and Krea Realtime's safetensors file as it is) loads as ComfyUI's Wan model with exactly the weights
the conversion wrote. Needs ``COMFYUI_PATH`` (a ComfyUI checkout); skipped otherwise."""
import os

import pytest
import torch

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
pytestmark = pytest.mark.skipif(not COMFYUI_PATH, reason="COMFYUI_PATH is not set (no ComfyUI checkout to test against)")

# ComfyUI's Wan detection reads heads as dim // 128, a frequency size of 256 and a text width of 4096
TINY = dict(dim=256, ffn_dim=256, num_heads=2, num_layers=2, text_dim=4096, freq_dim=256)


@pytest.fixture(scope="module")
def comfy():
    from test_comfy_bridge import _import_comfy

    return _import_comfy()


def _weights(seed, dtype):
    from test_known_checkpoints import wan_weights

    from comfyui_fastar.fastar.models import WanConfig

    return wan_weights(seed, dtype, WanConfig(**TINY))


def _comfy_load(comfy, path):
    loaded = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.float32})
    return loaded, loaded.model.diffusion_model.state_dict()


def _causal_model_name(comfy):
    import comfy.model_base

    return "WAN21_CausalAR" if hasattr(comfy.model_base, "WAN21_CausalAR") else "WAN21"


@pytest.mark.parametrize("preset", ["self-forcing", "causvid", "longlive", "causal-forcing-chunkwise",
                                    "causal-forcing-framewise", "rolling-forcing", "krea-realtime-14b"])
def test_a_converted_known_checkpoint_loads_in_comfyui(comfy, tmp_path, preset):
    from test_known_checkpoints import converted, write_checkpoint

    from comfyui_fastar.fastar.models import convert_checkpoint

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
    from test_known_checkpoints import write_checkpoint

    src, _, expected = write_checkpoint("krea-realtime-14b", tmp_path, _weights)
    loaded, theirs = _comfy_load(comfy, src)
    assert type(loaded.model).__name__ == "WAN21"
    assert theirs.keys() == expected.keys() and all(torch.equal(theirs[k], v.float()) for k, v in expected.items())
