import pytest
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
