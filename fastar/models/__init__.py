from .checkpoints import KNOWN_CHECKPOINTS, SAMPLING_METADATA_KEY, KnownCheckpoint, Sampling, known_checkpoint
from .convert import Converted, convert_checkpoint, merge_lora
from .loading import build_model, checkpoint_sampling, infer_config, load_wan, save_wan
from .fp8 import FP8_LINEARS, Fp8Linear, fp8_linears
from .wan import WAN_CONFIGS, WanConfig, WanModel
from .matrix_game import MatrixGameModel, MatrixGameRun
from .world import WorldModel, WorldSpec, save_world, world_config

__all__ = ["FP8_LINEARS", "KNOWN_CHECKPOINTS", "SAMPLING_METADATA_KEY", "WAN_CONFIGS", "Converted", "Fp8Linear",
           "KnownCheckpoint", "Sampling", "WanConfig", "WanModel", "build_model", "checkpoint_sampling",
           "convert_checkpoint", "fp8_linears", "infer_config", "known_checkpoint", "load_wan", "merge_lora",
           "save_wan", "MatrixGameModel", "MatrixGameRun", "WorldModel", "WorldSpec", "save_world", "world_config"]
