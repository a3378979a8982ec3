"""Every use of a private DeepSpeed or torch API, and every patch of one: the only place they live.

Each function checks that the installed version lies in the range its behaviour was tested on (SUPPORTED) and,
outside it, stops with a message naming itself, the range and the installed version. Before accepting another
version, run tests/unit/test_compat.py under it (one test per behaviour relied on here), fix what fails, then widen
SUPPORTED.
"""
import contextlib
import functools
import os

import sys

import torch

# The (major, minor) series each package's behaviours were tested on, oldest and newest: tests/unit/test_compat.py passes
# under both ends (the newest: requirements.txt, what `make` installs; the oldest: the GPU machine's stack,
# benchmarks/device/stack.txt, run by `make device-rehearsal`).
SUPPORTED = {"torch": ((2, 11), (2, 13)), "transformers": ((5, 17), (5, 24)), "deepspeed": ((0, 19), (0, 19))}


# torch collectives DeepSpeed's ZeRO calls that torch has deprecated
DEEPSPEED_DEPRECATED_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor")


class CompatError(RuntimeError):
    """A private API used here is unchecked against the installed version."""


def installed_version(package: str) -> str:
    """The installed version of torch, transformers or deepspeed, as the package reports it."""
    if package == "torch":
        return torch.__version__
    if package == "transformers":
        import transformers

        return transformers.__version__
    import deepspeed

    return deepspeed.__version__


def import_deepspeed():
    """`import deepspeed`, without letting DeepSpeed's autotuner import mlflow: it does when mlflow is installed
    (requirements.txt has it, for report_to), to log autotuning experiments this trainer never runs, and that
    import costs every process ~1.6 s at its start. mlflow is importable again afterwards (runlog/tracking.py)."""
    if "deepspeed" not in sys.modules and "mlflow" not in sys.modules:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError: the autotuner's has_mlflow is False
        try:
            import deepspeed  # noqa: F401
        finally:
            if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
                del sys.modules["mlflow"]
    import deepspeed

    return deepspeed


