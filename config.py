"""Every run-config key, its type, default and meaning: the one place they are defined.

Resolution order: the defaults below, then a YAML recipe (`--config configs/X.yaml`), then
`--key value` on the command line, then what `accelerate launch`'s DeepSpeed plugin says (it must agree with keys
given above). Unknown keys and values of the wrong type are errors.
The defaults are the main job: a small ViT on the bundled digits shards.
"""
import dataclasses
import os
import re
import sys
import textwrap
from dataclasses import dataclass

import yaml


class ConfigError(ValueError):
    """Bad input: train.py prints it as one line and exits non-zero before anything is written."""


@dataclass
class Config:
    # task and model
    task: str = "classification"  # classification | mae (masked-autoencoder pretraining, ViT) | simmim (masked-image pretraining, ViT or Swin) | segmentation (UperNet over a Swin; image/mask shards) (models/tasks.py)
    model: str = "vit-digits"  # registry name (see models/registry.py) or a local Hugging Face directory
    num_labels: int = 10  # classes (segmentation: with the background, if it is one); the head is re-initialised when a local model has another count
    image_size: int = 16  # input resolution (square); the model's positional embeddings follow it
    patch_size: int = 0  # 0 = the registry size's own patch size
    mask_ratio: float = 0.75  # mae and simmim: the fraction of patches masked (MAE: 0.75; SimMIM: 0.6)
    mask_patch_size: int = 32  # simmim: the side in pixels of the square blocks masked whole, a multiple of the patch size that divides image_size (SimMIM: 32)
    drop_path: float = 0.0  # stochastic depth: the last block's drop rate, rising linearly from 0 (DeiT-B 0.1, Swin-B 0.5)
    # fine-tuning
    freeze: str = ""  # parameters not trained: "backbone" (all but the classifier: a linear probe) or comma-separated name patterns (fnmatch)
    layer_decay: float = 1.0  # layer-wise lr decay: of L blocks, block i trains at lr x layer_decay^(L+1-i), the head at lr (BEiT/MAE: 0.65-0.75)
    # data
    train_shards: str = "data/digits/train-{000000..000003}.tar"  # the training shards: a directory written by data/make_shards.py (every train shard its _info.json lists), or a WebDataset spec (brace pattern, glob, http(s)://, s3:// and other object storage, pipe:; " + " joins sources)
    val_shards: str = "data/digits/val-000000.tar"  # the evaluation shards, as train_shards (a directory: its val split)
    strict_data: bool = False  # a shard spec that covers fewer shards than its _info.json lists for the split is an error, not a warning
    data_mode: str = "epoch"  # epoch: each sample once per epoch | resampled: shards drawn with replacement (many nodes) | synthetic: random images, no shards read (measuring the step; data/synthetic.py)
    num_workers: int = 1  # DataLoader worker processes per rank for training data
    data_streams: int = 0  # virtual streams the data order is cut into; 0 = ranks x grad_accum_steps x num_workers (docs/data.md)
    shuffle_buffer: int = 1000  # raw samples per shuffle block, per worker (memory: this many encoded images)
    crop_scale_min: float = 1.0  # random resized crop's smallest area fraction; 1.0 = plain resize (ImageNet: 0.08)
    hflip: float = 0.0  # horizontal flip probability (ImageNet: 0.5; digits: 0, a flipped 2 is no 2)
    randaug_n: int = 0  # RandAugment ops per image; 0 = off (ImageNet: 2)
    randaug_m: int = 9  # RandAugment magnitude, 0..10
    mixup: float = 0.0  # Mixup alpha; 0 = off (DeiT: 0.8)
    cutmix: float = 0.0  # CutMix alpha; 0 = off (DeiT: 1.0); with both set, each batch uses one at random
    # parallelism and precision
    engine: str = "deepspeed"  # deepspeed (ZeRO, ds_config) | fsdp2 (PyTorch's fully_shard per block) | ddp (DistributedDataParallel: replicated weights and optimizer states) (engine/registry.py)
    zero_stage: int = 2  # DeepSpeed ZeRO stage: 1 (optimizer states), 2 (+gradients), 3 (+parameters); fsdp2: 3 reshards each block's weights after its forward, 1 and 2 keep them to the backward; ddp: unused
    replicate_degree: int = 1  # fsdp2: HSDP, the ranks form this many replicas of the model, each sharded over world size / replicate_degree ranks (set it to the number of nodes: shard within a node, replicate across; ZeRO++'s hierarchical partitioning's analogue); 1 = one shard group of every rank
    tp_size: int = 1  # tensor parallelism: ranks of a node that split each block's matrices (DeepSpeed AutoTP); data parallelism and ZeRO run over world size / tp_size
    sp_size: int = 1  # sequence parallelism (ViTs: classification, MAE, SimMIM): consecutive ranks (with tp_size: one of each tensor group in a block of tp_size x sp_size ranks) that split each image's tokens, attention by Ulysses all-to-alls (parallel/sequence.py); they read the same micro-batches, so data parallelism runs over world size / sp_size
    pp_size: int = 1  # pipeline parallelism (fsdp2, ddp; ViT classifiers): consecutive ranks that each hold a stage of the blocks (the first also the embeddings, the last the norm and head), activations passed between them by torch.distributed.pipelining; they read the same micro-batches, so each stage is sharded (fsdp2) or replicated (ddp) over world size / pp_size ranks (parallel/pipeline.py)
    pp_schedule: str = "1f1b"  # 1f1b (stage s of pp_size holds at most pp_size - s pieces' activations) | gpipe (every piece's forward, then every backward: all pieces' activations)
    pp_split: str = ""  # the blocks each pipeline stage holds, comma-separated in stage order (e.g. 5,7,7,5: fewer on the end stages, which also run the embeddings and the head); "" = as even as they divide, the remainder on the later stages
    pp_microbatches: int = 0  # pipeline micro-batches each micro_batch_size batch is cut into; 0 = the fewest that keep the bubble, (pp_size - 1) / (pp_microbatches + pp_size - 1), at or under 20% and divide micro_batch_size
    ds_config: str = ""  # DeepSpeed JSON template; "" = ds_configs/zero{zero_stage}.json. Its "auto" fields come from this config
    dist_timeout: float = 1800.0  # seconds a rank waits for the master's address, for the other ranks, and in any collective
    device_memory_gb: float = 0.0  # cap each rank's GPU memory at this many GiB (torch.cuda.set_per_process_memory_fraction): run as on a smaller device (an A100-40GB's 40 on an H200); 0 = the whole device
    precision: str = "auto"  # fp32 | bf16 | fp16 | auto (bf16 on GPUs that support it, else fp32)
    ac: str = "none"  # activation checkpointing: none | light | full | every_n:K | selective | hierarchical[:K] | offload | auto:BUDGET_GB (ac/policies.py)
    compile: bool = False  # torch.compile the wrapped model (DeepSpeed's engine.compile(), after the checkpointing)
    # optimisation
    micro_batch_size: int = 32  # images per rank per forward/backward
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    optimizer: str = "adamw"  # adamw | muon (Muon for 2-D weight matrices, AdamW at lr for the rest; DeepSpeed's own)
    lr: float = 2e-3  # peak learning rate (AdamW)
    muon_lr: float = 0.02  # peak learning rate of Muon's matrices (optimizer muon)
    min_lr: float = 1e-5  # learning rate at the end of the cosine decay
    weight_decay: float = 0.05  # AdamW decay; never applied to norms, biases, position embeddings, class token
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.999  # AdamW beta2
    ema_decay: float = 0.0  # EMA of the weights, updated every optimizer step with this decay (DeiT: 0.99996); 0 = off
    export_ema: bool = False  # hf_model/ holds the EMA weights instead of the live ones (needs ema_decay)
    max_bad_steps: int = 5  # stop after this many steps in a row with a non-finite loss or gradients (each is skipped)
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 = off
    label_smoothing: float = 0.1  # cross-entropy label smoothing (DeiT's 0.1)
    warmup_steps: int = 50  # linear warm-up from 0 to lr, in optimizer steps
    warmup_epochs: float = 0.0  # the warm-up in epochs instead (0 = warmup_steps); steps = epochs x train samples / global batch
    max_steps: int = 900  # optimizer steps in the whole run (also the length of the cosine schedule)
    epochs: float = 0.0  # the run's length in passes over the train shards instead of max_steps (0 = max_steps); needs their _info.json sample counts
    # evaluation, logging, checkpoints
    eval_every: int = 300  # evaluate every N optimizer steps (and always at the end); 0 = only at the end
    save_every: int = 300  # DeepSpeed checkpoint every N optimizer steps (and at the end); 0 = only at the end
    log_every: int = 10  # read the loss and counters from the device at most every N steps (and at evaluations, checkpoints and the end); metrics.jsonl, TensorBoard and the bar are written then, and a preemption signal is acted on
    output_dir: str = "runs/digits-vit"  # run directory: config, metrics.jsonl, TensorBoard, checkpoints, hf_model/
    seed: int = 0  # seeds the initial weights (per module, the same for any world size) and the data order
    keep_last: int = 3  # complete checkpoints kept, newest first; 0 = all
    keep_best: bool = True  # also keep the checkpoint with the best evaluation (val top-1; pretraining: val loss) among those that save and evaluate
    async_save: bool = False  # fsdp2: checkpoints copied to host memory, then written by a background thread while training goes on (DCP's async_save; committed when the next save starts); the last one and a preemption's are written before going on
    min_free_gb: float = 0.0  # skip a checkpoint (with a warning, training goes on) that would leave less free disk than this
    preempt_grace: float = 25.0  # seconds from SIGTERM/SIGUSR1 to exit: the step finishes and a checkpoint is written (launchers kill at 30)
    sync_to: str = ""  # object storage mirroring output_dir (s3://bucket/prefix, any fsspec URL): each complete checkpoint uploaded in the background, `latest` last; --resume latest downloads the newest when output_dir has nothing as new (docs/clusters.md)
    resume: str = ""  # "" = fresh run, "latest" = newest checkpoint in output_dir, or a checkpoint directory
    progress: bool = True  # tqdm progress bar on rank 0
    # experiment tracking (runlog/tracking.py; docs/tracking.md)
    report_to: str = "tensorboard"  # where the metrics go beside metrics.jsonl, comma-separated (a list in YAML): tensorboard, mlflow, wandb; none = metrics.jsonl only
    tracking_uri: str = ""  # mlflow: the tracking server (http://host:port) or store; "" = $MLFLOW_TRACKING_URI, else MLflow's default
    project: str = ""  # mlflow's experiment, wandb's project; "" = $MLFLOW_EXPERIMENT_NAME / $WANDB_PROJECT, else vit-training
    run_name: str = ""  # the tracked run's name; "" = the output_dir's last component
    tracking_parent: str = ""  # mlflow: the run this one nests under (sweep.py sets each trial's to the study's run)
    log_model: bool = False  # also send hf_model/ to the trackers at the end (an artifact of the run)

    @property
    def model_parallel(self) -> int:
        """The ranks that read the same micro-batches: a tensor group (tp_size) times a sequence group (sp_size)
        times a pipeline (pp_size)."""
        return self.tp_size * self.sp_size * self.pp_size


