"""Each published causal Wan 2.1 checkpoint, as its training code writes it (``testing.checkpoints``),
converts with its preset and loads back to the weights written, with its sampling in the metadata."""
import json

import pytest
import torch

from comfyui_fastar.fastar import FastARError
from comfyui_fastar.fastar.cli import main
from comfyui_fastar.fastar.models import (KNOWN_CHECKPOINTS, SAMPLING_METADATA_KEY, WAN_CONFIGS, Sampling, WanModel,
                                          checkpoint_sampling, convert_checkpoint, infer_config, load_wan)
from comfyui_fastar.fastar.models.loading import strip_prefix
from comfyui_fastar.testing.checkpoints import (BLOCK_LINEARS, HEADS, LORA_RANK, converted, longlive_base,
                                                longlive_lora, merged_independently, prefixed, wan_weights,
                                                write_checkpoint)


SAMPLINGS = {  # read off each repository's configs and inference code (fastar/models/checkpoints.py)
    "self-forcing": (3, (1000, 750, 500, 250), 5.0),
    "causvid": (3, (1000, 757, 522), 1.0),  # configs/wan_causal_dmd.yaml, not warped
    "longlive": (3, (1000, 750, 500, 250), 5.0),
    "causal-forcing-chunkwise": (3, (1000, 750, 500, 250), 5.0),
    "causal-forcing-framewise": (1, (1000, 750, 500, 250), 5.0),
    "rolling-forcing": (3, (1000, 800, 600, 400, 200), 5.0),
    "krea-realtime-14b": (3, (1000, 750, 500, 250), 5.0),
}


def test_every_known_checkpoint_is_tested():
    assert sorted(SAMPLINGS) == sorted(KNOWN_CHECKPOINTS)


@pytest.mark.parametrize("preset", sorted(SAMPLINGS))
def test_each_known_checkpoint_converts_to_the_weights_it_holds(tmp_path, preset):
    """The converted file holds the entry its inference reads under bare Wan names (a LoRA merged in),
    is marked causal, records the checkpoint's sampling, and load_wan builds the model from it."""
    src, extra, expected = write_checkpoint(preset, tmp_path, lambda seed, dtype: wan_weights(seed, dtype))
    dst = tmp_path / "converted.safetensors"
    out = torch.bfloat16 if preset == "krea-realtime-14b" else torch.float32  # as the file came
    done = convert_checkpoint(src, dst, preset=preset, dtype=out, num_heads=HEADS, **extra)
    sampling = Sampling(*SAMPLINGS[preset], preset)
    assert done.sampling == sampling and done.lora_layers == (20 if preset == "longlive" else 0)
    tensors, metadata = converted(dst)
    assert sorted(tensors) == sorted(expected)
    assert max((tensors[k].double() - v.double()).abs().max().item() for k, v in expected.items()) < 1e-5
    if preset != "longlive":
        assert all(torch.equal(tensors[k], v.to(out)) for k, v in expected.items())  # exactly
    assert json.loads(metadata["config"]) == {"transformer": {"causal_ar": True}}
    assert json.loads(metadata[SAMPLING_METADATA_KEY]) == json.loads(sampling.to_json())
    assert checkpoint_sampling(dst) == sampling
    model = load_wan(dst)
    assert all(torch.equal(model.state_dict()[k], tensors[k]) for k in tensors)


def test_causvids_steps_are_used_as_listed():
    assert Sampling(*SAMPLINGS["causvid"]).schedule().sigmas() == pytest.approx([1.0, 0.757, 0.522])


