"""Shard specs and sample streams: where tar bytes come from and how raw samples come out of them.

A spec is one or more sources joined by " + ", each a directory written by data/make_shards.py (every shard its
_info.json lists for the key's split: train for train_shards, val for val_shards), a WebDataset brace pattern, a
glob, an http(s) URL, an object-storage URL (`s3://`, `gs://`, ...: any protocol fsspec has an implementation of;
a prefix holding _info.json is a directory) or a `pipe:` command, with an optional "@weight" suffix (weights are
for `resampled` mode):

    data/in1k
    data/in1k/train-{000000..001281}.tar
    s3://bucket/in1k    s3://bucket/in1k/train-{000000..001281}.tar
    http://host/laion-{000000..009999}.tar@0.7 + pipe:aws s3 cp s3://b/cc12m-{0000..2175}.tar -@0.3

Object storage is read through fsspec (s3fs for s3://), each shard streamed as it is read; credentials, region
and endpoint come from the store's own SDK settings (for S3: AWS_ACCESS_KEY_ID, AWS_PROFILE, AWS_ENDPOINT_URL, ...).

A spec whose shards are fewer than its _info.json lists for their split reads part of the data: `coverage`
says so with the counts (train.py warns, or stops with `strict_data`).
"""
import glob
import json
import os
import re
import subprocess
import tarfile
import urllib.error
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from webdataset.shardlists import expand_urls
from webdataset.tariterators import group_by_keys, tar_file_iterator


class DataError(ValueError):
    """A spec that matches nothing or a URL that cannot be opened: one line before training starts."""


@dataclass
class Source:
    urls: list  # expanded shard URLs
    weight: float  # sampling weight in resampled mode
    counts: list  # samples per shard from _info.json, or None when unknown
    class_names: list  # from _info.json, or None
    pattern: str = ""  # the spec's part this source came from
    info_path: str = ""  # the _info.json read, "" when there is none
    split: str = ""  # the _info.json split listing these shards, "" when none lists them all
    split_files: tuple = ()  # every shard that split lists
    split_samples: int = 0  # and its samples


OBJECT_URL = re.compile(r"^([a-z][a-z0-9+.-]*)://")
# S3's connection settings unless fsspec's own configuration sets them (FSSPEC_S3_CONFIG_KWARGS, ~/.config/fsspec):
# an endpoint that does not answer is a DataError in seconds, not after botocore's minute per attempt; the retries
# are the SDK's own (AWS_MAX_ATTEMPTS, AWS_RETRY_MODE) where set
S3_CONFIG = {"connect_timeout": 10, "read_timeout": 120, "retries": {"max_attempts": 3, "mode": "standard"}}


def object_protocol(url: str) -> str:
    """The fsspec protocol of an object-storage URL (s3, gs, az, ...), '' for a local path, http(s) or `pipe:`."""
    m = OBJECT_URL.match(url)
    return m.group(1) if m and m.group(1) not in ("http", "https", "file") else ""


def object_fs(url: str):
    """(fsspec filesystem, path within it) of an object-storage URL; DataError when fsspec cannot serve it."""
    import fsspec
    from fsspec.config import conf

    protocol = object_protocol(url)
    options = {}
    if protocol in ("s3", "s3a") and "config_kwargs" not in conf.get(protocol, {}):
        sdk = {"AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"} & set(os.environ)
        options = {"config_kwargs": {k: v for k, v in S3_CONFIG.items() if k != "retries" or not sdk}}
    try:
        return fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as e:
        raise DataError(f"{url}: no filesystem for {protocol}:// ({e})") from None


def describe_object_error(e: BaseException) -> str:
    """One line for an object store's failure: its kind and first line (botocore's connection and credential
    errors are not OSErrors)."""
    text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def is_remote(url: str) -> bool:
    return url.startswith(("http://", "https://", "pipe:")) or bool(object_protocol(url))


def info_path_of(first_url: str) -> str:
    return first_url.rsplit("/", 1)[0] + "/_info.json" if "/" in first_url else "_info.json"


