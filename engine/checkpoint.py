"""Checkpoints: which one a run resumes from, whether it fits this run's ranks, and resharding it if not.

A checkpoint is DeepSpeed's directory `checkpoints/<tag>/` plus `train_state.json`, written by global rank 0
before DeepSpeed moves `latest`: the step, the world size and ZeRO stage that wrote it, and the data position
of every data stream. A checkpoint written by another number of ranks is converted once to DeepSpeed's
universal format (`python -m deepspeed.checkpoint.ds_to_universal`) into `<tag>_universal/` beside it, and
loaded with `"checkpoint": {"load_universal": true}`. The original is only read.
"""
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from config import Config, ConfigError

STATE_FILE = "train_state.json"
UNIVERSAL_SUFFIX = "_universal"


@dataclass
class Resume:
    load_dir: str  # DeepSpeed's checkpoints directory
    tag: str  # the checkpoint written by training
    state: dict | None  # train_state.json, None for a checkpoint without one
    universal: bool  # written by another world size: load `<tag>_universal`

    @property
    def path(self) -> str:
        return os.path.join(self.load_dir, self.tag)

    @property
    def load_tag(self) -> str:
        return self.tag + UNIVERSAL_SUFFIX if self.universal else self.tag

    def convert_command(self) -> str:
        return (f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {self.path} "
                f"--output_folder {self.path}{UNIVERSAL_SUFFIX} --inject_missing_state")


def find_resume(cfg: Config, world_size: int) -> Resume | None:
    """The checkpoint `cfg.resume` names, checked against this run; None for a fresh run or `latest` before the
    first checkpoint. Raises ConfigError naming what is missing or what changed."""
    ckpt_dir = os.path.join(cfg.output_dir, "checkpoints")
    if not cfg.resume:
        return None
    if cfg.resume == "latest":
        latest = os.path.join(ckpt_dir, "latest")
        if not os.path.isfile(latest):
            return None
        load_dir, tag = ckpt_dir, open(latest).read().strip()
    elif os.path.isfile(os.path.join(cfg.resume, "latest")):  # a checkpoints directory
        load_dir, tag = cfg.resume.rstrip("/"), open(os.path.join(cfg.resume, "latest")).read().strip()
    else:  # one checkpoint
        load_dir, tag = os.path.split(cfg.resume.rstrip("/"))
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(path):
        raise ConfigError(f"resume: checkpoint directory '{path}' does not exist")
    state_file = os.path.join(path, STATE_FILE)
    try:
        state = json.load(open(state_file)) if os.path.isfile(state_file) else None
    except json.JSONDecodeError as e:
        raise ConfigError(f"resume: {state_file} is not valid JSON ({e})") from None
    if state is None:  # written elsewhere: DeepSpeed checks its own files when it loads them
        return Resume(load_dir, tag, None, False)
    if state["zero_stage"] != cfg.zero_stage:
        raise ConfigError(f"resume: checkpoint {path} was written under ZeRO-{state['zero_stage']} and this run uses "
                          f"ZeRO-{cfg.zero_stage}; resume it with --zero_stage {state['zero_stage']}")
    missing = missing_files(path, state["world_size"], state["zero_stage"])
    if missing:
        raise ConfigError(f"resume: checkpoint {path} is incomplete: {len(missing)} of the files its "
                          f"{state['world_size']} ranks wrote are missing ({', '.join(missing[:4])}"
                          f"{', ...' if len(missing) > 4 else ''})")
    return Resume(load_dir, tag, state, state["world_size"] != world_size)


def missing_files(path: str, world_size: int, stage: int) -> list[str]:
    """The DeepSpeed files a checkpoint of `world_size` ranks at ZeRO `stage` holds that are not in `path`."""
    missing = []
    names = os.listdir(path)
    for r in range(world_size):
        optim = f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"  # bf16_ prefixed under bf16 with ZeRO-1/2
        if optim not in names and f"bf16_{optim}" not in names:
            missing.append(optim)
        if stage == 3 and f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" not in names:
            missing.append(f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
    if stage < 3 and "mp_rank_00_model_states.pt" not in names:
        missing.append("mp_rank_00_model_states.pt")
    return missing


def to_universal(resume: Resume, log=print):
    """Write `<tag>_universal` beside the checkpoint unless it is there already (run on one rank). The conversion
    goes to a temporary directory renamed at the end, so an interrupted one is never taken for a finished one."""
    out = resume.path + UNIVERSAL_SUFFIX
    if os.path.isdir(out):
        log(f"resume: {resume.state['world_size']} -> {_world()} ranks: loading the universal checkpoint {out}")
        return
    log(f"resume: checkpoint written by {resume.state['world_size']} ranks, this run has {_world()}: converting it "
        f"to DeepSpeed's universal format in {out} (the original is not modified; the same by hand: "
        f"{resume.convert_command()})")
    tmp = out + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           resume.path, "--output_folder", tmp, "--num_extract_workers", "1",
                           "--num_merge_workers", "1", "--inject_missing_state"], capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"resume: converting {resume.path} to the universal format failed:\n"
                          f"{(proc.stdout + proc.stderr)[-3000:]}")
    shutil.copy2(os.path.join(resume.path, STATE_FILE), tmp)
    os.rename(tmp, out)
    with open(os.path.join(resume.load_dir, "latest_universal"), "w") as f:  # ds_to_universal named the tmp dir
        f.write(os.path.basename(out))


def _world() -> str:
    return os.environ.get("WORLD_SIZE", "1")


def write_state(path: str, step: int, world_size: int, zero_stage: int, data: dict):
    with open(os.path.join(path, STATE_FILE), "w") as f:
        json.dump({"step": step, "world_size": world_size, "zero_stage": zero_stage, "data": data}, f)
