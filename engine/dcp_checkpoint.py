"""torch.distributed.checkpoint (DCP) as the torch engines' checkpoint layout (FSDP2's and DDP's).

Each rank writes its shards of the weights and AdamW's states (`__<rank>_0.distcp`, described by `.metadata`; a
tensor every rank holds alike is written once, by the lowest rank), and rank 0 writes `engine_state.pt` beside
them: the LR schedule, the step counters and the client state, plain values only. A load on any number of ranks
reshards the tensors, so no conversion is needed to resume elsewhere. Everything here is read back with
`torch.load(..., weights_only=True)`: a checkpoint cannot run code.
"""
import contextlib
import os
import warnings

import torch
import torch.distributed as dist

from config import Config, ConfigError

ENGINE_STATE = "engine_state.pt"  # beside DCP's files: the LR schedule, the step counters and the client state


@contextlib.contextmanager
def dcp_failures(path: str):
    """A rank's failed write, which DCP raises on every rank as a CheckpointException, as an OSError here."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        first = next(iter(e.failures.values()), (e,))  # rank -> (exception, its traceback)
        first = first[0] if isinstance(first, tuple) else first
        raise OSError(getattr(first, "errno", None), getattr(first, "strerror", None) or str(first),
                      getattr(first, "filename", path)) from e


def state(module: torch.nn.Module, optimizer, flat: bool = True) -> dict:
    """The model's and the optimizer's state as DCP reads and writes it (sharded DTensors under FSDP2). `flat`:
    the optimizer's by parameter name (`state.<name>.exp_avg`, `param_groups.<name>.lr`), so that ranks holding
    different parameters (pipeline stages) never write the same key; False: its groups by position, a layout
    `load` still reads."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optim = get_state_dict(module, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=flat))
    return {"model": model, "optim": optim}


def save(module, optimizer, path: str, extra: dict, group=None, background: bool = False):
    """Every rank's shards into `path`, rank 0's `extra` (plain values) beside them. `background`: DCP's
    async_save (the shards copied to host memory now, written by its thread; its collectives on `group`): the
    future to wait on."""
    import torch.distributed.checkpoint as dcp

    planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    # a tensor every rank holds (a batch norm's running statistics, each rank's own; DDP's whole weights) is
    # written from rank 0, as DeepSpeed writes the module's buffers, and as the export takes them
    with dcp_failures(path):
        if background:
            future = dcp.async_save(state(module, optimizer), checkpoint_id=path, process_group=group,
                                    planner=planner)
        else:
            dcp.save(state(module, optimizer), checkpoint_id=path, planner=planner)
            future = None
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)  # a background write may not have made it yet
        torch.save(extra, os.path.join(path, ENGINE_STATE))
    return future


def load(module, optimizer, path: str) -> dict:
    """The checkpoint `path` loaded into this run's ranks (whatever number wrote it); rank 0's `extra`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    flat = not any(k.startswith("optim.param_groups.0.") for k in stored)  # else groups by position
    loaded = state(module, optimizer, flat)
    # a parameter without gradients when the checkpoint was written (one the forward does not use: UperNet's
    # backbone's last norm) had no AdamW state; it has none to load now either
    # (flat: its fresh state stays, which no step uses: it has no gradient)
    if flat:
        subset = {k: v for k, v in loaded["optim"].items() if not k.startswith("state.") or f"optim.{k}" in stored}
        reading = {"model": loaded["model"], "optim": subset}
    else:
        loaded["optim"]["state"] = {name: s for name, s in loaded["optim"]["state"].items()
                                    if all(f"optim.state.{name}.{k}" in stored for k in s)}
        reading = loaded
    dcp.load(reading, checkpoint_id=path)
    if flat:  # the plain values (the groups' lr, ...) are replaced in the dict DCP was given
        loaded["optim"].update(reading["optim"])
    # not strict: the parameters left out above; DCP's load has already refused a checkpoint missing a weight
    set_state_dict(module, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"],
                   options=StateDictOptions(strict=False, flatten_optimizer_state_dict=flat))
    return torch.load(os.path.join(path, ENGINE_STATE), weights_only=True)


def files_missing(path: str) -> list[str]:
    """The files of the DCP checkpoint `path` that its metadata names (and engine_state.pt) but that are not there."""
    import torch.distributed.checkpoint as dcp

    names = set(os.listdir(path))
    if ".metadata" not in names:
        return [".metadata", *([] if ENGINE_STATE in names else [ENGINE_STATE])]
    stored = dcp.FileSystemReader(path).read_metadata().storage_data or {}
    wanted = sorted({info.relative_path for info in stored.values()} | {ENGINE_STATE})
    return [n for n in wanted if n not in names]


class DCPCheckpoint:
    """engine/base.py's CheckpointFormat for the torch engines: resharded by DCP itself on load."""

    def check(self, path: str, state: dict, cfg: Config, world_size: int) -> bool:
        missing = files_missing(path)
        if missing:
            raise ConfigError(f"resume: checkpoint {path} is incomplete: {len(missing)} of the files its "
                              f"{state['world_size']} ranks wrote are missing ({', '.join(missing[:4])}"
                              f"{', ...' if len(missing) > 4 else ''})")
        return False

    def convert(self, path: str, state: dict, world_size: int, log=print):
        pass  # DCP reshards as it loads

    def load_tag(self, tag: str, converted: bool) -> str:
        return tag

    def remove_derived(self, path: str):
        pass

    @contextlib.contextmanager
    def read_weights(self, checkpoint: str, state: dict, hf_config: str):
        """The fp32 weights, each assembled whole from every rank's shards when asked for, without a process
        group."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        stored = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
        shapes = {key[len("model."):]: torch.empty(meta.size, dtype=meta.properties.dtype, device="meta")
                  for key, meta in stored.items()
                  if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}

        def tensor(name):
            whole = {"model": {name: torch.empty(shapes[name].shape, dtype=shapes[name].dtype)}}
            with warnings.catch_warnings():  # DCP says it loads in one process, which is the intent here
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                dcp.load(whole, checkpoint_id=checkpoint, no_dist=True)
            return whole["model"][name]

        yield shapes, tensor
