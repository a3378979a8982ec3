"""The benchmark suites: the shapes each one measures and the configurations it runs on each shape
(`python -m benchmarks.train_bench --suite NAME` runs one)."""
from dataclasses import dataclass, field

from engine.deepspeed_zero import DeepSpeedEngine
from engine.fsdp2 import FSDP2Engine

MiB = 2**20
DEEPSPEED, FSDP2 = DeepSpeedEngine.name, FSDP2Engine.name  # the engines the suites run, by their `engine` names


@dataclass
class Shape:
    model: str
    image_size: int
    patch_size: int
    micro_batch_size: int
    label: str


@dataclass
class Run:
    """One configuration. `ac` is this project's policy, on either engine, or for FSDP2 also Hugging Face's own
    checkpointing (`hf:full`, `hf:every_n:K`); `auto:race` and `auto:fX` are budgets the harness fills from
    peaks it measured earlier in the same invocation (see `resolve_budget`). `compile`: torch.compile as each
    engine's users apply it (bench_worker.Spec)."""
    engine: str  # deepspeed | fsdp2
    ac: str
    zero: int = 0  # deepspeed's stage
    reshard: bool = True  # fsdp2's reshard_after_forward
    compile: bool = False
    micro: int = 0  # a micro-batch of its own (a suite with a global batch); 0: the shape's

    @property
    def name(self) -> str:
        compiled = (" + compile" if self.compile else "") + (f" @ micro {self.micro}" if self.micro else "")
        if self.engine == FSDP2:
            hf = {"hf:full": "HF full AC"}.get(self.ac, f"HF AC every {self.ac.split(':')[-1]}") \
                if self.ac.startswith("hf:") else self.ac
            return f"FSDP2{'' if self.reshard else ' no-reshard'} + {hf}{compiled}"
        return f"ZeRO-{self.zero} + {self.ac}{compiled}"

    @property
    def zero_stage(self) -> int:
        """train.py's zero_stage: DeepSpeed's stage; FSDP2's resharding (3 reshards after forward, 2 keeps the
        gathered weights)."""
        return self.zero if self.engine == DEEPSPEED else 3 if self.reshard else 2

    @property
    def plain(self) -> bool:
        """FSDP2 as its users run it: without this project's checkpointing (none, or Hugging Face's)."""
        return self.engine == FSDP2 and (self.ac == "none" or self.ac.startswith("hf:"))


@dataclass
class Suite:
    shapes: list
    runs: list  # per shape label, or "*" for every shape: {label: [Run, ...]}
    repeats: int = 5
    profiled_steps: int = 2
    warmup_steps: int = 0  # untimed, between the profiled steps and the timed ones (bench_worker.Spec)
    timed_steps: int = 2
    ranks: int = 2
    timeout_s: int = 600
    targets_shape: str = ""  # the shape the budget-race, memory and `auto` targets are checked on
    host: bool = False  # a host-overhead suite: its targets are on the time per step alone
    # a micro-batch race (benchmarks/race.py): every run's micro-batch accumulates to this many images per
    # step over the ranks; one screening repeat runs every configuration, then `repeats` confirmation repeats
    # run the fastest few that fit each budget
    global_batch: int = 0
    notes: list = field(default_factory=list)


def fsdp2(ac, reshard=True, compile=False):
    return Run(FSDP2, ac, reshard=reshard, compile=compile)


def zero(stage, *policies, compile=False):
    return [Run("deepspeed", ac, zero=stage, compile=compile) for ac in policies]


def same_policy(policies, stage=3, compile=False):
    """Each policy under FSDP2 (resharding, as ZeRO-3 does) and under ZeRO-`stage`, side by side."""
    return [run for ac in policies for run in (fsdp2(ac, compile=compile), Run("deepspeed", ac, zero=stage,
                                                                                 compile=compile))]


def micro_race(policies: list, micros: list) -> list:
    """Each run of `policies` at each micro-batch of `micros`."""
    from dataclasses import replace

    return [replace(run, micro=m) for m in micros for run in policies]


