"""FAST-AR Prompt Schedule: prompts that change along the video, for either sampler's prompts input."""
from __future__ import annotations

from comfy_api.latest import io

from ..fastar import FastARError
from .schema import MAX_LENGTH, PromptsType, check_widget, schema
from .words import in_words

SCHEDULE_SLOTS = 4
_UNCONNECTED = object()  # an optional input left unconnected (validate_inputs' default)


class PromptSchedule(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        inputs = [io.Conditioning.Input("prompt_1", optional=True,
                                        tooltip="The prompt from the first frame. Empty: the sampler's own positive "
                                                "(which a connected prompt_1 replaces).")]
        for i in range(2, SCHEDULE_SLOTS + 1):
            inputs += [
                io.Conditioning.Input(f"prompt_{i}", optional=True,
                                      tooltip=f"The prompt from start_{i} on (leave unconnected for fewer prompts)."),
                io.Int.Input(f"start_{i}", default=80 * (i - 1), min=1, max=MAX_LENGTH,
                             tooltip=f"The video frame where prompt_{i} begins (16 frames = 1 s). The switch "
                                     f"happens with the first chunk that starts there or later."),
            ]
        return schema(
            node_id="FastARPromptSchedule",
            display_name="FAST-AR Prompt Schedule",
            description="Prompts that change along the video, for the prompts input of Autoregressive Long Sampler "
                        "or FAST-AR AR Video: at each switch the new text conditions the chunks that follow and the "
                        "frames the cache holds are re-encoded with it (the sink and the budget or window of "
                        "recent frames: a fixed cost; every frame so far with the unbounded cache), so the video "
                        "follows without a cut. Every frame before a switch is the earlier prompt's. The first "
                        "prompt is the sampler's positive unless prompt_1 is connected.",
            inputs=inputs,
            outputs=[PromptsType.Output()],
        )

    @classmethod
    def validate_inputs(cls, start_2, start_3, start_4, prompt_2=_UNCONNECTED, prompt_3=_UNCONNECTED,
                        prompt_4=_UNCONNECTED):
        """Starts out of order, refused by /prompt. While ComfyUI validates, a connected prompt arrives as
        None and an unconnected one not at all (the default here): only connected slots count. ComfyUI
        skips its own min / max for the starts read here, so they are checked here too."""
        slots = {2: (start_2, prompt_2), 3: (start_3, prompt_3), 4: (start_4, prompt_4)}
        try:
            for i, (start, _) in slots.items():
                check_widget(cls, f"start_{i}", start)
            _ordered_starts({i: int(start) for i, (start, prompt) in slots.items() if prompt is not _UNCONNECTED})
        except FastARError as exc:
            return f"FAST-AR Prompt Schedule: {exc}"
        return True

    @classmethod
    def execute(cls, prompt_1=None, **slots) -> io.NodeOutput:
        used = {i: int(slots[f"start_{i}"]) for i in range(2, SCHEDULE_SLOTS + 1)
                if slots.get(f"prompt_{i}") is not None}
        with in_words("FAST-AR Prompt Schedule"):
            _ordered_starts(used)
        return io.NodeOutput([(0, prompt_1)] + [(start, slots[f"prompt_{i}"]) for i, start in used.items()])


def _ordered_starts(starts: dict[int, int]) -> None:
    """The starts of the connected slots (slot number -> video frame), or one error naming the first
    start that does not come after the one before it."""
    last = ("the first frame", 0)
    for i, start in sorted(starts.items()):
        if start <= last[1]:
            raise FastARError(f"start_{i} ({start}) must come after {last[0]} ({last[1]}); the prompts start "
                              f"in order")
        last = (f"start_{i}", start)

