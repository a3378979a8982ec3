"""The engines by the `engine` key's name, and the one check of what a run asks of its engine."""
from config import Config, ConfigError
from engine.base import Engine, refusal
from engine.ddp import DDPEngine
from engine.deepspeed_zero import DeepSpeedEngine
from engine.fsdp2 import FSDP2Engine

ENGINES: dict[str, type[Engine]] = {e.name: e for e in (DeepSpeedEngine, FSDP2Engine, DDPEngine)}


def engine_class(name: str) -> type[Engine]:
    if name not in ENGINES:
        raise ConfigError(f"config key 'engine' must be one of {tuple(ENGINES)}, got {name!r}")
    return ENGINES[name]


def check_engine(cfg: Config) -> type[Engine]:
    """The run's engine; ConfigError for an unknown name or a feature it lacks (engine/base.py's FEATURES)."""
    engine = engine_class(cfg.engine)
    why = refusal(engine.name, engine.capabilities, cfg, {n: e.capabilities for n, e in ENGINES.items()})
    if why:
        raise ConfigError(why)
    return engine


def written_by(state: dict | None) -> type[Engine]:
    """The engine a checkpoint's train_state.json names (checkpoints that name none were DeepSpeed's)."""
    return engine_class((state or {}).get("engine", DeepSpeedEngine.name))

