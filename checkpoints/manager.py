"""Checkpoints: saving them atomically, keeping a few, finding the one to resume, resharding it if needed.

A checkpoint is the engine's directory `checkpoints/step<N>/` (its layout is the engine's checkpoint format:
engine/zero_checkpoint.py, engine/dcp_checkpoint.py) plus `train_state.json`: the step, the engine, world size and
ZeRO stage that wrote it, its validation score if the step was evaluated, the data position of every data stream
and every file's size. Every rank writes into `step<N>.partial/`; once the engine's closing barrier says all files
are complete, global rank 0 adds `train_state.json`, renames the directory to `step<N>` and moves `latest`. So a
checkpoint is complete exactly when `step<N>/` exists, a crash at any moment leaves at worst a `.partial`
directory (removed at the next start), and a resumed run takes the newest complete one. A checkpoint written by
another number of ranks is converted first where the engine's format needs it (DeepSpeed's universal format).
"""
import json
import os
import re
import shutil
from dataclasses import dataclass

from config import Config, ConfigError
from engine.base import STATE_FILE, CheckpointFormat
from engine.registry import engine_class, written_by
from loop.distributed import is_comm_error

PARTIAL_SUFFIX = ".partial"
STEP_TAG = re.compile(r"^step(\d+)$")


@dataclass
class Resume:
    load_dir: str  # the checkpoints directory
    tag: str  # the checkpoint written by training
    state: dict | None  # train_state.json, None for a checkpoint without one
    reshard: bool  # written by another world size, and the engine's format converts it first (`convert`)
    note: str = ""  # a warning for the user: `latest` named a checkpoint that is not there
    format: CheckpointFormat | None = None  # the engine's

    @property
    def path(self) -> str:
        return os.path.join(self.load_dir, self.tag)

    @property
    def load_tag(self) -> str:
        return self.format.load_tag(self.tag, self.reshard) if self.format else self.tag

    def convert(self, world_size: int, log=print):
        """The engine's conversion for another number of ranks (run on one rank)."""
        self.format.convert(self.path, self.state, world_size, log)


def find_resume(cfg: Config, world_size: int) -> Resume | None:
    """The checkpoint `cfg.resume` names, checked against this run; None for a fresh run or `latest` before the
    first checkpoint. Raises ConfigError naming what is missing or what changed."""
    ckpt_dir = os.path.join(cfg.output_dir, "checkpoints")
    if not cfg.resume:
        return None
    skipped = []  # newer checkpoints whose files are not what was written
    if cfg.resume == "latest":
        tag, skipped = newest_verified(ckpt_dir)
        if tag is None:
            return None
        load_dir = ckpt_dir
    elif os.path.isfile(os.path.join(cfg.resume, "latest")):  # a checkpoints directory
        load_dir = cfg.resume.rstrip("/")
        tag, skipped = newest_verified(load_dir)
    else:  # one checkpoint
        load_dir, tag = os.path.split(cfg.resume.rstrip("/"))
    note = "".join(f"warning: checkpoint {os.path.join(load_dir, t)} is damaged ({why}): not resumed from\n"
                   for t, why in skipped)
    if skipped and tag is None:
        raise ConfigError(f"resume: every complete checkpoint in {load_dir} is damaged; the newest: "
                          f"{skipped[0][0]} ({skipped[0][1]})")
    if cfg.resume == "latest" or load_dir == cfg.resume.rstrip("/"):
        named = latest_tag(load_dir)
        if named and named != tag and not os.path.isfile(os.path.join(load_dir, named, STATE_FILE)):
            note += (f"warning: {os.path.join(load_dir, 'latest')} names {named}, which is " +
                    ("incomplete" if os.path.isdir(os.path.join(load_dir, named)) else "not there") +
                    f": resuming from {tag}, the newest complete checkpoint")
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(path):
        raise ConfigError(f"resume: checkpoint directory '{path}' does not exist")
    state_file = os.path.join(path, STATE_FILE)
    try:
        state = json.load(open(state_file)) if os.path.isfile(state_file) else None
    except json.JSONDecodeError as e:
        raise ConfigError(f"resume: {state_file} is not valid JSON ({e})") from None
    fmt = engine_class(cfg.engine).checkpoint_format
    if state is None:  # written elsewhere: the engine checks its own files when it loads them
        return Resume(load_dir, tag, None, False, note.rstrip("\n"), fmt)
    if why := damaged(path, state):
        raise ConfigError(f"resume: checkpoint {path} is damaged ({why}); resume another one, or --resume latest "
                          f"to take the newest whose files are whole")
    note = note.rstrip("\n")
    writer = written_by(state).name
    if writer != cfg.engine:
        raise ConfigError(f"resume: checkpoint {path} was written by engine {writer} and this run uses "
                          f"{cfg.engine}; resume it with --engine {writer} (export.py turns any of them into a "
                          f"Hugging Face model, which `model:` then loads under any engine)")
    return Resume(load_dir, tag, state, fmt.check(path, state, cfg, world_size), note, fmt)