def testlonglive_base_and_lora_merge_into_one_model(tmp_path, capsys):
    """The merged file is W + alpha / rank * B @ A on the adapted layers (against float64, to 1e-5) and
    the base's weights elsewhere; the CLI says so."""
    base, extra, expected = write_checkpoint("longlive", tmp_path, lambda seed, dtype: wan_weights(seed, dtype))
    gen, dst = wan_weights(1), tmp_path / "longlive.safetensors"
    assert main(["convert", str(base), str(dst), "--preset", "longlive", "--lora", str(extra["lora"]),
                 "--dtype", "float32", "--num-heads", str(HEADS)]) == 0
    said = capsys.readouterr().out
    assert "LoRA lora.pt merged into 20 linear layers" in said
    assert "sampling: 3 frames per block, timesteps 1000,750,500,250, shift 5" in said
    tensors, _ = converted(dst)
    assert max((tensors[k].double() - v).abs().max().item() for k, v in expected.items()) < 1e-5
    adapted = {f"blocks.{i}.{layer}.weight" for i in range(2) for layer in BLOCK_LINEARS}
    assert all(torch.equal(tensors[k], v) for k, v in gen.items() if k not in adapted)  # biases, norms, head
    assert not any(torch.allclose(tensors[k], gen[k]) for k in adapted)

    # LongLive's inference also takes the adapters as the whole file; --lora-alpha sets the scale
    lora = torch.load(extra["lora"], weights_only=True)["generator_lora"]
    flat = tmp_path / "lora_flat.pt"
    torch.save(lora, flat)
    convert_checkpoint(base, dst, preset="longlive", lora=flat, lora_alpha=2.0, dtype=torch.float32,
                       num_heads=HEADS)
    tensors, _ = converted(dst)
    expected = merged_independently(gen, lora, 2.0 / LORA_RANK)
    assert max((tensors[k].double() - v).abs().max().item() for k, v in expected.items()) < 1e-5


def test_a_lora_that_does_not_fit_is_refused_and_nothing_is_written(tmp_path):
    gen = wan_weights(1)
    base, dst = tmp_path / "longlive_base.pt", tmp_path / "out.safetensors"
    longlive_base(base, gen, wan_weights(2), wan_weights(3))
    lora = longlive_lora(gen, 4, seed=7)

    def refused(adapters, match, **kw):
        path = tmp_path / "lora.pt"
        torch.save({"generator_lora": adapters, "step": 3}, path)
        with pytest.raises(FastARError, match=match):
            convert_checkpoint(base, dst, preset="longlive", lora=path, num_heads=HEADS, **kw)
        assert not dst.exists()

    refused({**lora, "base_model.model.blocks.0.extra.lora_A.weight": torch.zeros(4, 64),
             "base_model.model.blocks.0.extra.lora_B.weight": torch.zeros(64, 4)},
            "adapts blocks.0.extra, which the base checkpoint has no weight for")
    refused({k: v for k, v in lora.items() if k != "base_model.model.blocks.1.ffn.2.lora_B.weight"},
            "blocks.1.ffn.2 has lora_A but no lora_B")
    refused({**lora, "base_model.model.blocks.0.ffn.0.lora_A.weight": torch.zeros(4, 3)},
            r"blocks.0.ffn.0's lora_B \(128, 4\) @ lora_A \(4, 3\) does not fit its weight \(128, 64\)")
    refused({**lora, "base_model.model.blocks.0.lora_magnitude_vector": torch.zeros(64)},
            "not a LoRA of lora_A / lora_B weights: it holds base_model.model.blocks.0.lora_magnitude_vector")
    refused(lora, "lora.pt has no entry 'adapters'", lora_key="adapters")
    # the LoRA file given as the model: what it is, and the command that merges it
    path = tmp_path / "lora.pt"
    torch.save({"generator_lora": lora, "critic_lora": lora, "step": 3}, path)
    with pytest.raises(FastARError, match=r"lora.pt holds LoRA adapters, not a full model .*"
                                          r"fastar convert BASE.pt DST.safetensors --lora lora.pt"):
        convert_checkpoint(path, dst, preset="longlive")
    assert not dst.exists()


@pytest.mark.parametrize("preset", ["causal-forcing-chunkwise", "causal-forcing-framewise"])
def test_a_file_without_the_entry_its_inference_reads_is_refused(tmp_path, preset):
    """Causal-Forcing's files hold one entry: the chunk-wise model's other entry is not silently taken."""
    entry = KNOWN_CHECKPOINTS[preset].key
    other, dst = tmp_path / "causal_forcing.pt", tmp_path / "out.safetensors"
    torch.save({("generator" if entry == "generator_ema" else "generator_ema"): prefixed(wan_weights(4), "model.")},
               other)
    with pytest.raises(FastARError, match=f"has no entry '{entry}', where thu-ml/Causal-Forcing's inference "
                                          f"reads the {preset} weights .*--key"):
        convert_checkpoint(other, dst, preset=preset, num_heads=HEADS)
    assert not dst.exists()


