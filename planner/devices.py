"""The devices a plan can be made for, and what is assumed of them."""
from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    flops: float  # dense bf16 FLOP/s (fp32 for the CPU entry)
    memory_gib: float  # what the device reports as total memory
    intra_gbs: float  # GB/s per direction per device between devices of one node
    inter_gbs: float  # GB/s per direction per device between nodes (its share of the network)
    op_overhead_s: float = 10e-6  # host time to launch one operator (eager PyTorch): a floor on small micro-batches
    host_gbs: float = 25.0  # GB/s per direction between the device and host memory (ZeRO-Offload's traffic)
    host_memory_gib: float = 1024.0  # host memory of a node, for what ZeRO-Offload keeps there
    mem_gbs: float = 2000.0  # GB/s of the device's memory: what memory-bound operators are limited by


# Vendors' data sheets: dense bf16 tensor-core FLOP/s (SXM parts), memory as nvidia-smi reports it, NVLink
# bandwidth per direction, and one 200 Gb/s (A100 systems) or 400 Gb/s (H100 and later) NIC per GPU.
# Host side: PCIe 4.0 x16 (A100) or 5.0 x16 (H100 and later) at about 80% of its per-direction rate, and the host
# memory of the vendor's 8-GPU system (DGX A100 40/80 GB: 1/2 TB; DGX H100, H200: 2 TB; DGX B200: 4 TB).
# Memory bandwidth: HBM2 (A100 40 GB: 1.56 TB/s), HBM2e (A100 80 GB: 2.04), HBM3 (H100: 3.35), HBM3e (H200: 4.8,
# B200: 8).
DEVICES = {d.name: d for d in (
    Device("a100-40gb", 312e12, 40.0, 300, 25, host_gbs=25, host_memory_gib=1024, mem_gbs=1555),
    Device("a100-80gb", 312e12, 80.0, 300, 25, host_gbs=25, host_memory_gib=2048, mem_gbs=2039),
    Device("h100-80gb", 989e12, 79.6, 450, 50, host_gbs=50, host_memory_gib=2048, mem_gbs=3350),
    Device("h200", 989e12, 140.4, 450, 50, host_gbs=50, host_memory_gib=2048, mem_gbs=4800),
    Device("b200", 2250e12, 179.1, 900, 50, host_gbs=50, host_memory_gib=4096, mem_gbs=8000),
)}
RESERVED_GIB = 2.0  # per device, outside the allocator: the CUDA context, NCCL's buffers, the allocator's slack
ALLOCATOR_MARGIN = 0.05  # of the rest, left for fragmentation
DEFAULT_MFU = 0.4  # fraction of the device's peak the model's matmuls reach (the ViT-22B paper reports 0.55)
DEFAULT_MBU = 0.7  # fraction of the memory bandwidth the memory-bound operators reach on a GPU (an assumption)


def target(device: "Device") -> str:
    """The device type whose kernels a plan for `device` profiles with."""
    return "cpu" if device.name == "cpu" else "cuda"