_SIZE_MISMATCH = re.compile(r"size mismatch for ([\w.]+): copying a param with shape torch\.Size\(\[([\d, ]*)\]\) "
                            r"from checkpoint, the shape in current model is torch\.Size\(\[([\d, ]*)\]\)")
_KEYS = re.compile(r'(Missing|Unexpected) key\(s\) in state_dict: ((?:"[^"]+"(?:, )?)+)')


def describe_load_error(e: BaseException, path: str) -> str | None:
    """One line for a checkpoint of another model (torch's strict load lists every mismatch): the first
    mismatched parameter with both shapes, or the first missing or unexpected one; None for any other error."""
    text = str(e)
    if sizes := _SIZE_MISMATCH.findall(text):
        name, theirs, ours = sizes[0]
        count, first = len(sizes), f"{name} is [{theirs}] there and [{ours}] here"
    elif keys := _KEYS.search(text):
        names = re.findall(r'"([^"]+)"', keys.group(2))
        count, first = len(names), f"{names[0]} is {'missing from' if keys.group(1) == 'Missing' else 'unexpected in'} it"
    else:
        return None
    return (f"resume: {path} is a checkpoint of another model ({differ_count(count)}; first: {first}): resume "
            f"a checkpoint of this model, or start this one in another output_dir")


def differ_count(n: int) -> str:
    return f"{n} parameter differs" if n == 1 else f"{n} parameters differ"


def check_same_model(state: dict | None, path: str, shapes: dict):
    """ConfigError when the checkpoint at `path` was written by another model: its train_state.json's parameter
    shapes (`param_shapes`, {name: [dims]}) against this run's `shapes`, first difference named. Checkpoints
    written before the shapes were recorded are checked by DeepSpeed's load instead (`describe_load_error`)."""
    saved = (state or {}).get("param_shapes")
    if saved is None:
        return
    differ = [n for n in dict.fromkeys([*saved, *shapes]) if saved.get(n) != shapes.get(n)]
    if not differ:
        return
    name = differ[0]
    first = (f"{name} is {saved[name]} there and {shapes[name]} here" if name in saved and name in shapes else
             f"{name} is {'only there' if name in saved else 'only here'}")
    raise ConfigError(f"resume: {path} is a checkpoint of another model ({differ_count(len(differ))}; first: "
                      f"{first}): resume a checkpoint of this model, or start this one in another output_dir")


def damaged(path: str, state: dict) -> str | None:
    """Why the files of checkpoint `path` are not those written (a file missing, or of another size than
    train_state.json recorded at the save: a truncated copy, a failed transfer), or None. Checkpoints written
    before the sizes were recorded are not checked."""
    for name, size in (state.get("files") or {}).items():
        found = os.path.join(path, name)
        if not os.path.isfile(found):
            return f"{name} is missing"
        if os.path.getsize(found) != size:
            return f"{name} is {os.path.getsize(found):,} bytes, {size:,} when written"
    return None


def newest_verified(ckpt_dir: str) -> tuple[str | None, list]:
    """(the newest complete checkpoint whose files are those written, [(newer damaged tag, why)]); DeepSpeed's
    `latest` for a directory this trainer did not write."""
    skipped = []
    for _, tag in reversed(complete_checkpoints(ckpt_dir)):
        try:
            state = json.load(open(os.path.join(ckpt_dir, tag, STATE_FILE)))
        except (OSError, json.JSONDecodeError) as e:
            skipped.append((tag, f"{STATE_FILE}: {e}"))
            continue
        if why := damaged(os.path.join(ckpt_dir, tag), state):
            skipped.append((tag, why))
            continue
        return tag, skipped
    return (None if skipped else latest_tag(ckpt_dir)), skipped


