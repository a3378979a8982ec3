from models.blocks import Block, find_blocks
from models.registry import NAMES, build_model, model_config, width

__all__ = ["Block", "NAMES", "build_model", "find_blocks", "model_config", "width"]
