import pytest
import yaml
from conftest import REPO
from config import Config, ConfigError, parse


def test_defaults_then_yaml_then_cli(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: swin-debug\nlr: 1\nzero_stage: 3\nmax_steps: 7\n")
    cfg = parse(["--config", str(recipe), "--zero_stage", "1", "--lr=0.5", "--local_rank=1", "--progress", "false"])
    assert cfg.model == "swin-debug"  # from the recipe
    assert cfg.max_steps == 7
    assert cfg.zero_stage == 1 and cfg.lr == 0.5  # the command line wins
    assert isinstance(cfg.lr, float)
    assert cfg.progress is False
    assert cfg.micro_batch_size == Config().micro_batch_size  # untouched default


def test_yaml_int_for_float_is_accepted_but_str_for_int_is_not(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("max_steps: '10'\n")
    with pytest.raises(ConfigError, match="'max_steps' expects int"):
        parse(["--config", str(recipe)])


@pytest.mark.parametrize("argv,message", [
    (["--nope", "1"], "unknown config key 'nope'"),
    (["--precision", "fp8"], "must be one of"),
    (["--progress", "maybe"], "expects true/false"),
    (["--micro_batch_size", "0"], "must be positive"),
    (["--lr"], "missing value for --lr"),
    (["stray"], "expected --key value"),
    (["--config", "/nonexistent.yaml"], "cannot read config file"),
])
def test_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(argv)


def test_yaml_must_be_a_mapping(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        parse(["--config", str(recipe)])


def test_accelerate_offload_must_match_the_deepspeed_config(monkeypatch):
    """An accelerate config that offloads must name a DeepSpeed JSON that offloads the same way."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    with pytest.raises(ConfigError, match="sets offload_optimizer_device cpu but the DeepSpeed config .*zero2.json "
                                          "offloads it to none: name ds_configs/zero3_offload.json"):
        parse([])
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ds_configs/zero3_offload.json")
    cfg = parse([])
    assert cfg.zero_stage == 3 and cfg.ds_config == "ds_configs/zero3_offload.json"


def test_accelerates_fsdp_plugin_selects_the_fsdp2_engine(monkeypatch):
    """accelerate_configs/fsdp2.yaml's variables (what `accelerate launch` sets from it): the FSDP2 engine, its
    resharding as zero_stage; FSDP version 1, offloading, accelerate's own checkpointing and a run config naming
    the other engine are one error each."""
    plugin = yaml.safe_load(open(f"{REPO}/accelerate_configs/fsdp2.yaml"))
    assert plugin["distributed_type"] == "FSDP" and plugin["fsdp_config"]["fsdp_version"] == 2
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "true")
    cfg = parse([])
    assert cfg.engine == "fsdp2" and cfg.zero_stage == 3
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    assert parse([]).zero_stage == 2
    with pytest.raises(ConfigError, match="sets distributed_type FSDP but the command line says engine deepspeed"):
        parse(["--engine", "deepspeed"])
    with pytest.raises(ConfigError, match="fsdp_reshard_after_forward false but the command line says zero_stage 3"):
        parse(["--zero_stage", "3"])
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    with pytest.raises(ConfigError, match="fsdp_activation_checkpointing: true, but train.py checkpoints"):
        parse([])
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "false")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match="runs FSDP version 1: this trainer's engine is FSDP2"):
        parse([])
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match="sets distributed_type DEEPSPEED but the command line says engine fsdp2"):
        parse(["--engine", "fsdp2"])


def test_help_lists_every_key_by_group_with_its_default_and_meaning():
    """train.py --help's text, and docs/configuration.md's tables, come from config.py's definitions: every key
    once, under the group comment above it, with its type, default and comment."""
    import dataclasses
    import re

    import config

    text = config.help_text()
    keys = [f.name for f in dataclasses.fields(config.Config)]
    listed = re.findall(r"^  --(\w+) (\w+)  \(default (.*)\)$", text, re.M)
    assert [k for k, _, _ in listed] == keys
    assert ("lr", "FLOAT", "0.002") in listed and ("train_shards", "STR", '"data/digits/train-{000000..000003}.tar"') \
        in listed and ("compile", "BOOL", "false") in listed
    groups = [line[:-1] for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert groups[:3] == ["task and model", "fine-tuning", "data"] and "parallelism and precision" in groups
    assert "peak learning rate (AdamW)" in text  # lr's own comment
    block = config.KEYS_BLOCK.search(open(config.DOCS).read())
    assert block and block.group(2) == config.keys_markdown(), "python config.py --docs rewrites the tables"


def test_a_sweeps_samplers_and_pruners_start_up_fit_the_study():
    """TPE models at least two thirds of a study (its random start-up a third of the trials, Optuna's 10 would make
    a 12-trial study random search), and the median pruner compares a trial with several complete ones (never the
    first trial alone); a study file sets either."""
    import sweep

    assert sweep.startup_trials(sweep.StudySpec(trials=12)) == (4, 3)
    assert sweep.startup_trials(sweep.StudySpec(trials=40)) == (13, 10)
    assert sweep.startup_trials(sweep.StudySpec(trials=2)) == (1, 3)
    assert sweep.startup_trials(sweep.StudySpec(trials=12, sampler_startup_trials=2, pruner_startup_trials=1)) == (2, 1)
    pruner = sweep.pruner_of(sweep.StudySpec(trials=12, pruner="median", pruner_warmup_steps=150), 300)
    assert (pruner._n_startup_trials, pruner._n_min_trials, pruner._n_warmup_steps) == (3, 3, 150)
    assert sweep.sampler_of(sweep.StudySpec(trials=12))._n_startup_trials == 4