def complete_checkpoints(ckpt_dir: str) -> list[tuple[int, str]]:
    """(step, tag) of every complete checkpoint in `ckpt_dir`, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    found = ((STEP_TAG.match(name), name) for name in os.listdir(ckpt_dir))
    return sorted((int(m.group(1)), name) for m, name in found
                  if m and os.path.isfile(os.path.join(ckpt_dir, name, STATE_FILE)))


def latest_tag(ckpt_dir: str) -> str | None:
    """The tag DeepSpeed's `latest` file names, or None."""
    latest = os.path.join(ckpt_dir, "latest")
    return open(latest).read().strip() if os.path.isfile(latest) else None


def remove_interrupted(ckpt_dir: str, log=print):
    """Delete what an interrupted save or conversion left (`*.partial`); run by global rank 0 at the start."""
    if not os.path.isdir(ckpt_dir):
        return
    for name in sorted(os.listdir(ckpt_dir)):
        if name.endswith(PARTIAL_SUFFIX):
            shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)
            log(f"checkpoint: removed {name}, left by an interrupted save")


def checkpoint_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024


def space_verdict(ckpt_dir: str, estimate_bytes: int, min_free_gb: float) -> str | None:
    """Why the next checkpoint must not be written (the disk cannot hold it), or None. The need is the newest
    checkpoint's size, or `estimate_bytes` before the first."""
    complete = complete_checkpoints(ckpt_dir)
    need = checkpoint_bytes(os.path.join(ckpt_dir, complete[-1][1])) if complete else estimate_bytes
    free = shutil.disk_usage(ckpt_dir).free
    keep = min_free_gb * 2**30
    if free - need >= keep:
        return None
    return (f"it needs about {size(need)} and {ckpt_dir} has {size(free)} free"
            + (f", of which {min_free_gb:g} GiB are kept free (min_free_gb)" if keep else ""))


def save(engine, ckpt_dir: str, step: int, state: dict, *, keep_last: int, keep_best: bool, min_free_gb: float,
         estimate_bytes: int, log=print, also=None, wait: bool = True, mirror=None) -> bool:
    """Write checkpoint `step<step>` atomically (see the module's docstring) on every rank; False, with a line
    saying why, when the disk cannot hold it (checked before writing) or a rank's write fails: training goes on.
    `state`: train_state.json's contents. `also(directory)`: what each rank adds to the checkpoint (the EMA).

    An engine that writes in the background (FSDP2 with `async_save`) and `wait` False: the weights are copied
    to host memory and written by a thread while training goes on; the checkpoint is committed (the same
    checks, train_state.json, the rename, `latest`, pruning) by `commit_pending`, which the next save calls
    first, so at most one write is in flight. True then means started. `mirror` (checkpoints/sync.py): where
    rank 0 uploads the checkpoint once it is committed."""
    import torch.distributed as dist

    commit_pending(engine, log)
    rank = dist.get_rank()
    tag = f"step{step:07d}"
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    verdict = [space_verdict(ckpt_dir, estimate_bytes, min_free_gb) if rank == 0 else None]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        log(f"warning: checkpoint {tag} not written: {verdict[0]}; training goes on")
        return False
    partial = os.path.join(ckpt_dir, tag + PARTIAL_SUFFIX)
    # the engine's save ends in a barrier: when it returns on rank 0, every rank's files are complete. A rank whose
    # write fails (a full disk, a lost mount) joins the collectives that follow the writes itself.
    failure = ""
    background = not wait and engine.async_save
    try:
        if background:
            engine.start_checkpoint(ckpt_dir, tag=tag + PARTIAL_SUFFIX, client_state={"step": step})
        else:
            engine.save_checkpoint(ckpt_dir, tag=tag + PARTIAL_SUFFIX, client_state={"step": step})
    except (OSError, RuntimeError) as e:
        if is_comm_error(e):
            raise
        failure = write_failure(e, ckpt_dir)
        engine.close_failed_save(background)  # what the other ranks' writes still wait for
    if also and not failure:  # the gather of every rank's outcome below waits for these files too
        try:
            also(partial)
        except OSError as e:
            failure = write_failure(e, ckpt_dir)
    done = (ckpt_dir, tag, state, keep_last, keep_best, type(engine).checkpoint_format, mirror)
    if background:
        engine.pending = (*done, failure)
        return True
    return commit(*done, failure, log)


