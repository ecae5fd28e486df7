"""Wan's frame arithmetic, in one place: video frames and latent frames (Wan 2.1's causal VAE decodes
the first latent frame to 1 video frame and every later one to 4, so a video is 1 + 4k frames long),
and the chunks of latent frames a rollout generates them in. Pure integers: no torch."""
from __future__ import annotations

VIDEO_FRAMES_PER_LATENT = 4


def frames_text(n: int) -> str:
    """``n`` frames, in words: "1 frame", "3 frames"."""
    return f"{n} frame" if n == 1 else f"{n} frames"


def video_frames(latent_frames: int) -> int:
    """Video frames Wan's causal VAE decodes ``latent_frames`` to: 1 + 4 (latent - 1); none for none."""
    return 0 if latent_frames <= 0 else 1 + VIDEO_FRAMES_PER_LATENT * (latent_frames - 1)


def latent_frames(video_frames: int) -> int:
    """Latent frames that decode to ``video_frames`` (1 + 4k video frames: 1 + k latent frames)."""
    return 0 if video_frames <= 0 else (video_frames - 1) // VIDEO_FRAMES_PER_LATENT + 1


def is_video_length(length: int) -> bool:
    """Whether ``length`` video frames are what some count of latent frames decodes to (1 + 4k)."""
    return length >= 1 and (length - 1) % VIDEO_FRAMES_PER_LATENT == 0


def nearest_video_lengths(length: int) -> tuple[int, int]:
    """The video lengths (1 + 4k) at or below and above ``length`` (>= 1): what to use instead."""
    lo = length - (length - 1) % VIDEO_FRAMES_PER_LATENT
    return lo, lo + VIDEO_FRAMES_PER_LATENT


def first_video_frame(latent: int) -> int:
    """The first video frame latent frame ``latent`` decodes to: as many as the ones before it decode to."""
    return video_frames(latent)


def first_latent_from(video_frame: int) -> int:
    """The first latent frame all of whose video frames come at or after video frame ``video_frame``."""
    return 0 if video_frame <= 0 else -(-(video_frame - 1) // VIDEO_FRAMES_PER_LATENT) + 1


def whole_chunks(frames: int, chunk_frames: int) -> int:
    """Chunks of ``chunk_frames`` latent frames that cover ``frames``: a last chunk that is not whole
    counts whole (it is generated whole, then cut)."""
    return -(-frames // chunk_frames)


def chunk_video_frames(chunk_frames: int) -> int:
    """Video frames a chunk of ``chunk_frames`` latent frames decodes to, every chunk but the first
    (whose first latent frame decodes to 1)."""
    return VIDEO_FRAMES_PER_LATENT * chunk_frames


def chunk_first_frame(chunk: int, chunk_frames: int, first: int = 0) -> int:
    """The first video frame of chunk ``chunk`` (chunks of ``chunk_frames`` latent frames after ``first``
    latent frames that are no chunk's: a start image's)."""
    return first_video_frame(first + chunk * chunk_frames)


def first_chunk_from(video_frame: int, chunk_frames: int, first: int = 0) -> int:
    """The first chunk all of whose video frames come at or after video frame ``video_frame`` (chunks after
    ``first`` latent frames, as ``chunk_first_frame``)."""
    return whole_chunks(max(first_latent_from(video_frame) - first, 0), chunk_frames)


def chunked_lengths(frames: int, chunk_frames: int, first: int = 0) -> list[int]:
    """The video lengths of the whole-chunk latent frame counts either side of ``frames`` (the lower one
    only where it has a chunk; chunks after ``first`` latent frames, a start image's): what a latent that
    does not divide into chunks should be instead."""
    lo = max(frames - first, 0) // chunk_frames * chunk_frames
    return [video_frames(first + n) for n in (lo, lo + chunk_frames) if n >= 1]
