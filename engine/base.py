"""The Engine interface: everything the loop, the checkpoints, the export, the planner and the benchmarks ask of a
training engine. DeepSpeed (engine/deepspeed.py), FSDP2 (engine/fsdp2.py) and DDP (engine/ddp.py) are adapters
behind it, found by the `engine` key in engine/registry.py; no code outside engine/ asks which one runs.

An engine class answers, before any model exists, what it is configured with (`engine_config`), what it holds per
rank beside the activations and sends per step (`memory`, `comm_bytes`: the planner's and `auto`'s terms), how its
checkpoints are laid out (`checkpoint_format`) and what it can do (`capabilities`). `wrap` turns a freshly built
model into an instance, which trains it: called like the model, `backward` and `step` after every micro-batch (the
optimizer steps at the accumulation boundary only; micro-batches before it skip the gradient reduction), the
global gradient norm and whether the step was applied, checkpoints and the whole weights for export.
"""
import contextlib
from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol

import torch

from config import Config

STATE_FILE = "train_state.json"  # checkpoints/manager.py's record of a checkpoint, beside every engine's own files


@dataclass(frozen=True)
class Capabilities:
    """What an engine does beyond the common ground (AdamW in fp32 or bf16, every `ac` policy, every task, exact
    and elastic resume, export). Each field is a row of FEATURES: a run that uses a feature its engine lacks is
    refused in one line."""
    tensor_parallel: bool = False  # tp_size > 1 (DeepSpeed's AutoTP)
    muon: bool = False  # optimizer muon (DeepSpeed's Muon)
    ds_config: bool = False  # a DeepSpeed JSON template (ZeRO++, offload, DeepCompile)
    fp16: bool = False  # precision fp16, which needs a loss scaler
    async_save: bool = False  # checkpoints written by a background thread
    replicate: bool = False  # HSDP: replicate_degree > 1
    pipeline: bool = False  # pp_size > 1 (torch.distributed.pipelining's stages and schedules)


@dataclass(frozen=True)
class Feature:
    capability: str  # the Capabilities field
    key: str  # the config key that asks for it
    used: Callable[[Config], bool]
    what: str  # what it is, in a few words
    off: str  # the setting that does without it


FEATURES = (
    Feature("tensor_parallel", "tp_size", lambda c: c.tp_size > 1, "tensor parallelism (DeepSpeed's AutoTP)",
            "tp_size 1"),
    Feature("muon", "optimizer", lambda c: c.optimizer == "muon", "the Muon optimizer (DeepSpeed's)",
            "optimizer adamw"),
    Feature("ds_config", "ds_config", lambda c: bool(c.ds_config),
            "a DeepSpeed JSON (ZeRO++, offload, DeepCompile)", "an empty ds_config"),
    Feature("fp16", "precision", lambda c: c.precision == "fp16", "fp16 training with a loss scaler",
            "precision bf16"),
    Feature("async_save", "async_save", lambda c: c.async_save,
            "checkpoints written in the background (DCP's async_save)", "async_save false"),
    Feature("replicate", "replicate_degree", lambda c: c.replicate_degree > 1,
            "HSDP (replicas each sharded over world size / replicate_degree ranks)", "replicate_degree 1"),
    Feature("pipeline", "pp_size", lambda c: c.pp_size > 1,
            "pipeline parallelism (torch.distributed.pipelining's stages)", "pp_size 1"),
)


def refusal(name: str, capabilities: Capabilities, cfg: Config, others: dict) -> str | None:
    """The one line for the first feature `cfg` asks for that engine `name` lacks, or None. `others`: {engine
    name: its Capabilities}, to say which engines have it."""
    for f in FEATURES:
        if f.used(cfg) and not getattr(capabilities, f.capability):
            have = [n for n, c in others.items() if getattr(c, f.capability)]
            instead = f"{f.off}" + (f" or engine {' / '.join(have)}" if have else "")
            return f"engine {name} with {f.key} {getattr(cfg, f.key)}: {f.what} is not available under engine " \
                   f"{name}; use {instead}"
    return None


@dataclass
class Built:
    engine: "Engine"  # the model, its optimizer and its LR schedule
    ac_plan: dict  # what activation checkpointing applied, with its profile (ac_plan.json)
    engine_config: dict  # the resolved engine config (the run directory's `config_file`)
    precision: str  # fp32 | bf16 | fp16
    dtype: torch.dtype  # what the model's inputs are cast to


@dataclass
class Sizes:
    """The parameter counts the memory and traffic models need (of one tensor rank's share under TP)."""
    params: int  # every parameter
    outside_blocks: int  # the stem, the final norm, the head: what no transformer block holds
    largest_block: int


class CheckpointFormat(Protocol):
    """How an engine lays out its checkpoint directory, and how it is read back without the engine."""

    def check(self, path: str, state: dict, cfg: Config, world_size: int) -> bool:
        """ConfigError when checkpoint `path` (its train_state.json: `state`) cannot resume this run (a missing
        file, a setting that changes the layout); True when it must be converted first (another world size)."""

    def convert(self, path: str, state: dict, world_size: int, log=print) -> None:
        """The conversion `check` asked for (on one rank, before the process group loads it)."""

    def load_tag(self, tag: str, converted: bool) -> str:
        """The tag `load_checkpoint` reads."""

    def read_weights(self, checkpoint: str, state: dict, hf_config: str) -> tuple[dict, Callable]:
        """({name: a tensor-like with .shape and .dtype}, name -> the whole fp32 tensor) of the model's weights,
        read lazily, in one process, without a process group: what export.py writes."""

    def remove_derived(self, path: str) -> None:
        """Delete what `convert` wrote beside checkpoint `path` (pruning calls it)."""