def commit_pending(engine, log=print) -> bool | None:
    """Wait for the checkpoint an engine is writing in the background and commit it (every rank calls it); its
    outcome, or None when none is in flight."""
    pending = engine.pending
    if pending is None:
        return None
    engine.pending = None
    *done, failure = pending
    if not failure:
        try:
            engine.wait_checkpoint()
        except OSError as e:
            failure = write_failure(e, done[0])
    return commit(*done, failure, log)


def commit(ckpt_dir: str, tag: str, state: dict, keep_last: int, keep_best: bool, fmt: CheckpointFormat, mirror,
           failure: str, log=print) -> bool:
    """Every rank's outcome gathered; when all wrote their files, rank 0 commits the checkpoint (finish), prunes
    the old ones and starts its upload to `mirror`, else the partial files are removed and training goes on."""
    import torch.distributed as dist

    rank = dist.get_rank()
    partial = os.path.join(ckpt_dir, tag + PARTIAL_SUFFIX)
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    failed = [f"rank {r}: {f}" for r, f in enumerate(failures) if f]
    if rank == 0 and not failed:
        try:
            finish(ckpt_dir, tag, state)
        except OSError as e:
            failed = [f"rank 0: {write_failure(e, ckpt_dir)}"]
    failed = [failed]
    dist.broadcast_object_list(failed, src=0)
    if failed[0]:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            log(f"warning: checkpoint {tag} not written ({'; '.join(failed[0])}); its partial files are removed, "
                f"the newest complete checkpoint stays the one to resume, training goes on")
        return False
    if rank == 0:
        prune(ckpt_dir, keep_last, keep_best, log, fmt)
        if mirror is not None:
            mirror.start(ckpt_dir, tag, [t for _, t in complete_checkpoints(ckpt_dir)], log)
    dist.barrier()
    return True


def finish(ckpt_dir: str, tag: str, state: dict):
    """Rank 0, once every rank's files are complete: train_state.json, the rename that makes the checkpoint
    visible, and `latest`."""
    partial = os.path.join(ckpt_dir, tag + PARTIAL_SUFFIX)
    # every file's size, checked before a resume loads them (damaged)
    files = {os.path.relpath(os.path.join(d, f), partial): os.path.getsize(os.path.join(d, f))
             for d, _, names in os.walk(partial) for f in names}
    with open(os.path.join(partial, STATE_FILE), "w") as f:
        json.dump({**state, "files": files}, f)
    final = os.path.join(ckpt_dir, tag)
    if os.path.isdir(final):  # written before by a run that was resumed from an earlier checkpoint
        shutil.rmtree(final)
    os.rename(partial, final)
    with open(os.path.join(ckpt_dir, "latest.tmp"), "w") as f:  # DeepSpeed's pointer, for its own tools
        f.write(tag)
    os.replace(os.path.join(ckpt_dir, "latest.tmp"), os.path.join(ckpt_dir, "latest"))


def write_failure(e: Exception, ckpt_dir: str) -> str:
    """One line for a failed checkpoint write. torch.save reports a full disk as a RuntimeError from its zip
    writer, without the errno, so the free space is given as well."""
    what = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0][:200]
    try:
        free = f"{size(shutil.disk_usage(ckpt_dir).free)} free"
    except OSError:
        free = "free space unknown"
    return f"{what} ({free} on {ckpt_dir})"


def prune(ckpt_dir: str, keep_last: int, keep_best: bool, log=print, fmt: CheckpointFormat | None = None):
    """Delete complete checkpoints beyond the newest `keep_last` (0: keep all), sparing the best by its evaluation's
    score (train_state.json's val_score: val top-1, or minus the val loss; val_top1 in older checkpoints)."""
    complete = complete_checkpoints(ckpt_dir)
    if not keep_last or len(complete) <= keep_last:
        return
    keep = {tag for _, tag in complete[-keep_last:]}
    if keep_best:
        states = [(json.load(open(os.path.join(ckpt_dir, tag, STATE_FILE))), tag) for _, tag in complete]
        scored = [(state.get("val_score", state.get("val_top1")), tag) for state, tag in states]
        scored = [(score, tag) for score, tag in scored if score is not None]
        if scored:
            keep.add(max(scored)[1])
    for _, tag in complete:
        if tag not in keep:
            shutil.rmtree(os.path.join(ckpt_dir, tag), ignore_errors=True)
            if fmt:
                fmt.remove_derived(os.path.join(ckpt_dir, tag))
            log(f"checkpoint: removed {tag} (keep_last {keep_last}{', keep_best' if keep_best else ''})")
