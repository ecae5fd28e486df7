"""What the pack's tests and benchmarks share to run it inside a real ComfyUI tree (``comfy_harness``)."""