# Order matters only in the first repeat: plain FSDP2 and the fixed policies come first because the `auto`
# budgets are derived from their measured peaks.
PLAIN_VIT = [fsdp2("none"), fsdp2("hf:full"), fsdp2("hf:every_n:2"), fsdp2("none", False)]
PLAIN_SWIN = [fsdp2("none"), fsdp2("hf:full"), fsdp2("none", False)]
VIT_S = Shape("vit-small", 64, 8, 32, "ViT-S/8, 64x64 (65 tokens), batch 32 per rank")
SWIN_T = Shape("swin-tiny-w4", 128, 4, 32, "Swin-T (4x4 windows), 128x128, batch 32 per rank")
SUITES = {
    "cpu-smoke": Suite(
        shapes=[Shape("vit-debug", 16, 0, 8, "vit-debug, 16x16, batch 8 per rank")],
        runs={"*": [fsdp2("none"), fsdp2("hf:full"), *zero(1, "none"), *same_policy(["selective"]),
                    *zero(3, "none", "full", "auto:f0.5")]},
        repeats=2, profiled_steps=2, warmup_steps=1, timed_steps=2, timeout_s=180, targets_shape="vit-debug"),
    "cpu": Suite(
        shapes=[VIT_S, SWIN_T],
        runs={VIT_S.label: [*PLAIN_VIT, Run("deepspeed", "none", zero=2),
                            *same_policy(["full", "every_n:2", "selective", "hierarchical"]), *zero(3, "none"),
                            *same_policy(["auto:race"]), *zero(2, "auto:race")],
              SWIN_T.label: [*PLAIN_SWIN, Run("deepspeed", "none", zero=2), *zero(3, "none"),
                             *same_policy(["selective", "full"])]},
        # 5 repeats of 3 timed steps: 15 steps per configuration, each ratio paired within a repeat
        repeats=5, profiled_steps=2, warmup_steps=1, timed_steps=3, targets_shape="vit-small"),
    # host overhead: 24 blocks of width 64 and 2 images per rank, where a step is the engine's Python, dispatch
    # and collectives rather than arithmetic; the time per step, per engine and per policy, eager and compiled
    "host": Suite(
        shapes=[Shape("vit-narrow", 32, 4, 2, "ViT 24 blocks x width 64, 32x32 (65 tokens), batch 2 per rank")],
        runs={"*": [fsdp2("none"), fsdp2("hf:full"), fsdp2("none", False), *zero(2, "none"), *zero(3, "none"),
                    *same_policy(["selective", "full"]), fsdp2("none", compile=True), fsdp2("hf:full", compile=True),
                    *zero(3, "none", compile=True), *same_policy(["selective", "full"], compile=True)]},
        repeats=5, profiled_steps=2, warmup_steps=5, timed_steps=30, timeout_s=300, targets_shape="vit-narrow",
        host=True),
    # `light` against `none` and `selective` on the host shape, under both engines: its host cost alone
    "host-light": Suite(
        shapes=[Shape("vit-narrow", 32, 4, 2, "ViT 24 blocks x width 64, 32x32 (65 tokens), batch 2 per rank")],
        runs={"*": same_policy(["none", "light", "selective"])},
        repeats=5, profiled_steps=2, warmup_steps=5, timed_steps=30, timeout_s=300, targets_shape="vit-narrow",
        host=True),
    # the compiled blocks' host cost at `none`, `light` and `selective`, under both engines: light and selective
    # applied when torch.compile traces each block (ac/policies.py's traced_policy)
    "host-compiled": Suite(
        shapes=[Shape("vit-narrow", 32, 4, 2, "ViT 24 blocks x width 64, 32x32 (65 tokens), batch 2 per rank")],
        runs={"*": same_policy(["none", "light", "selective"], compile=True)},
        repeats=5, profiled_steps=2, warmup_steps=5, timed_steps=30, timeout_s=300, targets_shape="vit-narrow",
        host=True),
    # the micro-batch race on the host shape, where images/s rises with the micro-batch as on GPUs: 64 images
    # per step, each configuration at micro-batches 4 to 32 (accumulating 8 to 1), one screening repeat, then
    # five confirmation repeats of each side's fastest per budget (benchmarks/race.py)
    "race": Suite(
        shapes=[Shape("vit-narrow", 32, 4, 32, "ViT 24 blocks x width 64, 32x32 (65 tokens), 64 images per step")],
        runs={"*": micro_race([fsdp2("none"), fsdp2("hf:full"), fsdp2("hf:every_n:2"), fsdp2("none", False),
                               *zero(2, "none", "selective", "full"), *zero(3, "selective", "full")],
                              [4, 8, 16, 32])},
        global_batch=64, repeats=5, profiled_steps=2, warmup_steps=1, timed_steps=3, timeout_s=600,
        targets_shape="vit-narrow"),
    "race-smoke": Suite(
        shapes=[Shape("vit-debug", 16, 0, 4, "vit-debug, 16x16, 8 images per step")],
        # FSDP2 + selective fits below plain FSDP2's peak (DeepSpeed's setup alone does not, on vit-debug): the
        # train.py phase has a winner to run
        runs={"*": micro_race([fsdp2("none"), fsdp2("hf:full"), fsdp2("selective"), *zero(3, "selective")], [2, 4])},
        global_batch=8, repeats=1, profiled_steps=1, warmup_steps=0, timed_steps=1, timeout_s=180,
        targets_shape="vit-debug"),
    "gpu": Suite(
        shapes=[Shape("vit-large", 224, 16, 32, "ViT-L/16, 224x224, batch 32 per GPU"),
                Shape("vit-huge", 224, 14, 16, "ViT-H/14, 224x224, batch 16 per GPU"),
                Shape("swin-base", 224, 4, 32, "Swin-B, 224x224, batch 32 per GPU"),
                Shape("swin-large", 224, 4, 16, "Swin-L, 224x224, batch 16 per GPU")],
        runs={"*": [fsdp2("none"), fsdp2("hf:full"), fsdp2("hf:every_n:2"), *zero(3, "none"),
                    *same_policy(["selective", "full", "hierarchical", "auto:race"]),
                    *zero(2, "none", "selective")]},
        repeats=3, profiled_steps=3, timed_steps=10, ranks=8, targets_shape="vit-large"),
    # what benchmarks/gpu_check.sh measures on one GPU, once: each engine at each fixed policy on ViT-L/16
    # (its planned micro-batch: --micro_batch_size), and the same runs on a tiny model on CPU for its smoke mode
    "gpu-check": Suite(
        shapes=[Shape("vit-large", 224, 16, 32, "ViT-L/16, 224x224, batch 32 per GPU")],
        runs={"*": [*same_policy(["none", "selective", "full"]), *zero(2, "none", "selective", "full")]},
        repeats=1, profiled_steps=2, warmup_steps=1, timed_steps=8, ranks=1, timeout_s=120, targets_shape="vit-large"),
    "gpu-check-smoke": Suite(
        shapes=[Shape("vit-debug", 16, 0, 8, "vit-debug, 16x16, batch 8 per rank")],
        runs={"*": [*same_policy(["none", "selective", "full"]), *zero(2, "none", "selective", "full")]},
        repeats=1, profiled_steps=2, warmup_steps=1, timed_steps=2, ranks=1, timeout_s=120, targets_shape="vit-debug"),
}


def micro_and_accum(suite: Suite, shape: Shape, run: Run) -> tuple:
    """A run's (micro-batch, accumulation steps): its own micro-batch accumulated to the suite's global batch,
    or the shape's micro-batch, once."""
    micro = run.micro or shape.micro_batch_size
    if not suite.global_batch:
        return micro, 1
    accum, rest = divmod(suite.global_batch, micro * suite.ranks)
    if rest or not accum:
        raise ValueError(f"{run.name}: {suite.ranks} ranks x micro-batch {micro} do not divide the global batch "
                         f"{suite.global_batch}")
    return micro, accum


def runs_of(suite: Suite, shape: Shape) -> list:
    return suite.runs.get(shape.label, suite.runs.get("*", []))
