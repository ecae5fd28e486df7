"""What the pack's tests and benchmarks share: running it inside a real ComfyUI tree (``comfy_harness``),
measuring AnnSA's plans (``annsa``) and checkpoints at the real key layouts (``checkpoints``)."""
