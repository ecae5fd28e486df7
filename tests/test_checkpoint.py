"""Checkpoints load through safetensors, with ComfyUI's key prefix, and reproduce the model."""
import pytest
import torch
from safetensors.torch import save_file

from comfyui_fastar.fastar import FastARError
from comfyui_fastar.fastar.models import WAN_CONFIGS, build_model, convert_checkpoint, infer_config, load_wan, save_wan


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=5)


def outputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, 3, 8, 12, generator=g)
    ctx = torch.randn(2, 9, model.context_dim, generator=g)
    return model(x, torch.tensor([900.0, 250.0]), ctx, frame_offset=4)


def test_roundtrip_with_metadata(model, tmp_path):
    path = tmp_path / "tiny.safetensors"
    save_wan(model, path)
    loaded = load_wan(path)
    assert loaded.config == model.config
    assert torch.equal(outputs(loaded), outputs(model))


def test_comfy_prefixed_state_dict_infers_config(model, tmp_path):
    """A plain state dict as ComfyUI saves diffusion models: prefixed keys, no metadata."""
    path = tmp_path / "wan_comfy.safetensors"
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    with pytest.raises(FastARError, match="head count"):
        load_wan(path)  # dim 64 is not a multiple of Wan's head_dim 128
    loaded = load_wan(path, num_heads=2)
    assert loaded.config == model.config
    assert torch.equal(outputs(loaded), outputs(model))


def test_load_casts_dtype(model, tmp_path):
    path = tmp_path / "tiny.safetensors"
    save_wan(model, path)
    assert load_wan(path, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_infer_real_wan_configs():
    """Shapes of the real 1.3B and 14B checkpoints give back their configs (head_dim 128)."""
    for name in ("1.3B", "14B"):
        with torch.device("meta"):
            from comfyui_fastar.fastar.models import WanModel
            sd = WanModel(WAN_CONFIGS[name]).state_dict()
        assert infer_config(sd) == WAN_CONFIGS[name]


def test_bad_checkpoints_name_the_problem(model, tmp_path):
    with pytest.raises(FastARError, match="checkpoint not found"):
        load_wan(tmp_path / "missing.safetensors")
    pt = tmp_path / "weights.pt"
    torch.save(model.state_dict(), pt)
    with pytest.raises(FastARError, match="only .safetensors"):
        load_wan(pt)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(FastARError, match="not a readable safetensors"):
        load_wan(junk)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    i2v = tmp_path / "i2v.safetensors"
    save_file({**sd, "img_emb.proj.1.weight": torch.zeros(4, 4)}, str(i2v))
    with pytest.raises(FastARError, match="image-to-video"):
        load_wan(i2v, num_heads=2)
    partial = tmp_path / "partial.safetensors"
    save_file({k: v for k, v in sd.items() if not k.startswith("head.")}, str(partial))
    with pytest.raises(FastARError, match="head.head.weight"):
        load_wan(partial, num_heads=2)
    other = tmp_path / "other.safetensors"
    save_file({"encoder.weight": torch.zeros(2, 2)}, str(other))
    with pytest.raises(FastARError, match="not a Wan 2.1 diffusion model"):
        load_wan(other)


def _training_checkpoint(model, path, **extra):
    """A .pt file shaped like Self-Forcing's: the generator (a wrapper whose Wan model is ``model``,
    FSDP-wrapped) under generator_ema and generator, beside the critic and optimizer entries."""
    sd = {f"model._fsdp_wrapped_module.{k}": v.clone() for k, v in model.state_dict().items()}
    other = {k: v + 1 for k, v in sd.items()}
    torch.save({"generator": other, "generator_ema": sd, "critic": {"w": torch.zeros(2)}, "step": 1200, **extra},
               path)


def test_a_training_checkpoint_converts_to_the_file_comfyui_and_the_cli_load(model, tmp_path, capsys):
    from safetensors import safe_open

    from comfyui_fastar.fastar.cli import main

    src, dst = tmp_path / "self_forcing_dmd.pt", tmp_path / "self_forcing_dmd.safetensors"
    _training_checkpoint(model, src)
    assert main(["convert", str(src), str(dst), "--dtype", "float32", "--num-heads", "2"]) == 0
    assert "dim 64, 2 heads, 2 blocks, float32" in capsys.readouterr().out
    loaded = load_wan(dst)  # the config is in the metadata now
    assert loaded.config == model.config
    assert torch.equal(outputs(loaded), outputs(model))  # the EMA generator, exactly
    with safe_open(str(dst), framework="pt") as f:
        assert '"causal_ar": true' in f.metadata()["config"]  # ComfyUI's causal Wan with core's AR nodes

    convert_checkpoint(src, dst, key="generator", num_heads=2)  # bf16 by default
    bf16 = load_wan(dst)
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16.state_dict()["head.head.weight"], (model.state_dict()["head.head.weight"] + 1).bfloat16())