class Engine(Protocol):
    """A model wrapped for training: see the module's docstring."""
    name: ClassVar[str]
    config_file: ClassVar[str]  # the resolved engine config's file name in the run directory
    capabilities: ClassVar[Capabilities]
    checkpoint_format: ClassVar[CheckpointFormat]
    module: torch.nn.Module  # the model as wrapped (its parameters sharded or partitioned as the engine keeps them)
    async_save: bool  # save() may start a background write (checkpoints/manager.py commits it later)
    pending: object  # checkpoints/manager.py's record of that write
    skipped_steps: int  # steps skipped for non-finite gradients
    pipeline: object  # under pp_size > 1 this rank's stage and schedule (parallel/pipeline.py's Pipeline), else None

    # ------------------------------------------------------------------ before the model
    @classmethod
    def engine_config(cls, cfg: Config, hidden_size: int, world_size: int, precision: str,
                      ranks_per_node: int | None = None, gpu: bool | None = None) -> dict:
        """What the engine is configured with; ConfigError on a contradiction. `ranks_per_node`, `gpu`: the
        cluster a plan is for (plan.py), by default this process's."""

    @classmethod
    def build_model(cls, build: Callable, cfg: Config, engine_config: dict):
        """`build(**how)` -> (model, processor), as the engine needs the model created (ZeRO-3: partitioned as
        each parameter is made)."""

    @classmethod
    def wrap(cls, model: torch.nn.Module, cfg: Config, world_size: int, device_type: str, log=print,
             resharding: bool = False) -> Built:
        """Activation checkpointing, compile and the engine around a freshly built model. `resharding`: the
        checkpoint to be loaded was written by another number of ranks."""

    @classmethod
    def memory(cls, cfg: Config, sizes: Sizes, data_ranks: int, precision: str, engine_config: dict,
               gpu: bool) -> tuple[dict, dict]:
        """(per-rank bytes by part, {"backward", "optimizer_step", "zero3_gathered"}): what the engine holds
        beside the activations at the two moments that set a step's peak (engine/memory.py)."""

    @classmethod
    def comm_bytes(cls, cfg: Config, n_params: int, data_ranks: int, ranks_per_node: int, weight_bytes: int,
                   engine_config: dict) -> tuple[float, float]:
        """(bytes within a node, bytes between nodes) each rank sends per optimizer step."""

    @classmethod
    def optimizer_holders(cls, cfg: Config, data_ranks: int) -> int:
        """Ranks that share the optimizer's states (each steps 1/holders of them)."""

    @classmethod
    def numerics(cls, cfg: Config, engine_config: dict) -> str | None:
        """How this configuration's arithmetic differs from the plain fp32-master AdamW step every engine
        takes by default (quantized communication, another optimizer implementation), or None."""

    @classmethod
    def describe(cls, cfg: Config, world_size: int, module: torch.nn.Module | None = None) -> str:
        """How the weights are held, for the start-up line: "ZeRO-3 (hpZ over 8 ranks)", "DDP (replicated)"."""

    @classmethod
    def plan_label(cls, estimate: dict) -> str:
        """A planned configuration (planner/estimate.py's dict) in the planner's tables: "ZeRO-3++", "FSDP2 keep"."""

    @classmethod
    def search_variants(cls, world_size: int, ranks_per_node: int, tp_size: int) -> list[dict]:
        """The config overrides (zero_stage, ds_config, replicate_degree) a planner's search tries on this cluster
        at this tensor-parallel size; [] when the engine cannot run it."""

    # ------------------------------------------------------------------ the step
    def __call__(self, *args, **kwargs): ...

    def train(self) -> None: ...

    def eval(self) -> None: ...

    def backward(self, loss: torch.Tensor) -> None:
        """The micro-batch's gradients, divided by the accumulation steps."""

    def step(self) -> None:
        """After every micro-batch; at the accumulation boundary: the norm, clipping, the optimizer, the schedule."""

    @property
    def at_boundary(self) -> bool:
        """Is the micro-batch about to run the last of its optimizer step (the one whose backward reduces the
        gradients across ranks; those before it accumulate without a reduction)?"""

    def was_step_applied(self) -> bool: ...

    def get_lr(self) -> list[float]: ...

    def get_global_grad_norm(self): ...

    @property
    def is_compiled(self) -> bool: ...

    @property
    def optimizer_name(self) -> str:
        """The torch optimizer's class under the engine (AdamW, DeepSpeedCPUAdam, Muon)."""

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer: ...

    # ------------------------------------------------------------------ checkpoints and export
    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict) -> None:
        """Every rank's part of `save_dir/tag`; returns when every rank's files are complete."""

    def start_checkpoint(self, save_dir: str, tag: str, client_state: dict) -> None:
        """save_checkpoint in the background (async_save engines)."""

    def wait_checkpoint(self) -> None: ...

    def close_failed_save(self, background: bool) -> None:
        """On a rank whose write raised: what the others still wait for (the closing barrier)."""

    def load_checkpoint(self, load_dir: str, tag: str) -> tuple[str | None, dict]:
        """(path loaded, client_state) on every rank, whatever number of ranks wrote it."""

    def full_state_dict(self, rank: int) -> dict:
        """The whole model's weights on rank 0 ({} elsewhere)."""

    def writing_local_weights(self) -> contextlib.AbstractContextManager:
        """While active, what is written into each rank's local weights becomes the weights (the EMA's swap)."""

    def destroy(self) -> None:
        """Release what the engine holds process-wide (DeepSpeed's), before another engine is built."""