def _fetch_info(first_url: str):
    """The `_info.json` beside a shard (local or http), or None when there is none; one that exists but does not
    parse is a DataError (a truncated copy would otherwise be ignored without a word)."""
    if first_url.startswith("pipe:"):
        return None
    path = info_path_of(first_url)
    try:
        if first_url.startswith(("http://", "https://")):
            with urllib.request.urlopen(path, timeout=30) as r:
                text = r.read()
        elif object_protocol(first_url):
            fs, key = object_fs(path)
            text = fs.cat_file(key)
        else:
            with open(path, "rb") as f:
                text = f.read()
    except FileNotFoundError:
        return None
    except (OSError, urllib.error.URLError):
        if object_protocol(first_url):  # a store that does not answer is not a missing _info.json (parse_spec)
            raise
        return None
    try:
        info = json.loads(text)
    except ValueError as e:
        raise DataError(f"{path} is not valid JSON ({e}): rewrite it with data/make_shards.py or remove it") from None
    if not isinstance(info, dict):
        raise DataError(f"{path} must hold a JSON object, as data/make_shards.py writes it")
    return info


def _check_urls(urls: list, spec: str, what: str):
    local = [u for u in urls if not is_remote(u)]
    missing = [u for u in local if not os.path.isfile(u)]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise DataError(f"{what} '{spec}': {len(missing)} of {len(urls)} shards not found ({shown})")
    empty = [u for u in local if os.path.getsize(u) == 0]
    if empty:
        raise DataError(f"{what} '{spec}': empty shard file {empty[0]}")
    http = [u for u in urls if u.startswith(("http://", "https://"))]

    def probe(url):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=30):
                return None
        except urllib.error.HTTPError as e:
            return f"{url} (HTTP {e.code} {e.reason})"
        except (urllib.error.URLError, OSError) as e:
            return f"{url} ({getattr(e, 'reason', e)})"

    with ThreadPoolExecutor(16) as pool:
        failed = [f for f in pool.map(probe, http) if f]
    if failed:
        raise DataError(f"{what} '{spec}': cannot open {len(failed)} of {len(http)} URLs, e.g. {failed[0]}")
    objects = [u for u in urls if object_protocol(u)]
    if objects:
        _check_objects(objects, spec, what)
    pipes = [u for u in urls if u.startswith("pipe:")]
    if pipes and (why := _probe_pipe(pipes[0])):  # the first shard's command: one run, not one per shard
        raise DataError(f"{what} '{spec}': {why}")


def _check_objects(urls: list, spec: str, what: str):
    """Every object exists and is not empty: one listing per prefix, not a request per shard."""
    sizes = {}
    for prefix in dict.fromkeys(u.rsplit("/", 1)[0] for u in urls):
        fs, path = object_fs(prefix)
        try:
            listing = fs.ls(path, detail=True)
        except FileNotFoundError as e:
            raise DataError(f"{what} '{spec}': {prefix} does not exist ({describe_object_error(e)})") from None
        except Exception as e:  # noqa: BLE001 (an unreachable endpoint, missing credentials: the SDK's own errors)
            raise DataError(f"{what} '{spec}': cannot list {prefix}: {describe_object_error(e)}") from None
        protocol = object_protocol(prefix)
        sizes.update({f"{protocol}://{entry['name']}": entry.get("size") for entry in listing})
    missing = [u for u in urls if u not in sizes]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise DataError(f"{what} '{spec}': {len(missing)} of {len(urls)} shards not found ({shown})")
    empty = [u for u in urls if sizes[u] == 0]
    if empty:
        raise DataError(f"{what} '{spec}': empty shard object {empty[0]}")


def split_of(what: str) -> str:
    """The _info.json split a key's directory means: train for train_shards, val for anything else."""
    return "train" if what.startswith("train") else "val"


def _directory_urls(directory: str, what: str) -> list[str]:
    """Every shard a directory's _info.json lists for the key's split."""
    directory = directory.rstrip("/")
    info = _fetch_info(directory + "/")
    if info is None:
        raise DataError(f"{what} '{directory}' is a directory without an _info.json: write the shards with "
                        f"data/make_shards.py, or give a shard spec such as {directory}/train-{{000000..000099}}.tar")
    splits = info.get("splits", {})
    split = split_of(what)
    name = split if split in splits else "validation" if split == "val" and "validation" in splits else None
    if name is None:
        raise DataError(f"{what} '{directory}': its _info.json lists the splits {', '.join(splits) or 'none'}, not "
                        f"{split}; name the shards with a spec instead")
    return [f"{directory}/{f}" for f in splits[name].get("filenames", [])]