def test_conversion_refuses_what_it_cannot_write_and_runs_no_code(model, tmp_path):
    import pathlib

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return pathlib.Path.touch, (marker,)

    src, dst = tmp_path / "evil.pt", tmp_path / "out.safetensors"
    _training_checkpoint(model, src, extra=Payload())
    with pytest.raises(FastARError) as refused:
        convert_checkpoint(src, dst, num_heads=2)
    assert not marker.exists() and not dst.exists()
    message = str(refused.value)
    assert message.startswith("evil.pt carries code: loading it would call ")  # what the file holds
    assert "pathlib.Path" in message and "Nothing in the file ran and nothing was written" in message
    assert "python -c" not in message and "add_safe_globals" not in message  # no way to let it in
    assert "weights_only=False" not in message and "weights_only set to False" not in message

    lora = tmp_path / "longlive_lora.pt"
    torch.save({"generator_ema": {"model.blocks.0.self_attn.q.lora_A.weight": torch.zeros(2, 2)}}, lora)
    with pytest.raises(FastARError, match="LoRA adapters"):
        convert_checkpoint(lora, dst)
    nothing = tmp_path / "nothing.pt"
    torch.save({"optimizer": {"lr": torch.tensor(1.0)}, "step": 3}, nothing)
    with pytest.raises(FastARError, match=r"no Wan weights found \(entries: optimizer, step\); .*--key"):
        convert_checkpoint(nothing, dst)
    _training_checkpoint(model, src)
    with pytest.raises(FastARError, match=r"no entry 'ema' \(entries: generator, generator_ema, critic, step\)"):
        convert_checkpoint(src, dst, key="ema", num_heads=2)
    with pytest.raises(FastARError, match="must be a .safetensors file"):
        convert_checkpoint(src, tmp_path / "out.pt", num_heads=2)