@functools.lru_cache(maxsize=None)
def series(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: "2.11.0+cu130" -> (2, 11). Cached: the checks of the functions the
    checkpointing recipes call per saved tensor (`storage_id`) run thousands of times a step."""
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def supported_range(package: str) -> str:
    """The supported series of a package in words: "2.11-2.13", or "0.19" where there is one."""
    lo, hi = SUPPORTED[package]
    return f"{lo[0]}.{lo[1]}" + (f"-{hi[0]}.{hi[1]}" if lo != hi else "")


def _require(package: str, function: str):
    version = installed_version(package)
    low, high = SUPPORTED[package]
    if not low <= series(version) <= high:
        raise CompatError(f"compat.py:{function} relies on {package} {supported_range(package)} internals and "
                          f"the installed {package} is {version}: run tests/unit/test_compat.py under it, adapt {function}, "
                          f"then widen SUPPORTED")


# ----------------------------------------------------------------------------- DeepSpeed's CPU communication
def deepspeed_shm_name(rank: int) -> str:
    """Path of the /dev/shm buffer DeepSpeed's CPU shared-memory all-reduce creates for `rank`."""
    _require("deepspeed", "deepspeed_shm_name")
    return (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def release_deepspeed_shm(rank: int) -> bool:
    """Unlink this rank's shared-memory all-reduce buffer; call after a barrier that follows
    `deepspeed.init_distributed()`. True if there was one.

    DeepSpeed creates one buffer of tens of MB per rank in RAM-backed /dev/shm and never unlinks it, so they
    accumulate run after run until /dev/shm is full (docs/troubleshooting.md). After the barrier every rank
    has mapped every other rank's buffer: the mappings stay valid without the names, and the memory is freed
    when the processes end, crashed or not.
    """
    try:
        os.unlink(deepspeed_shm_name(rank))
        return True
    except FileNotFoundError:  # not every rank on one host, or not DeepSpeed's CPU accelerator: no buffer
        return False


def quiet_deepspeed_deprecations():
    """Hide the FutureWarnings torch raises each time DeepSpeed calls its deprecated collectives (every rank,
    every ZeRO-3 step); they concern DeepSpeed's code, and nothing in a run can act on them."""
    _require("deepspeed", "quiet_deepspeed_deprecations")
    import warnings

    for name in DEEPSPEED_DEPRECATED_COLLECTIVES:
        warnings.filterwarnings("ignore", message=rf"`torch\.distributed\.{name}` is deprecated", category=FutureWarning)


# ----------------------------------------------------------------------------- DeepSpeed's AutoTP
@contextlib.contextmanager
def autotp_sees_one_head_count(model: torch.nn.Module):
    """Hide a Swin config's per-stage head counts from AutoTP while `deepspeed.initialize` splits the model.

    AutoTP reads one head count from the model's config (deepspeed/module_inject/tp_shard.py, AutoTPMeta) to align
    its shards with heads, and a Swin config holds a list, one per stage, which it cannot compare with tp_size.
    Without a count AutoTP splits each linear layer into equal parts, which fall on head boundaries when tp_size
    divides every stage's heads (parallel/tensor.py checks that first).
    """
    _require("deepspeed", "autotp_sees_one_head_count")
    import copy

    config = model.config
    if not isinstance(getattr(config, "num_heads", None), (list, tuple)):
        yield
        return
    shown = copy.copy(config)
    shown.__dict__["num_heads"] = None  # and so num_attention_heads, which Swin's config maps to it
    model.config = shown
    try:
        yield
    finally:
        model.config = config


def tp_gathered_parameters(engine) -> dict:
    """Every parameter of a tensor-parallel engine whole, on rank 0 ({} elsewhere); every rank calls it.

    DeepSpeed's consolidation (DeepSpeedEngine._consolidated_16bit_state_dict) gathers module by module each AutoTP
    layer's shards over its tensor group and, under ZeRO-3, each partition over the data-parallel ranks; it copies
    the parameters in the model's own precision (fp32 here for an fp32 run) and leaves the buffers out.
    """
    _require("deepspeed", "tp_gathered_parameters")
    return {k: v.clone() for k, v in (engine._consolidated_16bit_state_dict() or {}).items()}


# ----------------------------------------------------------------------------- linear layers under ZeRO-3
def torch_linear():
    """torch's own `linear` (the aten op), whatever DeepSpeed has made of `torch.nn.functional.linear`."""
    _require("torch", "torch_linear")
    return torch._C._nn.linear


@contextlib.contextmanager
def functional_linear_is_torchs():
    """Run a block with `torch.nn.functional.linear` set back to torch's own for its duration.

    An earlier ZeRO-3 engine in the process leaves DeepSpeed's linear installed process-wide, and DeepSpeed's
    saves its inputs after its matmul where torch's saves them before: a profile of what a checkpointed block
    saves, and where its recompute stops, must see torch's.
    """
    saved, torch.nn.functional.linear = torch.nn.functional.linear, torch_linear()
    try:
        yield
    finally:
        torch.nn.functional.linear = saved


def use_torch_linear(linear: torch.nn.Linear):
    """Make this one `nn.Linear` call torch's linear instead of DeepSpeed's ZeRO-3 autograd function.

    A checkpoint's recompute stops once it has rebuilt every tensor the backward needs. torch's matmul saves its
    inputs before it runs, so a block's recompute stops short of its last matmul; DeepSpeed's function saves
    them after its forward, so the recompute would run that matmul too. DeepSpeed's function exists to keep
    gathered weights out of the saved tensors, and a checkpointed block saves only its input, so inside one it
    is not needed (docs/activation_checkpointing.md).
    """
    native = torch_linear()

    def forward(input):
        return native(input, linear.weight, linear.bias)

    linear.forward = forward


def _zero3_linear(input, weight, bias=None):
    """DeepSpeed's ZeRO-3 linear, always on its out-of-place `addmm` path.

    For inputs of more than 2 dimensions DeepSpeed's function runs a matmul and adds the bias in place into its
    output: two kernels, and an output whose version moves after the matmul made it. Flattened to 2-D, the input
    takes DeepSpeed's fused `torch.addmm(bias, input, weight.t())` branch, as torch's own linear does.
    """
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3

    if input.dim() == 2 or bias is None:
        return LinearFunctionForZeroStage3.apply(input, weight, bias)
    out = LinearFunctionForZeroStage3.apply(input.reshape(-1, input.shape[-1]), weight, bias)
    return out.view(*input.shape[:-1], out.shape[-1])


def make_zero3_linear_out_of_place() -> bool:
    """Replace the `torch.nn.functional.linear` that `deepspeed.initialize` installs for ZeRO-3 with
    `_zero3_linear`; True if DeepSpeed's was installed."""
    _require("deepspeed", "make_zero3_linear_out_of_place")
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    if torch.nn.functional.linear is zero3_linear_wrap:
        torch.nn.functional.linear = _zero3_linear
        return True
    return False


def is_dtensor(t) -> bool:
    """A torch DTensor (an FSDP2-sharded parameter or gradient)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor, as a plain tensor sharing its storage; any other tensor itself."""
    _require("torch", "local_tensor")
    return t._local_tensor if is_dtensor(t) else t


def foreach_norms_float64(tensors: list) -> list:
    """Each tensor's L2 norm, accumulated in float64, in a few multi-tensor kernels (torch's own clipping uses them)."""
    _require("torch", "foreach_norms_float64")
    return list(torch._foreach_norm(tensors, 2.0, dtype=torch.float64))


def foreach_scale_(tensors: list, factor: torch.Tensor):
    """Multiply every tensor in place by a 0-d tensor `factor`, without reading it on the host."""
    _require("torch", "foreach_scale_")
    torch._foreach_mul_(tensors, factor)


def is_fsdp2_module(m: torch.nn.Module) -> bool:
    """A module `fully_shard` wrapped (FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(m, FSDPModule)


def model_class(module: torch.nn.Module) -> type:
    """The model's own class: `fully_shard` swaps a module's class for a subclass named FSDP<class>."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def deepspeed_arch_list() -> str | None:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's JIT op builder reads it: each entry `major.minor[+PTX]`.

    torch accepts architecture-specific entries such as Hopper's `9.0a` (CUDA images set them), while DeepSpeed
    0.19's builder parses each minor as an integer and stops on `0a` (DeepCompile builds its op at the first
    compiled step). The suffix is dropped: DeepSpeed's ops use no architecture-specific instruction. Returns the
    list set, or None when the variable is unset."""
    _require("deepspeed", "deepspeed_arch_list")
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if archs is None:
        return None
    entries = []
    for entry in archs.replace(" ", ";").split(";"):
        if not entry.strip():
            continue
        arch, ptx = entry.strip().split("+", 1) if "+" in entry else (entry.strip(), "")
        major, _, minor = arch.partition(".")
        minor = "".join(c for c in minor if c.isdigit()) or "0"
        entries.append(f"{major}.{minor}" + (f"+{ptx}" if ptx else ""))
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(dict.fromkeys(entries))
    return os.environ["TORCH_CUDA_ARCH_LIST"]


def param_numel(p: torch.nn.Parameter) -> int:
    """Elements of a parameter, whole: a ZeRO-3-partitioned one holds an empty tensor and its full size aside."""
    _require("deepspeed", "param_numel")
    return getattr(p, "ds_numel", None) or p.numel()


def param_ndim(p: torch.nn.Parameter) -> int:
    """Dimensions of a parameter as defined: a ZeRO-3-partitioned one holds a 1-d tensor and its shape aside."""
    _require("deepspeed", "param_ndim")
    shape = getattr(p, "ds_shape", None)
    return len(shape) if shape is not None else p.ndim


def param_shape(p: torch.nn.Parameter) -> torch.Size:
    """Shape of a parameter as defined, partitioned by ZeRO-3 or not."""
    _require("deepspeed", "param_shape")
    return getattr(p, "ds_shape", None) or p.shape


def shard_dim(p) -> int:
    """The device-mesh dimension an FSDP2 parameter (a DTensor) is sharded along (HSDP's 2-D mesh: the last)."""
    return next(i for i, placement in enumerate(p.placements) if placement.is_shard())


def is_first_replica(p) -> bool:
    """Does this rank hold an FSDP2 parameter's first replica (always, without HSDP)?"""
    return all(p.device_mesh.get_local_rank(i) == 0 for i, placement in enumerate(p.placements)
               if placement.is_replicate())


def local_weights(p: torch.nn.Parameter) -> tuple[torch.Tensor, int]:
    """(the part of a parameter this rank holds, the index of its first element in the flattened parameter):
    under ZeRO-3 its partition (flat, zero-padded at the end of the last rank's); under FSDP2 its dim-0 shard
    (rows as torch.chunk splits them, unpadded); else the whole tensor and 0."""
    _require("deepspeed", "local_weights")
    if is_dtensor(p):
        local = p._local_tensor
        rows = p.shape[0]
        mesh, dim = p.device_mesh, shard_dim(p)  # HSDP: replicated along the mesh's first dim, sharded along its last
        per_rank = -(-rows // mesh.size(dim))  # FSDP2 shards dim 0 as torch.chunk: ceil(rows / ranks) each
        first_row = min(mesh.get_local_rank(dim) * per_rank, rows)
        return local, first_row * (p.numel() // rows if rows else 0)
    if getattr(p, "ds_tensor", None) is None:
        return p.data, 0
    import torch.distributed as dist

    return p.ds_tensor, dist.get_rank(group=p.ds_process_group) * p.ds_tensor.ds_numel


@contextlib.contextmanager
def writing_zero3_partitions(engine):
    """While active, what is written into ZeRO-3's partitions (`local_weights`) becomes the weights: the
    persistent parameters (kept gathered) are released on entry and gathered again from the partitions on exit,
    and hpZ's secondary partitions are invalidated, as DeepSpeed's own checkpoint load does. Every rank enters."""
    _require("deepspeed", "writing_zero3_partitions")
    if not engine.zero_optimization_partition_weights():
        yield
        return
    engine.optimizer.checkpoint_event_prologue()
    try:
        yield
    finally:
        engine.optimizer.checkpoint_event_epilogue()


def is_zero3_partitioned(p: torch.nn.Parameter) -> bool:
    """Was this parameter created (or converted) by `deepspeed.zero.Init`?"""
    _require("deepspeed", "is_zero3_partitioned")
    return hasattr(p, "ds_id")


def zero3_gathered_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's ZeRO-3 parameters that are gathered whole on this rank (or being gathered);
    0 for parameters ZeRO-3 does not manage."""
    _require("deepspeed", "zero3_gathered_bytes")
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return sum(p.ds_numel * p.element_size() for p in module.parameters()
               if getattr(p, "ds_status", ZeroParamStatus.NOT_AVAILABLE) != ZeroParamStatus.NOT_AVAILABLE)


def is_compiled_in_place(module: torch.nn.Module) -> bool:
    """Has `module.compile()` (torch.compile in place) compiled this module's calls?"""
    _require("torch", "is_compiled_in_place")
    return module._compiled_call_impl is not None


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def storage_id(t: torch.Tensor) -> int:
    """An identity of the storage behind `t`, the same for all its views, unique among live storages, and
    defined on the meta device too, where every data pointer is 0 (the address of torch's StorageImpl)."""
    _require("torch", "storage_id")
    return _storage_id(t)


def storage_id_function():
    """`storage_id` with its version check done now, once: for the checkpointing recipes, which ask it of every
    saved tensor of every step (ac/recompute.py)."""
    _require("torch", "storage_id_function")
    return _storage_id


@contextlib.contextmanager
def sdpa_as_on(device_type: str):
    """On meta tensors, torch's scaled_dot_product_attention takes its math fallback, which saves the attention
    matrix; on CPU and GPU it runs a fused flash-attention kernel, which saves only its output and log-sum-exp.
    Within this context, SDPA on meta tensors (no mask, no dropout) calls the kernel `device_type` would: the
    CPU flash kernel, or on "cuda" FlashAttention-2, so that a meta profile saves what a real step saves."""
    _require("torch", "sdpa_as_on")
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.device.type != "meta" or attn_mask is not None or dropout_p or enable_gqa:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        if device_type == "cpu":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal,
                                                                              scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, is_causal,
                                                                  scale=scale)[0]

    functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


# ----------------------------------------------------------------------------- autograd collectives
def all_to_all_autograd(x: torch.Tensor, group) -> torch.Tensor:
    """torch's functional all-to-all over `group` (equal chunks of dim 0), its backward the inverse all-to-all.
    torch.distributed.nn's older form is deprecated from 2.13."""
    _require("torch", "all_to_all_autograd")
    from torch.distributed import _functional_collectives as fc

    return fc.wait_tensor(fc.all_to_all_single_autograd(x, None, None, group))


def all_gather_autograd(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """torch's functional all-gather over `group` along `dim`, its backward a summing reduce-scatter (each rank's
    slice receives the sum of every rank's gradient of it): `all_gather_single_autograd` from 2.13,
    `all_gather_tensor_autograd` before."""
    _require("torch", "all_gather_autograd")
    from torch.distributed import _functional_collectives as fc

    gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    return fc.wait_tensor(gather(x.contiguous(), dim, group))


def default_store():
    """The key-value store the default process group was formed through (the TCPStore on the master), without
    the prefixes the process group adds to its own keys, so that a tool outside the job reads a key `k` set
    here as `TCPStore(master_addr, master_port, is_master=False).get(k)`."""
    _require("torch", "default_store")
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    while isinstance(store, torch.distributed.PrefixStore):
        store = store.underlying_store
    return store


def zero3_hpz_ranks(module: torch.nn.Module) -> int:
    """Ranks ZeRO++'s hierarchical partitioning (hpZ) keeps each parameter's secondary partition over; 1 when off."""
    _require("deepspeed", "zero3_hpz_ranks")
    import torch.distributed as dist

    group = next((getattr(p, "ds_zero_param_process_group", None) for p in module.parameters()), None)
    return dist.get_world_size(group) if group is not None else 1


def zero12_grad_norm_in_float64(engine) -> bool:
    """Make ZeRO-1/2's global gradient norm independent of how the gradients are split over ranks, as ZeRO-3's is.

    DeepSpeed's ZeRO-1/2 `get_grad_norm_direct` sums the squared norms of a rank's gradient partitions in float64,
    then casts that sum to fp32 before the all-reduce over ranks; ZeRO-3 all-reduces the float64 sum. The fp32
    rounding of each rank's share makes the norm differ by an ulp between world sizes, and with clipping on the
    norm scales every gradient, so a run resumed on another number of ranks would drift from the run it continues.
    Here the sum stays float64 through the all-reduce and the root; the norm is rounded to fp32 once, at the end.
    True if the optimizer is ZeRO-1/2's (its CPU-offload path computes its norm elsewhere and is left as it is)."""
    _require("deepspeed", "zero12_grad_norm_in_float64")
    import torch.distributed as dist
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = engine.optimizer
    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or optimizer.cpu_offload:
        return False
    deepspeeds = optimizer.get_grad_norm_direct

    def grad_norm(gradients, params, norm_type=2):
        if float(norm_type) != 2.0:
            return deepspeeds(gradients, params, norm_type)
        counted = (g for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params)
                   if not (hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated)
                   and (is_model_parallel_parameter(p) or optimizer.model_parallel_rank == 0))
        squares = [torch.linalg.vector_norm(g.detach(), dtype=torch.float64).square() for g in counted]
        total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64,
                                                                       device=optimizer.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
        optimizer._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
        norm = total.sqrt().float()
        return torch.where(torch.isfinite(norm), norm, torch.full_like(norm, -1.0))  # DeepSpeed's invalid norm

    optimizer.get_grad_norm_direct = grad_norm
    return True


# ----------------------------------------------------------------------------- checkpoints
# hyperparameters that differ between this project's parameter groups (loop/optim.py)
GROUP_HYPERPARAMETERS = ("weight_decay",)


@contextlib.contextmanager
def universal_load_keeps_group_settings(engine):
    """Load a universal checkpoint into `engine` as faithfully as a checkpoint of the same world size.

    DeepSpeed's ZeRO-3 universal loader
    - copies the first saved parameter group's hyperparameters onto every group, which gives the no-decay
      group (norms, biases, position embeddings) the decay group's weight decay: the groups' own values are
      put back;
    - gives every group's Adam state one and the same `step` tensor, which each group's update then advances
      in place, so every group after the first corrects its moments with a step count too high: each state
      gets its own copy.
    The same copy gives every group the first group's learning rate; layer-wise lr decay gives each group its
    own, a fixed multiple of the first's: each group's is put back as the loaded first one times that multiple.
    """
    _require("deepspeed", "universal_load_keeps_group_settings")
    groups = engine.optimizer.param_groups
    kept = [{k: g[k] for k in GROUP_HYPERPARAMETERS if k in g} for g in groups]
    ratios = [g["lr"] / groups[0]["lr"] for g in groups]
    yield
    for group, values in zip(groups, kept):
        group.update(values)
    if engine.load_universal_checkpoint():
        for group, ratio in zip(groups[1:], ratios[1:]):
            group["lr"] = groups[0]["lr"] * ratio
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


# ----------------------------------------------------------------------------- FLOP counting
# The CPU flash-attention kernels and the GPU ones they stand in for: same leading arguments (query, key,
# value; the backward: grad_out first), same work.
_CPU_ATTENTION_AS_GPU = (("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention"),
                         ("_scaled_dot_product_flash_attention_for_cpu_backward",
                          "_scaled_dot_product_flash_attention_backward"))


def optimizer_name(engine) -> str:
    """The class of the optimizer DeepSpeed built under its ZeRO wrapper (torch's AdamW, DeepSpeedCPUAdam, Muon)."""
    _require("deepspeed", "optimizer_name")
    return type(engine.basic_optimizer).__name__


def close_failed_save(engine):
    """On a rank whose checkpoint write raised inside `engine.save_checkpoint`: what DeepSpeed's save_checkpoint
    does after the writes and the other ranks take part in, so that none of them is left waiting: the
    optimizer's checkpoint epilogue (ZeRO-3 gathers its persistent parameters again) and the closing barrier."""
    _require("deepspeed", "close_failed_save")
    from deepspeed import comm

    if engine._optimizer_has_ckpt_event_epilogue():
        engine.optimizer.checkpoint_event_epilogue()
    comm.barrier()


def _flop_registry() -> dict:
    """torch's table of FLOP formulas, with the CPU flash-attention kernels counted as the GPU ones.

    torch's counter has no formula for the CPU kernels: without one, CPU FLOP counts (the checkpointing
    profile's, the recompute's, the benchmarks' MFU) would leave attention out.
    """
    from torch.utils.flop_counter import flop_registry

    for cpu, gpu in _CPU_ATTENTION_AS_GPU:
        flop_registry.setdefault(getattr(torch.ops.aten, cpu), flop_registry[getattr(torch.ops.aten, gpu)])
    return flop_registry


def flop_counter():
    """torch's FlopCounterMode, with attention counted on CPU as on GPU."""
    _require("torch", "flop_counter")
    from torch.utils.flop_counter import FlopCounterMode

    _flop_registry()
    return FlopCounterMode(display=False)


def flop_count(func, args, kwargs, out) -> int:
    """FLOPs of one dispatched op by torch's formulas (0 for ops without one), attention on CPU included."""
    _require("torch", "flop_count")
    count = _flop_registry().get(func._overloadpacket)
    return count(*args, **kwargs, out_val=out) if count else 0


# ----------------------------------------------------------------------------- torch's dispatcher
def dispatch_mode_class():
    """torch's TorchDispatchMode (`torch.utils._python_dispatch`): the base of the checkpointing profile's op
    recorder, which sees every aten op a forward runs."""
    _require("torch", "dispatch_mode_class")
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def op_packet(func):
    """The overload packet of a dispatched op (`aten.mm` for `aten.mm.default`)."""
    _require("torch", "op_packet")
    return func._overloadpacket


def attention_kernels() -> set:
    """The aten kernels `scaled_dot_product_attention` dispatches to (flash, memory-efficient, cuDNN, CPU flash)."""
    _require("torch", "attention_kernels")
    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default}


def internal_copy_and_view_ops() -> tuple:
    """(`aten._to_copy`, `aten._unsafe_view`): what `.to()` and a copying `reshape` reach the dispatcher as."""
    _require("torch", "internal_copy_and_view_ops")
    return torch.ops.aten._to_copy, torch.ops.aten._unsafe_view


def view_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor a view was made from, followed to the first that is not a view."""
    _require("torch", "view_base")
    while t._base is not None:
        t = t._base
    return t


# ----------------------------------------------------------------------------- transformers
def hf_init_module(model, module):
    """Hugging Face's own initialisation of one module of `model` (`PreTrainedModel._init_weights`)."""
    _require("transformers", "hf_init_module")
    model._init_weights(module)


def mae_fixed_position_embeddings(model):
    """Set a freshly built `ViTMAEForPreTraining`'s frozen 2-D sin-cos position embeddings (encoder and decoder)
    with ViTMAE's own `initialize_weights`. transformers 5.24 builds them at zero: the model's weight init skips
    the encoder's table once the patch projection is marked initialised, and zeroes the decoder's, and both are
    frozen, so an MAE trained from them has no position information. The encoder's call also gives the patch
    projection and class token MAE's init (xavier-uniform as a linear layer, normal 0.02), from torch's RNG."""
    _require("transformers", "mae_fixed_position_embeddings")
    projection = model.vit.embeddings.patch_embeddings.projection
    marked = getattr(projection, "_is_hf_initialized", False)
    projection._is_hf_initialized = False
    try:
        model.vit.embeddings.initialize_weights()
    finally:
        projection._is_hf_initialized = marked
    model.decoder.initialize_weights(model.vit.embeddings.patch_embeddings.num_patches)


CPU_OPS = ("CPUAdamBuilder", "ShareMemCommBuilder")  # ZeRO-Offload's Adam; the CPU accelerator's all-reduce


def build_cpu_ops() -> list:
    """Build (or load, once built) the DeepSpeed ops a CPU run JIT-compiles at its first use, into
    TORCH_EXTENSIONS_DIR: `make`'s set-up calls it, so that no job or test pays the build. Nothing on a GPU
    machine (its ops are CUDA builds, made where they are used). Returns the ops' names."""
    if torch.cuda.is_available():
        return []
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _require("deepspeed", "build_cpu_ops")
    import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    built = []
    for name in CPU_OPS:
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and builder.is_compatible():
            builder.load(verbose=False)
            built.append(builder.NAME)
    return built


if __name__ == "__main__":  # python -m compat build_cpu_ops (the Makefile's set-up)
    if sys.argv[1:] != ["build_cpu_ops"]:
        raise SystemExit("usage: python -m compat build_cpu_ops")
    print("DeepSpeed CPU ops ready in", os.environ.get("TORCH_EXTENSIONS_DIR", "torch's default folder") + ":",
          ", ".join(build_cpu_ops()) or "none (a GPU machine)")
