"""A run's checkpoints and export mirrored in object storage (`sync_to`: s3://bucket/prefix, or any URL fsspec has a
filesystem for), for nodes whose disks do not outlive the job.

Training writes into `output_dir` as always (checkpoints/manager.py: atomic, verified). Global rank 0 then uploads
each committed checkpoint in a background thread, in the order that keeps the mirror's own protocol: every file of
`checkpoints/step<N>/`, then its `train_state.json` (which lists every file's size), then `checkpoints/latest` (an
object written whole or not at all). A remote checkpoint is complete exactly when its train_state.json is there;
`latest` names only complete ones, so a job killed mid-upload leaves the mirror at the previous checkpoint. At most
one upload is in flight: the next commit waits for it first, so the checkpoint it reads is never the one pruning
removes. After an upload, remote checkpoints the local directory no longer keeps are deleted.

`--resume latest` with `sync_to` and nothing newer in `output_dir` (a new node, an emptied disk): rank 0 downloads
the remote `latest` into `step<N>.partial/`, checks every file's size against its train_state.json and renames it;
the other ranks wait for the rename. At the end of a run the export is uploaded with its config.json last (without
it the directory does not load), then metrics.jsonl and summary.json.
"""
import json
import os
import threading
import time

from checkpoints.manager import PARTIAL_SUFFIX, complete_checkpoints, damaged
from config import ConfigError
from data.shards import describe_object_error, object_fs, object_protocol
from engine.base import STATE_FILE

RESTORE_WAIT_S = 1800  # how long a rank other than 0 waits for rank 0's download of the checkpoint to resume


