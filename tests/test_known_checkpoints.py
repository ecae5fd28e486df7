"""Each published causal Wan 2.1 checkpoint, as its training code writes it (entries, key names,
wrapper prefixes, dtypes, what else the file holds; tiny shapes, random values), converts with its
preset and loads back to the weights written, with its sampling in the metadata."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from comfyui_fastar.fastar import FastARError
from comfyui_fastar.fastar.cli import main
from comfyui_fastar.fastar.models import (KNOWN_CHECKPOINTS, SAMPLING_METADATA_KEY, WAN_CONFIGS, Sampling,
                                          WanModel, build_model, checkpoint_sampling, convert_checkpoint,
                                          infer_config, load_wan)
from comfyui_fastar.fastar.models.loading import strip_prefix

HEADS = 2  # the tiny model's dim 64 is not 128 a head
# the linear layers of a Wan block: LongLive's LoRA adapts every nn.Linear inside CausalWanAttentionBlock
BLOCK_LINEARS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.k",
                 "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2")


def wan_weights(seed, dtype=torch.float32):
    """Every key of a 2-block Wan 2.1 T2V model (embeddings, each block's full set, head), random values."""
    return {k: v.to(dtype) for k, v in build_model("tiny", seed=seed).state_dict().items()}


def prefixed(state, prefix):
    return {prefix + k: v.clone() for k, v in state.items()}


def converted(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def assert_loads_as(dst, expected, sampling):
    """The converted file holds exactly ``expected`` (bare Wan names), is marked causal, records
    ``sampling``, and load_wan builds the model from it."""
    tensors, metadata = converted(dst)
    assert sorted(tensors) == sorted(expected)
    assert all(torch.equal(tensors[k], v.to(tensors[k].dtype)) for k, v in expected.items())
    assert json.loads(metadata["config"]) == {"transformer": {"causal_ar": True}}
    assert json.loads(metadata[SAMPLING_METADATA_KEY]) == json.loads(sampling.to_json())
    assert checkpoint_sampling(dst) == sampling
    model = load_wan(dst)
    assert all(torch.equal(model.state_dict()[k], v.to(model.dtype)) for k, v in expected.items())
    return model


def test_self_forcing(tmp_path):
    """guandeh17/Self-Forcing trainer/distillation.py save(): generator and critic are FSDP full state
    dicts of the wrapper (``model.`` + Wan names); generator_ema is EMA_FSDP's shadow, named by the FSDP
    module's parameters (``model._fsdp_wrapped_module.``), float32. Its inference (--use_ema) reads the EMA."""
    gen, critic, ema = wan_weights(1), wan_weights(2), wan_weights(3)
    src, dst = tmp_path / "self_forcing_dmd.pt", tmp_path / "self_forcing_dmd.safetensors"
    torch.save({"generator": prefixed(gen, "model."), "critic": prefixed(critic, "model."),
                "generator_ema": prefixed(ema, "model._fsdp_wrapped_module.")}, src)
    done = convert_checkpoint(src, dst, preset="self-forcing", dtype=torch.float32, num_heads=HEADS)
    assert done.sampling == Sampling(3, (1000, 750, 500, 250), 5.0, "self-forcing") and done.lora_layers == 0
    assert_loads_as(dst, ema, done.sampling)


def test_causvid(tmp_path):
    """tianweiy/CausVid causvid/train_distillation.py save(): generator and critic only; its
    autoregressive inference reads 'generator'. configs/wan_causal_dmd.yaml: steps 1000, 757, 522 (and
    the 0 the pipeline drops), not warped: a shift of 1 here."""
    gen, critic = wan_weights(1), wan_weights(2)
    src, dst = tmp_path / "model.pt", tmp_path / "causvid.safetensors"
    torch.save({"generator": prefixed(gen, "model."), "critic": prefixed(critic, "model.")}, src)
    done = convert_checkpoint(src, dst, preset="causvid", dtype=torch.float32, num_heads=HEADS)
    assert done.sampling == Sampling(3, (1000, 757, 522), 1.0, "causvid")
    assert done.sampling.schedule().sigmas() == pytest.approx([1.0, 0.757, 0.522])  # the steps as listed
    assert_loads_as(dst, gen, done.sampling)


def _longlive_base(path, gen, ema, critic):
    """NVlabs/LongLive (1.0) trainer/distillation.py save() without LoRA: the FSDP full state dicts, the
    EMA, both optimizers' FSDP state dicts (plain types: floats, tuples, bools, None, names) and the step."""
    def optim(names):
        return {"state": {n: {"step": torch.tensor(1200.0), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}
                          for n in names},
                "param_groups": [{"lr": 1e-5, "betas": (0.0, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                                  "amsgrad": False, "foreach": None, "maximize": False, "capturable": False,
                                  "differentiable": False, "fused": None, "params": list(names)}]}

    torch.save({"generator": prefixed(gen, "model."), "critic": prefixed(critic, "model."),
                "generator_ema": prefixed(ema, "model._fsdp_wrapped_module."),
                "generator_optimizer": optim(["model.blocks.0.self_attn.q.weight"]),
                "critic_optimizer": optim(["model.blocks.0.ffn.0.weight"]), "step": 1200}, path)


def _longlive_lora(base, rank, seed):
    """peft's get_peft_model_state_dict of the LoRA-wrapped CausalWanModel: for every linear layer of
    every block, base_model.model.<layer>.lora_A.weight [rank, in] and lora_B.weight [out, rank]."""
    g = torch.Generator().manual_seed(seed)
    lora = {}
    for i in range(2):
        for layer in BLOCK_LINEARS:
            out_features, in_features = base[f"blocks.{i}.{layer}.weight"].shape
            name = f"base_model.model.blocks.{i}.{layer}"
            lora[name + ".lora_A.weight"] = 0.05 * torch.randn(rank, in_features, generator=g)
            lora[name + ".lora_B.weight"] = 0.05 * torch.randn(out_features, rank, generator=g)
    return lora


def _merged_independently(base, lora, scale):
    """W + scale * B @ A in float64, per adapted layer, from the LoRA's own names."""
    out = {k: v.double() for k, v in base.items()}
    for k, a in lora.items():
        if ".lora_A." in k:
            layer = k.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = lora[k.replace(".lora_A.", ".lora_B.")]
            out[layer + ".weight"] = out[layer + ".weight"] + scale * (b.double() @ a.double())
    return out


def test_longlive_base_and_lora_merge_into_one_model(tmp_path, capsys):
    """LongLive ships longlive_base.pt (inference reads 'generator', use_ema false) and lora.pt
    ({'generator_lora', 'critic_lora', 'step'}; configs/longlive_inference.yaml: rank 256, alpha 256).
    The merged file is W + alpha / rank * B @ A on the adapted layers (checked against float64 to 1e-5)
    and the base's weights elsewhere."""
    gen, ema, critic = wan_weights(1), wan_weights(2), wan_weights(3)
    base, lora_file, dst = tmp_path / "longlive_base.pt", tmp_path / "lora.pt", tmp_path / "longlive.safetensors"
    _longlive_base(base, gen, ema, critic)
    rank = 4
    lora = _longlive_lora(gen, rank, seed=7)
    torch.save({"generator_lora": lora, "critic_lora": _longlive_lora(critic, rank, seed=8), "step": 1200},
               lora_file)
    assert main(["convert", str(base), str(dst), "--preset", "longlive", "--lora", str(lora_file),
                 "--dtype", "float32", "--num-heads", str(HEADS)]) == 0
    said = capsys.readouterr().out
    assert "LoRA lora.pt merged into 20 linear layers" in said
    assert "sampling: 3 frames per block, timesteps 1000,750,500,250, shift 5" in said
    tensors, _ = converted(dst)
    expected = _merged_independently(gen, lora, 256 / rank)  # the preset's alpha over the file's rank
    assert sorted(tensors) == sorted(gen)
    assert max((tensors[k].double() - v).abs().max().item() for k, v in expected.items()) < 1e-5
    adapted = {f"blocks.{i}.{layer}.weight" for i in range(2) for layer in BLOCK_LINEARS}
    assert all(torch.equal(tensors[k], v) for k, v in gen.items() if k not in adapted)  # biases, norms, head
    assert not any(torch.allclose(tensors[k], gen[k]) for k in adapted)
    assert checkpoint_sampling(dst) == KNOWN_CHECKPOINTS["longlive"].sampling
    load_wan(dst)

    # LongLive's inference also takes the adapters as the whole file; --lora-alpha sets the scale
    flat = tmp_path / "lora_flat.pt"
    torch.save(lora, flat)
    convert_checkpoint(base, dst, preset="longlive", lora=flat, lora_alpha=2.0, dtype=torch.float32,
                       num_heads=HEADS)
    tensors, _ = converted(dst)
    expected = _merged_independently(gen, lora, 2.0 / rank)
    assert max((tensors[k].double() - v).abs().max().item() for k, v in expected.items()) < 1e-5


def test_a_lora_that_does_not_fit_is_refused_and_nothing_is_written(tmp_path):
    gen = wan_weights(1)
    base, dst = tmp_path / "longlive_base.pt", tmp_path / "out.safetensors"
    _longlive_base(base, gen, wan_weights(2), wan_weights(3))
    lora = _longlive_lora(gen, 4, seed=7)

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


@pytest.mark.parametrize("preset,entry,prefix,frames", [
    # thu-ml/Causal-Forcing trainer/distillation.py save(): one entry, generator_ema (EMA_FSDP.full_state_dict:
    # the shadow's names, model._fsdp_wrapped_module.) once EMA has started, else generator; README: the
    # chunk-wise model runs without --use_ema, the frame-wise one with it
    ("causal-forcing-chunkwise", "generator", "model.", 3),
    ("causal-forcing-framewise", "generator_ema", "model._fsdp_wrapped_module.", 1),
])
def test_causal_forcing(tmp_path, preset, entry, prefix, frames):
    gen = wan_weights(4)
    src, dst = tmp_path / "causal_forcing.pt", tmp_path / f"{preset}.safetensors"
    torch.save({entry: prefixed(gen, prefix)}, src)
    done = convert_checkpoint(src, dst, preset=preset, dtype=torch.float32, num_heads=HEADS)
    assert done.sampling == Sampling(frames, (1000, 750, 500, 250), 5.0, preset)
    assert_loads_as(dst, gen, done.sampling)
    other = tmp_path / "other.pt"  # the other entry than the one its inference reads
    torch.save({("generator" if entry == "generator_ema" else "generator_ema"): prefixed(gen, prefix)}, other)
    with pytest.raises(FastARError, match=f"has no entry '{entry}', where thu-ml/Causal-Forcing's inference "
                                          f"reads the {preset} weights .*--key"):
        convert_checkpoint(other, dst, preset=preset, num_heads=HEADS)


def test_rolling_forcing(tmp_path):
    """TencentARC/RollingForcing trainer/distillation.py save(): as Self-Forcing's; README --use_ema
    (inference.py strips _fsdp_wrapped_module.); configs/rolling_forcing_dmd.yaml: 5 steps."""
    gen, critic, ema = wan_weights(1), wan_weights(2), wan_weights(3)
    src, dst = tmp_path / "rolling_forcing_dmd.pt", tmp_path / "rolling_forcing_dmd.safetensors"
    torch.save({"generator": prefixed(gen, "model."), "critic": prefixed(critic, "model."),
                "generator_ema": prefixed(ema, "model._fsdp_wrapped_module.")}, src)
    done = convert_checkpoint(src, dst, preset="rolling-forcing", dtype=torch.float32, num_heads=HEADS)
    assert done.sampling == Sampling(3, (1000, 800, 600, 400, 200), 5.0, "rolling-forcing")
    assert_loads_as(dst, ema, done.sampling)


def test_krea_realtime_14b_loads_as_it_is_and_converts_for_its_metadata(tmp_path):
    """krea-ai/realtime-video release_server.py load_transformer: a safetensors state dict of the
    WanDiffusionWrapper (``model.`` + Wan names), loaded into the 14B (40 heads of 128, dim 5120)."""
    weights = wan_weights(5, torch.bfloat16)
    src, dst = tmp_path / "krea-realtime-video-14b.safetensors", tmp_path / "krea_realtime_14b.safetensors"
    save_file(prefixed(weights, "model."), str(src))
    as_is = load_wan(src, num_heads=HEADS)
    assert all(torch.equal(as_is.state_dict()[k], v) for k, v in weights.items())
    assert checkpoint_sampling(src) is None
    done = convert_checkpoint(src, dst, preset="krea-realtime-14b", num_heads=HEADS)  # bf16, as it came
    assert done.sampling == Sampling(3, (1000, 750, 500, 250), 5.0, "krea-realtime-14b")
    assert_loads_as(dst, weights, done.sampling)
    with pytest.raises(FastARError, match="not over it"):
        convert_checkpoint(src, src, preset="krea-realtime-14b")
    with torch.device("meta"):  # its real shapes and names: 40 heads read off dim 5120
        full = prefixed(WanModel(WAN_CONFIGS["14B"]).state_dict(), "model.")
    config = infer_config(strip_prefix(full))
    assert (config.dim, config.num_heads, config.num_layers) == (5120, 40, 40)


def test_the_cli_samples_as_the_checkpoint_records(tmp_path, capsys):
    """fastar --checkpoint takes frames per chunk, timesteps and shift from the file; its flags win."""
    src, dst = tmp_path / "framewise.pt", tmp_path / "framewise.safetensors"
    torch.save({"generator_ema": prefixed(wan_weights(6), "model._fsdp_wrapped_module.")}, src)
    convert_checkpoint(src, dst, preset="causvid", key="generator_ema", num_heads=HEADS)
    common = ["--checkpoint", str(dst), "--frames", "3", "--height", "32", "--width", "32", "--cache", "window",
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