def test_the_pack_folders_convert_script_needs_no_install(model, tmp_path):
    """A cloned pack (custom_nodes/ComfyUI-FastAR, not importable by its folder name) converts with
    ComfyUI's Python and the script beside the nodes."""
    import subprocess
    import sys
    from pathlib import Path

    src, dst = tmp_path / "ckpt.pt", tmp_path / "ckpt.safetensors"
    _training_checkpoint(model, src)
    script = Path(__file__).resolve().parents[1] / "convert.py"
    run = subprocess.run([sys.executable, str(script), str(src), str(dst), "--num-heads", "2"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    converted = load_wan(dst).state_dict()
    assert all(torch.equal(converted[k], v.bfloat16()) for k, v in model.state_dict().items())
    bad = subprocess.run([sys.executable, str(script), str(tmp_path / "missing.pt"), str(dst)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "checkpoint not found" in bad.stderr


def test_a_trusted_checkpoint_holding_a_config_object_gets_a_line_that_resaves_it(model, tmp_path):
    """A training checkpoint with a config object beside its weights (argparse.Namespace here) is refused,
    and the one line of Python the message gives, run as it stands, writes a weights file that converts."""
    import argparse
    import re
    import shlex
    import subprocess
    import sys

    src, dst = tmp_path / "trained.pt", tmp_path / "trained.safetensors"
    _training_checkpoint(model, src, config=argparse.Namespace(lr=2e-6, num_frame_per_block=3))
    with pytest.raises(FastARError) as refused:
        convert_checkpoint(src, dst, num_heads=2)
    message = str(refused.value)
    assert "argparse.Namespace" in message and not dst.exists() and "weights_only=False" not in message
    line = re.search(r'python -c "[^"]+"', message).group(0)
    subprocess.run([sys.executable, *shlex.split(line)[1:]], check=True, cwd=tmp_path)
    weights = tmp_path / "trained_weights.pt"
    assert f"fastar convert {weights} {dst}" in message
    convert_checkpoint(weights, dst, num_heads=2)
    converted = load_wan(dst).state_dict()
    assert all(torch.equal(converted[k], v.bfloat16()) for k, v in model.state_dict().items())


def test_a_file_that_is_no_checkpoint_is_refused_in_the_converters_words(tmp_path):
    src, dst = tmp_path / "notes.pt", tmp_path / "out.safetensors"
    src.write_text("not a checkpoint")
    with pytest.raises(FastARError, match=r"^notes.pt is not a torch checkpoint this converter can read .*"
                                          r"nothing was written$"):
        convert_checkpoint(src, dst)
    assert not dst.exists()


def test_a_pt_with_the_training_scripts_own_object_lists_its_entries_and_its_pasted_line_runs(model, tmp_path):
    """A .pt whose training script pickled an object of its own class (``__main__.X``) beside the weights,
    under entries the converter does not guess: the refusal lists the entries, picks the one holding the
    tensors, and its one line, pasted into a shell, re-saves them; the command it ends with converts them."""
    import argparse
    import shlex
    import subprocess
    import sys

    from safetensors.torch import save_file

    src, dst = tmp_path / "run.pt", tmp_path / "run.safetensors"
    weights = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    script = ("import torch\nfrom safetensors.torch import load_file\n"
              "class TrainConfig:\n    def __init__(self):\n        self.lr = 1e-5\n"
              f"torch.save({{'model': load_file({str(weights)!r}), 'obj': TrainConfig(), 'step': 7}}, {str(src)!r})\n")
    subprocess.run([sys.executable, "-c", script], check=True)
    stated = tmp_path / "stated.pt"  # a module's state_dict() as it is: an OrderedDict that pickles its _metadata
    torch.save({"model": model.state_dict(), "config": argparse.Namespace(lr=1e-5)}, stated)
    with pytest.raises(FastARError, match=rf"its entries: model \({len(model.state_dict())} tensors\), config "
                                          rf"\(an argparse.Namespace\)"):
        convert_checkpoint(stated, dst, num_heads=2)
    with pytest.raises(FastARError) as refused:
        convert_checkpoint(src, dst, num_heads=2)
    message = str(refused.value)
    assert "holds an object of __main__.TrainConfig" in message and not dst.exists()
    n = len(model.state_dict())
    assert f"its entries: model ({n} tensors), obj (a __main__.TrainConfig), step (an int)" in message
    line = message.split(" with the Python and packages the checkpoint was made with: ", 1)[1].split(" ; then", 1)[0]
    assert line.startswith("python -c ") and "ck['model']" in line
    run = subprocess.run(line.replace("python", shlex.quote(sys.executable), 1), shell=True, cwd=tmp_path,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    then = shlex.split(message.split("; then convert that file: ", 1)[1])
    assert then[:2] == ["fastar", "convert"]
    from comfyui_fastar.fastar.cli import main

    assert main([*then[1:], "--num-heads", "2", "--dtype", "float32"]) == 0
    assert torch.equal(load_wan(dst).state_dict()["head.head.weight"], model.state_dict()["head.head.weight"])
