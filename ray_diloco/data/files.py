"""Finding the data files (local, s3://, gs://, hf://) and dealing them out to regions.

Files are named by strings that keep their scheme ("s3://bucket/c4/x.json.gz", or an absolute
local path) so that a region's file list can be logged, compared and re-resolved anywhere;
`filesystem_for` turns such a list back into (pyarrow filesystem, paths inside it) for reading.
"""

from __future__ import annotations

import fnmatch
import os
import random
from pathlib import Path

import pyarrow.fs as pafs

DATA_SUFFIXES = (".json.gz", ".jsonl.gz", ".json", ".jsonl")
_GLOB_CHARS = "*?["

_ASSETS = Path(__file__).resolve().parent.parent / "assets" / "c4-en-sample"


def embedded_train_dir() -> str:
    """The embedded C4 sample: 8 training shards `c4-train.0000K-of-00008.json.gz` (90 docs each)."""
    return str(_ASSETS)


def embedded_eval_path() -> str:
    """The embedded held-out shard (80 C4 documents that are in no training shard)."""
    return str(_ASSETS / "c4-validation.00000-of-00001.json.gz")


def _scheme(path: str) -> str:
    return path.split("://", 1)[0] if "://" in path else ""


def resolve_filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """A path or URI -> (pyarrow filesystem, the path inside that filesystem)."""
    scheme = _scheme(path)
    if scheme == "":
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))
    if scheme == "hf":
        # pyarrow has no Hugging Face filesystem: wrap huggingface_hub's fsspec one.
        # Paths look like hf://datasets/allenai/c4/en/c4-train.*.json.gz.
        from huggingface_hub import HfFileSystem

        return pafs.PyFileSystem(pafs.FSSpecHandler(HfFileSystem())), path[len("hf://") :]
    # s3://, gs://, file://: pyarrow's own filesystems. Credentials and region come from the
    # usual environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS): a "?query" would read as a glob.
    # A glob is not a valid object key, so only the part before it goes through from_uri.
    head = path.split("://", 1)[1]
    prefix = _before_glob(head)
    if not prefix:
        raise ValueError(f"{path!r}: put the glob after the bucket name, e.g. s3://bucket/c4/*.json.gz")
    fs, inner_prefix = pafs.FileSystem.from_uri(f"{scheme}://{prefix.rstrip('/')}")
    rest = head[len(prefix) :]
    return fs, (inner_prefix.rstrip("/") + "/" + rest) if rest else inner_prefix


def _before_glob(path: str) -> str:
    """The longest leading run of path components that has no glob character."""
    first = min((path.find(c) for c in _GLOB_CHARS if c in path), default=-1)
    return path if first < 0 else path[: path.rfind("/", 0, first) + 1]


def _with_scheme(scheme: str, inner: str) -> str:
    return inner if scheme == "" else f"{scheme}://{inner}"


def list_data_files(path: str) -> list[str]:
    """Sorted data files under `path`: a directory, a glob, or a single file; local or a URI.

    A directory yields its *.json.gz / *.jsonl.gz / *.json / *.jsonl files (not recursive). If it
    is laid out like allenai/c4 (c4-train.* next to c4-validation.*), only the c4-train.* shards
    are returned, so the held-out shards never leak into training.
    """
    scheme = _scheme(path)
    fs, inner = resolve_filesystem(path)
    if any(c in inner for c in _GLOB_CHARS):
        base = _before_glob(inner)
        nested = "/" in inner[len(base) :]  # only walk subfolders when the pattern spans them
        selector = pafs.FileSelector(base.rstrip("/") or "/", recursive=nested, allow_not_found=True)
        infos = fs.get_file_info(selector)
        found = [i.path for i in infos if i.is_file and fnmatch.fnmatchcase(i.path, inner)]
    else:
        info = fs.get_file_info(inner)
        if info.type == pafs.FileType.File:
            found = [inner]
        elif info.type == pafs.FileType.Directory:
            infos = fs.get_file_info(pafs.FileSelector(inner, recursive=False))
            found = [i.path for i in infos if i.is_file and i.path.endswith(DATA_SUFFIXES)]
            train = [p for p in found if os.path.basename(p).startswith("c4-train.")]
            found = train or found
        else:
            raise FileNotFoundError(
                f"data path {path!r} does not exist: give a directory of JSON-lines shards "
                "(e.g. c4-train.00000-of-01024.json.gz, one {\"text\": ...} object per line), "
                "a glob such as 'dir/c4-train.*.json.gz', or an s3:// gs:// hf:// URI"
            )
    if not found:
        raise FileNotFoundError(
            f"no data files match {path!r}: expected JSON-lines shards named *{', *'.join(DATA_SUFFIXES)} "
            "(gzip or plain, one {\"text\": ...} object per line, as in allenai/c4)"
        )
    return sorted(_with_scheme(scheme, p) for p in found)


def filesystem_for(files: list[str]) -> tuple[pafs.FileSystem, list[str]]:
    """(filesystem, paths inside it) to read `files` (as listed by `list_data_files`) with."""
    if not files:
        raise ValueError("no files given")
    schemes = {_scheme(f) for f in files}
    if len(schemes) != 1:
        raise ValueError(f"files mix storage schemes {sorted(schemes)}: read one store at a time")
    fs, _ = resolve_filesystem(files[0])
    if schemes == {""}:
        return fs, [os.path.abspath(f) for f in files]
    # Inside pyarrow's s3/gs/local and the hf filesystem a path is the URI minus "scheme://":
    # strip it rather than resolving each file again (for S3 that is a network call per file).
    return fs, [f.split("://", 1)[1] for f in files]


def split_files_across_regions(files: list[str], num_regions: int, seed: int) -> list[list[str]]:
    """Deal the files out to regions: disjoint, together all files, the same for the same seed.

    Shuffled (seeded) before the round-robin so that each region gets a mix of the corpus rather
    than a contiguous range of shards; sorted first so the input order does not matter.
    """
    if num_regions < 1:
        raise ValueError(f"num_regions must be >= 1, got {num_regions}")
    if len(set(files)) != len(files):
        raise ValueError("the file list has duplicates: two regions could train on the same shard")
    if len(files) < num_regions:
        raise ValueError(
            f"{len(files)} data file(s) for {num_regions} regions: each region needs at least one "
            "file of its own. Give more shards (or split the data into more files) or use fewer regions"
        )
    order = sorted(files)
    random.Random(seed).shuffle(order)
    regions: list[list[str]] = [[] for _ in range(num_regions)]
    for i, f in enumerate(order):
        regions[i % num_regions].append(f)
    return [sorted(r) for r in regions]
