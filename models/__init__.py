import torch
from torch.utils.flop_counter import flop_registry

from models.blocks import Block, find_blocks
from models.registry import NAMES, build_model, model_config

# torch 2.13's FLOP counter has no formula for the CPU flash-attention kernels, so CPU FLOP counts (the
# checkpointing profile's, the recompute's, the benchmarks' MFU) would leave attention out. They take the
# same leading arguments (query, key, value; the backward: grad_out first) and do the same work as the GPU
# kernels. Here, because everything that counts FLOPs imports `models` first.
for _cpu, _gpu in ((torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                    torch.ops.aten._scaled_dot_product_flash_attention),
                   (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward,
                    torch.ops.aten._scaled_dot_product_flash_attention_backward)):
    flop_registry.setdefault(_cpu, flop_registry[_gpu])