def _expand(pattern: str, what: str) -> list[str]:
    """A source's shard URLs: a directory's split, a glob's matches (sorted) or a brace pattern's expansion."""
    if os.path.isdir(pattern) or (pattern.startswith(("http://", "https://")) and pattern.endswith("/")):
        return _directory_urls(pattern, what)
    if object_protocol(pattern) and "{" not in pattern:
        fs, path = object_fs(pattern)
        if any(c in pattern for c in "*?["):  # a glob over the store's listing, sorted
            return sorted(f"{object_protocol(pattern)}://{p}" for p in fs.glob(path))
        if not pattern.endswith(".tar"):  # a prefix: its _info.json's split
            try:
                fs.ls(path)
            except FileNotFoundError as e:
                raise DataError(f"{what} '{pattern}': nothing there ({describe_object_error(e)})") from None
            return _directory_urls(pattern, what)
    if not is_remote(pattern) and any(c in pattern for c in "*?[") and "{" not in pattern:
        return sorted(glob.glob(pattern))
    return expand_urls(pattern)


def parse_spec(spec: str, what: str) -> list[Source]:
    """Sources of a spec; local files must exist and be non-empty, http URLs must answer."""
    if not spec or not spec.strip():
        raise DataError(f"{what} is empty: give a shard directory (data/digits) or a WebDataset shard spec such as "
                        f"data/digits/train-{{000000..000003}}.tar")
    sources = []
    for part in spec.split(" + "):
        part = part.strip()
        match = re.fullmatch(r"(.*)@(\d+(?:\.\d*)?)", part)
        pattern, weight = (match.group(1), float(match.group(2))) if match else (part, 1.0)
        try:
            urls = _expand(pattern, what)
            if not urls:
                raise DataError(f"{what} '{pattern}' expands to no shards")
            _check_urls(urls, pattern, what)
            info = _fetch_info(urls[0]) or {}
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 (an object store's SDK errors: no endpoint, no credentials, no bucket)
            if not object_protocol(pattern):
                raise
            raise DataError(f"{what} '{pattern}': {describe_object_error(e)}") from None
        lengths, split, files, samples = {}, "", (), 0
        names = {os.path.basename(u) for u in urls}
        for name, s in info.get("splits", {}).items():
            listed = s.get("filenames", [])
            lengths.update(zip(listed, s.get("shard_lengths", [])))
            if not split and names <= set(listed):
                split, files, samples = name, tuple(listed), sum(s.get("shard_lengths", []))
        counts = [lengths.get(os.path.basename(u)) for u in urls]
        sources.append(Source(urls, weight, None if None in counts else counts, info.get("class_names"), pattern,
                              info_path_of(urls[0]) if info else "", split, files, samples))
    return sources


def coverage(sources: list[Source], what: str) -> list[str]:
    """What a spec leaves out, one line each: for each split an _info.json lists, the shards (and samples) the
    spec's sources read of it when that is fewer than all; shards an _info.json beside them does not list; sources
    whose _info.json name other classes. [] when the spec reads whole splits."""
    notes, read = [], {}
    for src in sources:
        if src.info_path and not src.split:
            notes.append(f"{what} '{src.pattern}': {src.info_path} lists no split holding all {len(src.urls)} of its "
                         f"shards (another dataset's _info.json?)")
        elif src.split:
            names, samples, _ = read.setdefault((src.info_path, src.split), (set(), [0], src))
            names.update(os.path.basename(u) for u in src.urls)
            samples[0] += sum(src.counts or [])
    for (path, split), (names, samples, src) in read.items():
        if len(names) < len(src.split_files):
            share = f", {samples[0]:,} of its {src.split_samples:,} samples" if src.split_samples else ""
            notes.append(f"{what} covers {len(names)} of the {len(src.split_files)} shards {path} lists for split "
                         f"{split}{share}: the rest is never read; give the directory ({what}: "
                         f"{os.path.dirname(path) or '.'}) to read them all")
    classes = {tuple(s.class_names) for s in sources if s.class_names}
    if len(classes) > 1:
        notes.append(f"{what}: its sources' _info.json name different classes ({len(classes)} lists), so their "
                     f"labels do not mean the same classes")
    return notes


class _PipeStream:
    """The stdout of a `pipe:` source's command; `close()` waits for the command and keeps its exit status and the
    end of its stderr, so that a command that failed is named as such."""

    def __init__(self, command: str):
        self.command = command
        self.proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.stderr = b""

    def read(self, *args):
        return self.proc.stdout.read(*args)

    def close(self) -> int:
        self.proc.stdout.close()
        self.stderr = self.proc.stderr.read()[-2000:]
        self.proc.stderr.close()
        return self.proc.wait()

    def failure(self) -> str:
        """'' if the command exited 0, else what it exited with and its last line of stderr."""
        rc = self.proc.returncode
        if rc in (0, None):
            return ""
        last = self.stderr.decode(errors="replace").strip().splitlines()
        return (f"command '{self.command}' exited with status {rc}" if rc > 0 else
                f"command '{self.command}' was killed by signal {-rc}") + (f" ({last[-1][:200]})" if last else "")


OBJECT_BLOCK_BYTES = 8 * 2**20  # an object-storage shard is read in ranged requests of this size
PIPE_PROBE_BYTES = 512  # a tar header: the first member of a shard the command really streams


def _probe_pipe(url: str) -> str:
    """'' if a `pipe:` command starts streaming (its first tar header), else why not: its exit status and stderr."""
    stream = _PipeStream(url[5:])
    try:
        head = stream.read(PIPE_PROBE_BYTES)
    finally:
        stream.proc.kill() if stream.proc.poll() is None else None
        stream.close()
    if len(head) == PIPE_PROBE_BYTES:
        return ""
    return stream.failure() or f"command '{url[5:]}' wrote {len(head)} bytes, not a tar shard"


def open_shard(url: str):
    """A readable byte stream for a local path, an http(s) URL, an object-storage URL (read ahead as it streams,
    never downloaded whole first) or a `pipe:` command."""
    if url.startswith(("http://", "https://")):
        return urllib.request.urlopen(url, timeout=60)
    if object_protocol(url):
        fs, path = object_fs(url)
        try:
            return fs.open(path, "rb", block_size=OBJECT_BLOCK_BYTES, cache_type="readahead")
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 (the SDK's connection and credential errors)
            raise OSError(describe_object_error(e)) from None
    if url.startswith("pipe:"):
        return _PipeStream(url[5:])
    return open(url, "rb")


def iter_samples(url: str, errors: list, skip: int = 0):
    """Raw samples ({"__key__", ext: bytes, ...}) of one shard, after the first `skip`.

    A shard that cannot be opened, is truncated or corrupt partway, or whose `pipe:` command fails, ends early: the
    problem is appended to `errors` and the samples read so far stand.
    """
    try:
        stream = open_shard(url)
    except (OSError, urllib.error.URLError) as e:
        errors.append(f"cannot open {url}: {e}")
        return
    corrupt, ended = None, False
    try:
        members = ({**m, "__url__": url} for m in tar_file_iterator(stream))
        for i, sample in enumerate(group_by_keys(members)):
            if i >= skip:
                yield sample
        ended = True
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        corrupt, ended = f"{url} is truncated or corrupt: {e}", True
    finally:
        failed = ""
        if isinstance(stream, _PipeStream) and not ended:
            stream.proc.kill()  # left early (a seek, or the end of an epoch): not a failure
            stream.close()
        elif isinstance(stream, _PipeStream):
            stream.close()
            failed = stream.failure()  # the command's own failure says more than the cut-off tar it left
        else:
            stream.close()
        if failed or corrupt:
            errors.append(f"{url}: {failed}" if failed else corrupt)


def count_samples(url: str) -> int:
    """Samples in a shard, by reading it (for sources without `_info.json`)."""
    errors = []
    count = sum(1 for _ in iter_samples(url, errors))
    for e in errors:  # the first read of a shard without _info.json: its problems show here first
        warnings.warn(f"skipped data: {e}")
    return count
