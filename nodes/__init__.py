"""ComfyUI node classes: schemas and glue into ``fastar``; no math lives here.

The node classes, by family: ``settings_nodes`` (FAST-AR Patch Model and the cache and sparsity settings
it takes), ``sampler_nodes`` (the two samplers and the Long Sampler's start image), ``prompt_nodes`` (the prompt schedule), ``video_nodes``
(the streaming save and the video stream), ``fast_decoder_nodes`` (the TAEHV-family fast decoders' loader), ``world_nodes`` (the pack's world model, its action schedule and
sampler), ``matrix_game_nodes`` (Matrix-Game 2.0's loader and sampler), ``play_nodes`` (a world played live: the
session's node, over ``play_routes``, its page's routes, and ``play_worlds``, the worlds it plays), over what they share (``schema``). Beneath them, by job:
``settings`` (the frozen settings the Patch Model puts on the model), ``wan`` (what the MODEL is),
``patching`` (the attention patch and ComfyUI's patched forward), ``fused`` and ``engines`` (which forward
runs a rollout), ``prompts`` (conditioning and prompt schedules as contexts), ``samplers`` (the rollouts),
``progress`` (progress bar, previews, the cache widget's events), ``video`` (the streaming decode) and
``stream`` (frames on disk while sampling). None is imported here, so ``import comfyui_fastar.nodes``
works without ComfyUI.
"""


def node_list() -> list:
    """The pack's node classes (imports ComfyUI's API)."""
    from .fast_decoder_nodes import LoadFastDecoder
    from .matrix_game_nodes import MatrixGameLoader, MatrixGameSampler
    from .play_nodes import WorldPlay
    from .prompt_nodes import PromptSchedule
    from .sampler_nodes import ARVideo, AutoregressiveLongSampler, StartImageNode
    from .settings_nodes import AnnSparsity, PatchModel, TempCacheSettings, WindowCache
    from .video_nodes import SaveVideo, VideoStream
    from .world_nodes import ActionSchedule, WorldModelLoader, WorldSampler

    return [PatchModel, TempCacheSettings, WindowCache, AnnSparsity, AutoregressiveLongSampler, StartImageNode,
            ARVideo, PromptSchedule, SaveVideo, VideoStream, WorldModelLoader, ActionSchedule, WorldSampler,
            MatrixGameLoader, MatrixGameSampler, WorldPlay, LoadFastDecoder]
