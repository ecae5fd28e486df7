from .loading import build_model, convert_checkpoint, infer_config, load_wan, save_wan
from .wan import WAN_CONFIGS, WanConfig, WanModel

__all__ = ["WAN_CONFIGS", "WanConfig", "WanModel", "build_model", "convert_checkpoint", "infer_config", "load_wan", "save_wan"]