TRACKERS = ("tensorboard", "mlflow", "wandb")  # report_to's names (runlog/tracking.py)
# lengths given in steps or in epochs: one of each pair; epochs are turned into steps once the train shards'
# sample counts are known (train.py's check_run)
UNITS = (("max_steps", "epochs"), ("warmup_steps", "warmup_epochs"))
KEYS = {f.name: f for f in dataclasses.fields(Config)}
CHOICES = {"task": ("classification", "mae", "simmim", "segmentation"), "optimizer": ("adamw", "muon"), "zero_stage": (1, 2, 3), "precision": ("fp32", "bf16", "fp16", "auto"), "data_mode": ("epoch", "resampled", "synthetic"), "pp_schedule": ("1f1b", "gpipe")}


def _coerce(key: str, value, from_cli: bool):
    """Convert `value` to the declared type of `key` or raise ConfigError."""
    typ = KEYS[key].type
    typ = {"int": int, "float": float, "str": str, "bool": bool}.get(typ, typ)  # annotations may be strings
    if from_cli:
        if typ is bool:
            low = value.lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ConfigError(f"config key '{key}' expects true/false, got '{value}'")
            return low in ("true", "1", "yes")
        if typ is str:
            return value
        try:
            return typ(value)
        except ValueError:
            raise ConfigError(f"config key '{key}' expects {typ.__name__}, got '{value}'") from None
    if value is None and typ is str:
        return ""
    if key == "report_to" and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ",".join(value)  # YAML's list form of a comma-separated key
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"config key '{key}' expects {typ.__name__}, got {value!r}")
    return value