class Mirror:
    def __init__(self, url: str):
        if not object_protocol(url):
            raise ConfigError(f"sync_to '{url}': not an object-storage URL (s3://bucket/prefix, gs://..., any "
                              f"protocol fsspec has a filesystem for)")
        self.url = url.rstrip("/")
        self.fs, self.root = object_fs(self.url)
        self.root = self.root.rstrip("/")
        self.thread = None
        self.failure = ""  # the last background upload's error, reported by wait()

    def _path(self, *parts) -> str:
        return "/".join([self.root, *parts])

    def check(self):
        """ConfigError, one line, unless an object can be written and removed under the prefix (the bucket
        exists, the endpoint answers, the credentials may write)."""
        probe = self._path(".write-test")
        try:
            self.fs.pipe_file(probe, b"")
            self.fs.rm_file(probe)
        except Exception as e:  # noqa: BLE001 (the SDK's own errors: no endpoint, no credentials, no bucket)
            raise ConfigError(f"sync_to '{self.url}' is not writable: {describe_object_error(e)}") from None

    # ------------------------------------------------------------------------------------------------ upload
    def start(self, ckpt_dir: str, tag: str, keep: list, log=print):
        """Upload checkpoint `tag` in the background (after the one in flight); then delete remote checkpoints
        not in `keep` (the local directory's complete ones)."""
        self.wait(log)
        self.thread = threading.Thread(target=self._upload, args=(ckpt_dir, tag, set(keep), log), daemon=True,
                                       name="sync_to upload")
        self.thread.start()

    def wait(self, log=print) -> bool:
        """Wait for the upload in flight; False, with a warning, when it failed (the local checkpoint stands)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.failure:
            log(f"warning: {self.failure}; the mirror keeps its previous checkpoint, training goes on")
            self.failure = ""
            return False
        return True

    def _upload(self, ckpt_dir: str, tag: str, keep: set, log):
        try:
            began = time.perf_counter()
            local = os.path.join(ckpt_dir, tag)
            files = sorted(os.path.relpath(os.path.join(d, f), local) for d, _, names in os.walk(local) for f in names)
            for rel in [f for f in files if f != STATE_FILE] + [STATE_FILE]:
                self.fs.put_file(os.path.join(local, rel), self._path("checkpoints", tag, *rel.split(os.sep)))
            self.fs.pipe_file(self._path("checkpoints", "latest"), tag.encode())
            size = sum(os.path.getsize(os.path.join(local, f)) for f in files)
            log(f"sync_to: {tag} uploaded to {self.url} ({size / 2**20:.1f} MiB in {time.perf_counter() - began:.1f} s)")
            for old in self.remote_tags():
                if old not in keep:
                    self.fs.rm(self._path("checkpoints", old), recursive=True)
        except Exception as e:  # noqa: BLE001 (an upload that fails leaves the mirror as it was: reported by wait)
            self.failure = f"sync_to: uploading {tag} to {self.url} failed ({describe_object_error(e)})"

    def upload_export(self, run_dir: str, names=("hf_model", "encoder"), also=("metrics.jsonl", "summary.json"),
                      log=print):
        """The export directories (config.json last: a directory without it does not load) and the run's records."""
        self.wait(log)
        try:
            for name in names:
                local = os.path.join(run_dir, name)
                if not os.path.isdir(local):
                    continue
                files = sorted(os.path.relpath(os.path.join(d, f), local) for d, _, fs in os.walk(local) for f in fs)
                for rel in sorted(files, key=lambda f: f == "config.json"):
                    self.fs.put_file(os.path.join(local, rel), self._path(name, *rel.split(os.sep)))
            for name in also:
                if os.path.isfile(os.path.join(run_dir, name)):
                    self.fs.put_file(os.path.join(run_dir, name), self._path(name))
        except Exception as e:  # noqa: BLE001
            log(f"warning: sync_to: uploading the export to {self.url} failed ({describe_object_error(e)}); it is "
                f"complete in {run_dir}")

    # ----------------------------------------------------------------------------------------------- restore
    def remote_tags(self) -> list:
        """The remote complete checkpoints (those whose train_state.json is there), oldest first."""
        try:
            entries = self.fs.ls(self._path("checkpoints"), detail=False)
        except FileNotFoundError:
            return []
        tags = [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
        tags = [t for t in tags if t.startswith("step") and t[4:].isdigit()]
        return sorted(t for t in tags if self.fs.exists(self._path("checkpoints", t, STATE_FILE)))

    def remote_latest(self) -> str | None:
        """The checkpoint the remote `latest` names, if it is complete; else the newest complete one."""
        try:
            named = self.fs.cat_file(self._path("checkpoints", "latest")).decode().strip()
        except FileNotFoundError:
            named = None
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"sync_to '{self.url}': cannot read checkpoints/latest: {describe_object_error(e)}") \
                from None
        tags = self.remote_tags()
        return named if named in tags else (tags[-1] if tags else None)

    def download(self, ckpt_dir: str, tag: str, log=print):
        """Checkpoint `tag` into `ckpt_dir/tag` by way of `tag.partial`, every file's size checked against its
        train_state.json; then the local `latest`."""
        began = time.perf_counter()
        partial = os.path.join(ckpt_dir, tag + PARTIAL_SUFFIX)
        os.makedirs(partial, exist_ok=True)
        remote = self._path("checkpoints", tag)
        try:
            self.fs.get(remote + "/", partial + "/", recursive=True)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"sync_to: downloading {self.url}/checkpoints/{tag} failed: "
                              f"{describe_object_error(e)}") from None
        with open(os.path.join(partial, STATE_FILE)) as f:
            state = json.load(f)
        if why := damaged(partial, state):
            raise ConfigError(f"sync_to: {self.url}/checkpoints/{tag} is damaged ({why}): remove it from the bucket "
                              f"to resume from the one before")
        final = os.path.join(ckpt_dir, tag)
        os.rename(partial, final)
        with open(os.path.join(ckpt_dir, "latest.tmp"), "w") as f:
            f.write(tag)
        os.replace(os.path.join(ckpt_dir, "latest.tmp"), os.path.join(ckpt_dir, "latest"))
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(final) for f in names)
        log(f"sync_to: {tag} downloaded from {self.url} ({size / 2**20:.1f} MiB in "
            f"{time.perf_counter() - began:.1f} s)")


def restore(mirror: Mirror, ckpt_dir: str, rank: int, log=print) -> str | None:
    """Before `--resume latest` looks in `ckpt_dir`: the remote latest checkpoint, when it is newer than every
    local complete one, downloaded by rank 0 while the other ranks wait for it (no process group yet: they watch for
    the rename that makes it complete). The tag fetched, or None."""
    tag = mirror.remote_latest()
    local = complete_checkpoints(ckpt_dir)
    if tag is None or (local and local[-1][0] >= int(tag[4:])):
        return None
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        mirror.download(ckpt_dir, tag, log)
        return tag
    deadline = time.monotonic() + RESTORE_WAIT_S
    while not os.path.isfile(os.path.join(ckpt_dir, tag, STATE_FILE)):
        if time.monotonic() > deadline:
            raise ConfigError(f"sync_to: rank 0 did not finish downloading {tag} into {ckpt_dir} within "
                              f"{RESTORE_WAIT_S} s")
        time.sleep(0.5)
    return tag
