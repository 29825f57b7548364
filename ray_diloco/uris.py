"""Paths that may be URIs. Every path a run is given (`--config`, `--output-dir`, `--checkpoint-path`, `--data`,
`--eval-data`, `--init-from`) is a local path or an `s3://`, `gs://`, `file://` URI (and `hf://` for data), read and
written through pyarrow.fs (`data.files.resolve_filesystem`, which resolves them all alike).

S3-compatible servers (MinIO, Ceph, moto) are reached through the standard AWS environment: pyarrow's
`FileSystem.from_uri`, which `resolve_filesystem` uses, reads `AWS_ENDPOINT_URL` (and `AWS_ENDPOINT_URL_S3`) itself
since Arrow 15 (`pyarrow.fs.S3FileSystem()` built directly does not). tests/test_s3.py pins this against a real
server.

Transformers and matplotlib read and write local files only: `local_copy` downloads a directory for them to read,
and `upload` sends what they wrote.
"""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow.fs as pafs

from ray_diloco.data.files import resolve_filesystem


def is_uri(path: str) -> bool:
    return "://" in path


def join(base: str, *parts: str) -> str:
    """Join a local path or URI with '/' (never os.path: URIs keep their scheme)."""
    return "/".join([base.rstrip("/"), *parts])


def first_line(error: BaseException) -> str:
    """An error as one line (pyarrow's S3 errors may carry details on further lines)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def is_file(path: str) -> bool:
    fs, inner = resolve_filesystem(path)
    return fs.get_file_info(inner).type == pafs.FileType.File


def read_bytes(path: str) -> bytes:
    """The whole file; FileNotFoundError when there is no file there (a missing bucket included)."""
    fs, inner = resolve_filesystem(path)
    if fs.get_file_info(inner).type != pafs.FileType.File:
        raise FileNotFoundError(f"no such file {path}")
    with fs.open_input_file(inner) as handle:  # not open_input_stream: that would decompress by extension
        return handle.read()


def upload(local: Path, uri: str) -> None:
    """Copy a local file, or a directory with everything under it, to `uri` (the same name there)."""
    fs, inner = resolve_filesystem(uri)
    pafs.copy_files(str(local), inner, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


def download(uri: str, local: Path) -> None:
    """Copy the directory `uri` with everything under it to the local directory `local`."""
    fs, inner = resolve_filesystem(uri)
    pafs.copy_files(inner, str(local), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())


@contextmanager
def local_copy(directory: str) -> Iterator[str]:
    """`directory` as a local path: itself, or a temporary download of the URI, removed on exit."""
    if not is_uri(directory):
        yield directory
        return
    with tempfile.TemporaryDirectory(prefix="ray-diloco-download-") as local:
        download(directory, Path(local))
        yield local


def probe_write(uri: str) -> None:
    """Write an empty object under `uri` and delete it: raises OSError unless the bucket exists, is reachable and
    these credentials may write there (a listing would not tell the last, and a missing bucket lists as empty)."""
    fs, inner = resolve_filesystem(uri)
    probe = join(inner, f".ray-diloco-write-check-{secrets.token_hex(4)}")
    with fs.open_output_stream(probe) as stream:
        stream.write(b"")
    fs.delete_file(probe)
