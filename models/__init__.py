from models.blocks import Block, find_blocks
from models.registry import NAMES, build_model, is_known, model_config
