"""The published causal Wan 2.1 checkpoints as each one's training or release code writes them (entries,
key names, wrapper prefixes, dtypes, what else the file holds; tiny shapes, random values): what the
library's and ComfyUI's loader tests convert and load."""
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..fastar.models import KNOWN_CHECKPOINTS, WanModel, build_model

HEADS = 2  # the tiny model's dim 64 is not 128 a head
# the linear layers of a Wan block: LongLive's LoRA adapts every nn.Linear inside CausalWanAttentionBlock
BLOCK_LINEARS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.k",
                 "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2")


def wan_weights(seed, dtype=torch.float32, config=None):
    """Every key of a 2-block Wan 2.1 T2V model (embeddings, each block's full set, head), random values."""
    model = build_model("tiny", seed=seed) if config is None else WanModel(config).init_random(seed)
    return {k: v.to(dtype) for k, v in model.state_dict().items()}


def prefixed(state, prefix):
    return {prefix + k: v.clone() for k, v in state.items()}


def converted(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def longlive_base(path, gen, ema, critic):
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


def longlive_lora(base, rank, seed):
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


def merged_independently(base, lora, scale):
    """W + scale * B @ A in float64, per adapted layer, from the LoRA's own names."""
    out = {k: v.double() for k, v in base.items()}
    for k, a in lora.items():
        if ".lora_A." in k:
            layer = k.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = lora[k.replace(".lora_A.", ".lora_B.")]
            out[layer + ".weight"] = out[layer + ".weight"] + scale * (b.double() @ a.double())
    return out


LORA_RANK = 4


def write_checkpoint(preset, directory, weights):
    """The file(s) ``preset``'s training or release code writes, from ``weights(seed, dtype)``: returns
    the source, convert_checkpoint's extra arguments, and the Wan weights the conversion must give."""
    gen, critic, ema = weights(1, torch.float32), weights(2, torch.float32), weights(3, torch.float32)
    src = directory / f"{preset}.pt"
    if preset in ("self-forcing", "rolling-forcing"):
        # guandeh17/Self-Forcing and TencentARC/RollingForcing trainer/distillation.py save(): generator and
        # critic are FSDP full state dicts of the wrapper ("model." + Wan names); generator_ema is EMA_FSDP's
        # shadow, named by the FSDP module's parameters ("model._fsdp_wrapped_module."), float32. Their
        # README inference runs --use_ema.
        torch.save({"generator": prefixed(gen, "model."), "critic": prefixed(critic, "model."),
                    "generator_ema": prefixed(ema, "model._fsdp_wrapped_module.")}, src)
        return src, {}, ema
    if preset == "causvid":
        # tianweiy/CausVid causvid/train_distillation.py save(): generator and critic only; its
        # autoregressive inference reads 'generator'
        torch.save({"generator": prefixed(gen, "model."), "critic": prefixed(critic, "model.")}, src)
        return src, {}, gen
    if preset == "longlive":
        # longlive_base.pt (inference reads 'generator', use_ema false) and lora.pt ({'generator_lora',
        # 'critic_lora', 'step'}; configs/longlive_inference.yaml: rank 256, alpha 256)
        longlive_base(src, gen, ema, critic)
        lora, lora_file = longlive_lora(gen, LORA_RANK, seed=7), directory / "lora.pt"
        torch.save({"generator_lora": lora, "critic_lora": longlive_lora(critic, LORA_RANK, seed=8), "step": 1200},
                   lora_file)
        return src, {"lora": lora_file}, merged_independently(gen, lora, 256 / LORA_RANK)
    if preset.startswith("causal-forcing"):
        # thu-ml/Causal-Forcing trainer/distillation.py save(): one entry, generator_ema (EMA_FSDP.full_state_dict:
        # the shadow's names, "model._fsdp_wrapped_module.") once EMA has started, else generator; README:
        # the chunk-wise model runs without --use_ema, the frame-wise one with it
        entry = KNOWN_CHECKPOINTS[preset].key
        torch.save({entry: prefixed(gen, "model." if entry == "generator" else "model._fsdp_wrapped_module.")}, src)
        return src, {}, gen
    assert preset == "krea-realtime-14b"
    # krea-ai/realtime-video release_server.py load_transformer: a safetensors state dict of the
    # WanDiffusionWrapper ("model." + Wan names)
    src, bf16 = directory / "krea-realtime-video-14b.safetensors", weights(5, torch.bfloat16)
    save_file(prefixed(bf16, "model."), str(src))
    return src, {}, bf16


#: Matrix-Game 2.0's published files: (keys per keyboard row, mouse, action blocks of the 30; the tests keep
#: the same share of a smaller model's blocks)
MATRIX_GAME_FILES = {"universal": (4, True, 15), "gta": (2, True, 15), "templerun": (7, False, 15),
                     "foundation": (4, True, 30)}


def matrix_game_weights(variant, *, dim=64, heads=2, layers=2, ffn=96, clip=48, hidden=128, key_hidden=16,
                        freq=32, seed=0, dtype=torch.float32):
    """A Matrix-Game 2.0 state dict as its release writes it (``model.`` before every key), at its key
    layout and shapes (Wan 2.1 with ``img_emb`` in place of the text embedding, 36 input channels, plain
    cross-attention, and each steered block's ``action_model``), small widths, random values: the action
    blocks are the first half of the blocks (every block for the foundation model)."""
    keys, mouse, action_blocks = MATRIX_GAME_FILES[variant]
    steered = layers if action_blocks == 30 else layers // 2
    g = torch.Generator().manual_seed(seed)
    state = {}

    def put(name, *shape):
        state["model." + name] = 0.05 * torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)

    put("patch_embedding.weight", dim, 36, 1, 2, 2), put("patch_embedding.bias", dim)
    put("time_embedding.0.weight", dim, freq), put("time_embedding.0.bias", dim)
    put("time_embedding.2.weight", dim, dim), put("time_embedding.2.bias", dim)
    put("time_projection.1.weight", 6 * dim, dim), put("time_projection.1.bias", 6 * dim)
    for i, width in ((0, clip), (4, dim)):  # LayerNorms
        put(f"img_emb.proj.{i}.weight", width), put(f"img_emb.proj.{i}.bias", width)
    put("img_emb.proj.1.weight", clip, clip), put("img_emb.proj.1.bias", clip)
    put("img_emb.proj.3.weight", dim, clip), put("img_emb.proj.3.bias", dim)
    for b in range(layers):
        p = f"blocks.{b}."
        for attn in ("self_attn", "cross_attn"):
            for lin in "qkvo":
                put(f"{p}{attn}.{lin}.weight", dim, dim), put(f"{p}{attn}.{lin}.bias", dim)
            put(f"{p}{attn}.norm_q.weight", dim), put(f"{p}{attn}.norm_k.weight", dim)
        put(f"{p}norm3.weight", dim), put(f"{p}norm3.bias", dim)
        put(f"{p}ffn.0.weight", ffn, dim), put(f"{p}ffn.0.bias", ffn)
        put(f"{p}ffn.2.weight", dim, ffn), put(f"{p}ffn.2.bias", dim)
        put(f"{p}modulation", 1, 6, dim)
        if b < steered:
            a = p + "action_model."
            put(a + "keyboard_embed.0.weight", key_hidden, keys), put(a + "keyboard_embed.0.bias", key_hidden)
            put(a + "keyboard_embed.2.weight", key_hidden, key_hidden), put(a + "keyboard_embed.2.bias", key_hidden)
            if mouse:
                put(a + "mouse_mlp.0.weight", hidden, dim + 24), put(a + "mouse_mlp.0.bias", hidden)
                put(a + "mouse_mlp.2.weight", hidden, hidden), put(a + "mouse_mlp.2.bias", hidden)
                put(a + "mouse_mlp.3.weight", hidden), put(a + "mouse_mlp.3.bias", hidden)
                put(a + "t_qkv.weight", 3 * hidden, hidden)
                put(a + "img_attn_q_norm.weight", 64), put(a + "img_attn_k_norm.weight", 64)
                put(a + "proj_mouse.weight", dim, hidden)
            put(a + "mouse_attn_q.weight", hidden, dim)
            put(a + "keyboard_attn_kv.weight", 2 * hidden, 12 * key_hidden)
            put(a + "key_attn_q_norm.weight", 64), put(a + "key_attn_k_norm.weight", 64)
            put(a + "proj_keyboard.weight", dim, hidden)
    put("head.head.weight", 16 * 4, dim), put("head.head.bias", 16 * 4)
    put("head.modulation", 1, 2, dim)
    return state
