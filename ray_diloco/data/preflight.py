"""Cheap checks of the data configuration, run before Ray starts.

A wrong `--data` otherwise shows up only once Ray, the worker groups and the Ray Data pipeline are up,
and then as a worker-group restart a minute into the run. Here it is one line naming the flag and the
file, in well under a second for local files. No ray, torch or transformers import: listing files and
reading the first lines of a few of them is all it does.
"""

from __future__ import annotations

from ray_diloco.config import ConfigError, DataConfig
from ray_diloco.data.files import (
    embedded_train_dir,
    filesystem_for,
    list_data_files,
    split_files_across_regions,
)
from ray_diloco.data.packing import parse_c4_lines

FIRST_RECORDS = 20
_CHUNK = 1 << 16
_MAX_BYTES = 64 << 20  # a file of one endless line must not be read whole
_LAYOUT = "give files in the allenai/c4 json.gz layout (one {\"text\": ...} per line)"  # what each error asks for


def check_data(cfg: DataConfig, num_regions: int, seed: int) -> list[list[str]]:
    """The files of each region (as `build_region_datasets` will split them); raises `ConfigError`.

    Checks that the training path lists files, that every region gets at least one, that the held-out
    path lists files too (if given), and that the first file of each region (and of the held-out set)
    has a record with a string `text` among its first `FIRST_RECORDS`. A streamed `hf_dataset` has no
    training files to check: the result is then [] (its held-out path is still checked).
    """
    shares: list[list[str]] = []
    if not cfg.hf_dataset:
        train = _list_files("--data", cfg.path or embedded_train_dir())
        try:
            shares = split_files_across_regions(train, num_regions, seed)
        except ValueError as error:
            raise ConfigError(f"--data: {error}") from error
        for share in shares:
            _check_first_records("--data", share[0])
    if cfg.eval_path:
        _check_first_records("--eval-data", _list_files("--eval-data", cfg.eval_path)[0])
    return shares


def _list_files(flag: str, path: str) -> list[str]:
    try:
        return list_data_files(path)
    except (OSError, ValueError) as error:  # missing path, no match, bad URI, no access
        raise ConfigError(f"{flag}: {error}") from error


def _check_first_records(flag: str, file: str) -> None:
    try:
        lines = first_lines(file, FIRST_RECORDS)
    except (OSError, ValueError) as error:  # e.g. not gzip data behind a .gz name
        raise ConfigError(f"{flag}: {file}: cannot read it: {error}") from error
    if not lines:  # first_lines keeps no blank line: an empty file, or one of blank lines only
        raise ConfigError(f"{flag}: {file}: the file is empty (no records): {_LAYOUT}")
    texts, skipped = parse_c4_lines(lines)
    if not texts:
        raise ConfigError(
            f"{flag}: {file}: none of its first {skipped} records has a string 'text' field ({skipped} skipped): "
            f"{_LAYOUT}")


def first_lines(file: str, count: int) -> list[str]:
    """Up to `count` non-blank lines from the start of `file` (local or a URI; .gz decompressed)."""
    fs, (path,) = filesystem_for([file])
    lines: list[bytes] = []
    pending = bytearray()  # the line read so far, not yet ended by a newline
    read = 0
    with fs.open_input_stream(path) as stream:  # decompresses by extension, as read_text does
        while len(lines) < count and read < _MAX_BYTES:
            chunk = stream.read(_CHUNK)
            if not chunk:
                lines.append(bytes(pending))  # the last line needs no newline
                break
            read += len(chunk)
            first, *rest = chunk.split(b"\n")
            pending += first
            if rest:
                lines += [bytes(pending), *rest[:-1]]
                pending = bytearray(rest[-1])
    # A line cut by _MAX_BYTES is left out: it may end mid-record or mid-character.
    kept = [line for line in lines if line.strip()][:count]
    return [line.decode("utf-8", errors="replace") for line in kept]
