from .loading import build_model, convert_checkpoint, infer_config, load_wan, save_wan
from .wan import FP8_LINEARS, WAN_CONFIGS, Fp8Linear, WanConfig, WanModel, fp8_linears

__all__ = ["FP8_LINEARS", "WAN_CONFIGS", "Fp8Linear", "WanConfig", "WanModel", "build_model", "convert_checkpoint",
           "fp8_linears", "infer_config", "load_wan", "save_wan"]