def test_krea_realtime_14b_loads_as_it_is(tmp_path):
    """Its safetensors file loads without conversion (the ``model.`` prefix stripped, no sampling
    recorded); its real names and shapes read as 40 heads of 128 at dim 5120."""
    src, _, weights = write_checkpoint("krea-realtime-14b", tmp_path, lambda seed, dtype: wan_weights(seed, dtype))
    as_is = load_wan(src, num_heads=HEADS)
    assert all(torch.equal(as_is.state_dict()[k], v) for k, v in weights.items())
    assert checkpoint_sampling(src) is None
    with pytest.raises(FastARError, match="not over it"):
        convert_checkpoint(src, src, preset="krea-realtime-14b")
    with torch.device("meta"):
        full = prefixed(WanModel(WAN_CONFIGS["14B"]).state_dict(), "model.")
    config = infer_config(strip_prefix(full))
    assert (config.dim, config.num_heads, config.num_layers) == (5120, 40, 40)


def test_the_cli_samples_as_the_checkpoint_records(tmp_path, capsys):
    """fastar rollout --checkpoint takes frames per chunk, timesteps and shift from the file; its flags win."""
    src, dst = tmp_path / "framewise.pt", tmp_path / "framewise.safetensors"
    torch.save({"generator_ema": prefixed(wan_weights(6), "model._fsdp_wrapped_module.")}, src)
    convert_checkpoint(src, dst, preset="causvid", key="generator_ema", num_heads=HEADS)
    common = ["rollout", "--checkpoint", str(dst), "--frames", "3", "--height", "32", "--width", "32", "--cache", "window",
              "--sink-frames", "1", "--window-frames", "3", "--plot", str(tmp_path / "p.png")]
    assert main(common) == 0
    out = capsys.readouterr().out
    assert "sampled as it records: 3 frames per block, timesteps 1000,757,522, shift 1" in out
    assert "chunks of 3, 3 steps" in out
    assert main(common + ["--chunk-frames", "1", "--timesteps", "1000,500", "--shift", "5"]) == 0
    out = capsys.readouterr().out
    assert "sampled as" not in out and "chunks of 1, 2 steps" in out


def test_convert_records_the_sampling_it_is_given(tmp_path, capsys):
    src, dst = tmp_path / "ckpt.pt", tmp_path / "ckpt.safetensors"
    torch.save({"generator": prefixed(wan_weights(1), "model.")}, src)
    args = ["convert", str(src), str(dst), "--num-heads", str(HEADS)]
    assert main(args) == 0  # nothing known: the weights, no sampling
    assert "no sampling recorded" in capsys.readouterr().out and checkpoint_sampling(dst) is None
    assert main(args + ["--frames-per-block", "1", "--timesteps", "1000,500", "--shift", "3"]) == 0
    assert checkpoint_sampling(dst) == Sampling(1, (1000, 500), 3.0)
    assert main(args + ["--preset", "causal-forcing-chunkwise", "--frames-per-block", "1"]) == 0  # over a preset
    assert checkpoint_sampling(dst) == Sampling(1, (1000, 750, 500, 250), 5.0)
    dst.unlink()
    assert main(args + ["--timesteps", "1000,500"]) == 2
    assert "needs --frames-per-block, --shift too" in capsys.readouterr().err and not dst.exists()
    assert main(args + ["--preset", "self-forcing", "--frames-per-block", "0"]) == 2
    assert "frames per block must be a positive integer" in capsys.readouterr().err and not dst.exists()


def test_a_known_checkpoint_holding_an_object_gets_the_resave_line_for_its_entry(tmp_path):
    """The refusal's re-save line names the preset's entry, and its convert command keeps the preset."""
    import argparse

    src, dst = tmp_path / "causal_forcing.pt", tmp_path / "out.safetensors"
    torch.save({"generator": prefixed(wan_weights(1), "model."), "args": argparse.Namespace(lr=1e-5)}, src)
    with pytest.raises(FastARError) as refused:
        convert_checkpoint(src, dst, preset="causal-forcing-chunkwise", num_heads=HEADS)
    message = str(refused.value)
    weights = tmp_path / "causal_forcing_weights.pt"
    assert f"torch.save(ck['generator'], '{weights}')" in message
    assert message.endswith(f"fastar convert {weights} {dst} --preset causal-forcing-chunkwise")
    assert not dst.exists() and "weights_only=False" not in message