def _set(cfg: Config, key: str, value, from_cli: bool, where: str):
    if key not in KEYS:
        raise ConfigError(f"unknown config key '{key}' in {where} (known keys: {', '.join(KEYS)})")
    value = _coerce(key, value, from_cli)
    if key in CHOICES and value not in CHOICES[key]:
        raise ConfigError(f"config key '{key}' must be one of {CHOICES[key]}, got {value!r}")
    setattr(cfg, key, value)


def parse(argv=None) -> Config:
    """Defaults, then `--config FILE` (YAML), then `--key value` overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pairs, recipe = [], None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"expected --key value, got '{arg}'")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"missing value for --{key}")
            value = argv[i + 1]
            i += 1
        i += 1
        key = key.replace("-", "_")
        if key == "local_rank":  # added by the deepspeed launcher; LOCAL_RANK in the environment says the same
            continue
        if key == "config":
            recipe = value
        else:
            pairs.append((key, value))

    cfg, given = Config(), {}
    if recipe:
        try:
            with open(recipe) as f:
                loaded = yaml.safe_load(f) or {}
        except OSError as e:
            raise ConfigError(f"cannot read config file '{recipe}': {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{recipe}' is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file '{recipe}' must hold a mapping of key: value")
        for key, value in loaded.items():
            _set(cfg, key, value, from_cli=False, where=recipe)
            given[key] = recipe
    for key, value in pairs:
        _set(cfg, key, value, from_cli=True, where="the command line")
        given[key] = "the command line"
    _one_unit(cfg, given)
    _accelerate(cfg, given, os.environ)
    _check(cfg)
    return cfg


def _one_unit(cfg: Config, given: dict):
    """A length in epochs wins over the same length in steps, unless the steps come from a later source (the
    command line over the recipe: `--max_steps 2` shortens an epochs recipe); both on the command line is an
    error."""
    for steps, epochs in UNITS:
        if not getattr(cfg, epochs):
            continue
        if given.get(steps) == given.get(epochs) == "the command line":
            what = "the run's length" if steps == "max_steps" else "the warm-up"
            raise ConfigError(f"--{steps} and --{epochs} both set {what}: give one")
        if given.get(steps) == "the command line":
            setattr(cfg, epochs, 0.0)


def _accelerate(cfg: Config, given: dict, env):
    """`accelerate launch --config_file X.yaml` passes its plugin's settings as environment variables.
    `distributed_type: DEEPSPEED` (ACCELERATE_DEEPSPEED_*): they set ds_config, zero_stage, grad_accum_steps,
    grad_clip and precision. `distributed_type: FSDP` with `fsdp_version: 2` (FSDP_*): the FSDP2 engine, zero_stage
    from fsdp_reshard_after_forward, and precision. A key the recipe or the command line also gives must agree; a
    contradiction is an error naming both. mixed_precision `no` (accelerate's default) leaves `precision` to
    this config."""
    deepspeed, fsdp = env.get("ACCELERATE_USE_DEEPSPEED") == "true", env.get("ACCELERATE_USE_FSDP") == "true"
    if not (deepspeed or fsdp):
        return
    import json

    def take(key, value, what):
        if key in given and getattr(cfg, key) != value:
            raise ConfigError(f"the accelerate config sets {what} but {given[key]} says {key} "
                              f"{getattr(cfg, key)}: remove one of them")
        setattr(cfg, key, value)

    precision = env.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision in ("bf16", "fp16"):
        take("precision", precision, f"mixed_precision {precision}")
    elif precision != "no":
        raise ConfigError(f"the accelerate config's mixed_precision {precision} is not supported: use no, bf16 or fp16")
    if fsdp:
        _accelerate_fsdp(env, take)
        return
    take("engine", "deepspeed", "distributed_type DEEPSPEED")
    path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path:
        take("ds_config", path, f"deepspeed_config_file {path}")
        try:
            with open(path) as f:
                stage = json.load(f).get("zero_optimization", {}).get("stage")
        except (OSError, ValueError) as e:
            raise ConfigError(f"the accelerate config's deepspeed_config_file '{path}' cannot be read: {e}") from None
        if isinstance(stage, int):
            take("zero_stage", stage, f"ZeRO stage {stage} (in {path})")
    if "ACCELERATE_DEEPSPEED_ZERO_STAGE" in env:
        take("zero_stage", int(env["ACCELERATE_DEEPSPEED_ZERO_STAGE"]), f"zero_stage {env['ACCELERATE_DEEPSPEED_ZERO_STAGE']}")
    if "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" in env:
        steps = int(env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"])
        take("grad_accum_steps", steps, f"gradient_accumulation_steps {steps}")
    if "ACCELERATE_GRADIENT_CLIPPING" in env and env["ACCELERATE_GRADIENT_CLIPPING"] not in ("none", "auto"):
        clip = float(env["ACCELERATE_GRADIENT_CLIPPING"])
        take("grad_clip", clip, f"gradient_clipping {clip:g}")
    template = cfg.ds_config or os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_configs",
                                             f"zero{cfg.zero_stage}.json")
    for kind in ("optimizer", "param"):
        device = env.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{kind.upper()}_DEVICE", "none")
        if device == "none":
            continue
        try:
            with open(template) as f:
                theirs = json.load(f).get("zero_optimization", {}).get(f"offload_{kind}", {}).get("device", "none")
        except (OSError, ValueError):
            theirs = "none"
        if theirs != device:
            raise ConfigError(f"the accelerate config sets offload_{kind}_device {device} but the DeepSpeed config "
                              f"{template} offloads it to {theirs}: name ds_configs/zero3_offload.json as its "
                              f"deepspeed_config_file instead (accelerate_configs/zero3_offload.yaml does)")


def _accelerate_fsdp(env, take):
    """accelerate's FSDP plugin (accelerate_configs/fsdp2.yaml): FSDP2 only, its resharding as zero_stage; what
    train.py does itself (wrapping each block, checkpointing with `ac`) or does not do (offloading) is refused
    rather than ignored."""
    if env.get("FSDP_VERSION", "1") != "2":
        raise ConfigError(f"the accelerate config runs FSDP version {env.get('FSDP_VERSION', '1')}: this trainer's "
                          f"engine is FSDP2; set fsdp_version: 2 (accelerate_configs/fsdp2.yaml)")
    take("engine", "fsdp2", "distributed_type FSDP")
    reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower()
    if reshard not in ("true", "false"):
        raise ConfigError(f"the accelerate config's fsdp_reshard_after_forward is {reshard}: FSDP2 takes true or false")
    take("zero_stage", 3 if reshard == "true" else 2, f"fsdp_reshard_after_forward {reshard}")
    for var, key, why in (("FSDP_OFFLOAD_PARAMS", "fsdp_offload_params", "this FSDP2 engine does not offload"),
                          ("FSDP_ACTIVATION_CHECKPOINTING", "fsdp_activation_checkpointing",
                           "train.py checkpoints activations by the `ac` key")):
        if env.get(var, "false").lower() == "true":
            raise ConfigError(f"the accelerate config sets {key}: true, but {why}; set it false")


def _check(cfg: Config):
    positive = ("num_labels", "image_size", "tp_size", "sp_size", "pp_size", "replicate_degree", "micro_batch_size",
                "grad_accum_steps", "max_steps", "max_bad_steps", "log_every")
    for key in positive:
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"config key '{key}' must be positive, got {getattr(cfg, key)}")
    for key in ("patch_size", "num_workers", "data_streams", "warmup_steps", "eval_every", "save_every", "grad_clip",
                "weight_decay", "randaug_n", "mixup", "cutmix", "keep_last", "min_free_gb", "epochs", "warmup_epochs", "pp_microbatches"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {getattr(cfg, key)}")
    if not 0 < cfg.crop_scale_min <= 1 or not 0 <= cfg.hflip <= 1 or not 0 <= cfg.randaug_m <= 10:
        raise ConfigError("crop_scale_min must be in (0, 1], hflip in [0, 1] and randaug_m in [0, 10]")
    for key in ("dist_timeout", "preempt_grace"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"config key '{key}' must be positive, got {getattr(cfg, key)}")
    if not 0 < cfg.mask_ratio < 1 or cfg.mask_patch_size <= 0:
        raise ConfigError(f"mask_ratio must be in (0, 1) and mask_patch_size positive, got {cfg.mask_ratio} and "
                          f"{cfg.mask_patch_size}")
    if cfg.task != "classification" and cfg.tp_size > 1:
        raise ConfigError(f"task {cfg.task} with tp_size > 1: tensor parallelism splits the classifiers' blocks; "
                          f"use tp_size 1")
    if not 0 <= cfg.drop_path < 1:
        raise ConfigError(f"config key 'drop_path' must be in [0, 1), got {cfg.drop_path}")
    if not 0 < cfg.layer_decay <= 1:
        raise ConfigError(f"config key 'layer_decay' must be in (0, 1] (1 = off), got {cfg.layer_decay}")
    if not 0 <= cfg.ema_decay < 1:
        raise ConfigError(f"config key 'ema_decay' must be in [0, 1) (0 = off), got {cfg.ema_decay}")
    if cfg.optimizer == "muon" and cfg.layer_decay < 1:
        raise ConfigError("layer_decay with optimizer muon: DeepSpeed's Muon gives a parameter group's own lr to both "
                          "its Muon and AdamW halves, so muon_lr would be lost; use layer_decay 1 or optimizer adamw")
    if cfg.optimizer == "muon" and cfg.tp_size > 1:
        raise ConfigError("optimizer muon with tp_size > 1: Muon orthogonalises each weight matrix whole, and tensor "
                          "parallelism leaves a rank a slice of it; use optimizer adamw or tp_size 1")
    if cfg.ema_decay and cfg.tp_size > 1:
        raise ConfigError("ema_decay with tp_size > 1: the EMA's checkpoint files place each rank's part of the flat "
                          "weights, and tensor-parallel shards are not such parts; use ema_decay 0 or tp_size 1")
    if cfg.export_ema and not cfg.ema_decay:
        raise ConfigError("export_ema needs an EMA of the weights: set ema_decay (e.g. 0.9999)")
    if cfg.device_memory_gb < 0:
        raise ConfigError(f"config key 'device_memory_gb' must be >= 0 (0 = the whole device), got {cfg.device_memory_gb}")
    if cfg.lr <= 0:
        raise ConfigError(f"config key 'lr' must be positive, got {cfg.lr}")
    _check_report_to(cfg.report_to)
    if not cfg.output_dir:
        raise ConfigError("config key 'output_dir' must not be empty")


def _check_report_to(value: str):
    """An unknown tracker, an empty list or `none` beside another one."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in TRACKERS + ("none",)]
    if unknown:
        raise ConfigError(f"report_to: unknown tracker {unknown[0]!r} (choose from {', '.join(TRACKERS)} or none; "
                          f"several comma-separated)")
    if not names or ("none" in names and len(names) > 1):
        raise ConfigError(f"report_to {value!r}: name trackers (comma-separated) or only none")


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


# ---------------------------------------------------------------------------------------------------- the keys' docs
def key_docs() -> list[tuple[str, str, str, object, str]]:
    """(group, key, type, default, meaning) of every key in definition order: the groups are the comment lines of
    Config's body, the meanings each key's own comment. The one source of `train.py --help` and
    docs/configuration.md's key tables."""
    import inspect

    group, comments = "", {}
    for line in inspect.getsource(Config).splitlines():
        if re.fullmatch(r"    # .*", line):
            group = line.strip()[2:]
        elif m := re.match(r"    (\w+): \w+ = .*?  # (.*)$", line):
            comments[m.group(1)] = (group, m.group(2))
    fields = dataclasses.fields(Config)
    missing = [f.name for f in fields if f.name not in comments]
    if missing:
        raise RuntimeError(f"config keys without a comment: {', '.join(missing)}")
    return [(comments[f.name][0], f.name, f.type if isinstance(f.type, str) else f.type.__name__, f.default,
             comments[f.name][1]) for f in fields]


def help_text(width: int = 110) -> str:
    """train.py --help: every key by group, with its type, default and meaning."""
    lines = ["usage: train.py [--config RECIPE.yaml] [--KEY VALUE ...]", "",
             "Every key can be set in a YAML recipe (--config) and on the command line (--key value), which wins.",
             "Launch with deepspeed, torchrun or accelerate launch for several ranks (README.md).", ""]
    group = None
    for g, key, typ, default, meaning in key_docs():
        if g != group:
            lines += ["" if group else None, f"{g}:"]
            lines = [x for x in lines if x is not None]
            group = g
        shown = f'"{default}"' if typ == "str" else str(default).lower() if typ == "bool" else default
        lines.append(f"  --{key} {typ.upper()}  (default {shown})")
        lines += textwrap.wrap(meaning, width - 6, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines) + "\n"


def keys_markdown() -> str:
    """docs/configuration.md's tables of every key, one per group."""
    out, group = [], None
    for g, key, typ, default, meaning in key_docs():
        if g != group:
            out += ["", f"**{g}**", "", "| key | type | default | meaning |", "|---|---|---|---|"]
            group = g
        shown = f'`"{default}"`' if typ == "str" else f"`{str(default).lower() if typ == 'bool' else default}`"
        out.append(f"| `{key}` | {typ} | {shown} | {meaning.replace('|', '&#124;')} |")
    return "\n".join(out[1:]) + "\n"


DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "docs", "configuration.md")
KEYS_BLOCK = re.compile(r"(<!-- keys -->\n)(.*?)(<!-- /keys -->)", re.S)


def render_docs(path: str = DOCS) -> bool:
    """Rewrite docs/configuration.md's key tables from key_docs(); True when they changed."""
    text = open(path).read()
    new = KEYS_BLOCK.sub(lambda m: m.group(1) + keys_markdown() + m.group(3), text)
    if new != text:
        with open(path, "w") as f:
            f.write(new)
    return new != text


if __name__ == "__main__":  # python config.py --docs: docs/configuration.md's tables from the definitions above
    if sys.argv[1:] != ["--docs"]:
        raise SystemExit("usage: python config.py --docs")
    print("rewritten" if render_docs() else "unchanged", DOCS)

