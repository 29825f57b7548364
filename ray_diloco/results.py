"""Where a run's results go: `<output-dir>/<run>/` holds `config.yaml`, `summary.json`, `model/` and `loss.png`.

`--output-dir` is a local directory, written in place, or a URI (`s3://bucket/runs`). Transformers and matplotlib
write local files only, so for a URI each result is written to a temporary local directory first and uploaded
through pyarrow.fs as soon as it is complete, then the local copy is removed: the bucket has every result the
driver finished writing, and the driver's disk keeps none of them.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_diloco import uris


@dataclass(frozen=True)
class ResultsDir:
    location: str
    """`<output-dir>/<run>`: an absolute local directory or a URI."""

    @classmethod
    def of(cls, output_dir: str, run_name: str) -> "ResultsDir":
        return cls(uris.join(output_dir, run_name) if uris.is_uri(output_dir) else str(Path(output_dir) / run_name))

    def where(self, name: str) -> str:
        return uris.join(self.location, name) if uris.is_uri(self.location) else str(Path(self.location) / name)

    def read_text(self, name: str) -> str | None:
        """The file `name`, or None if there is none."""
        try:
            return uris.read_bytes(self.where(name)).decode()
        except FileNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        return uris.is_file(self.where(name))

    def write(self, name: str, writer: Callable[[Path], Any]) -> str | None:
        """`writer(path)` writes the file or directory `name` at `path`. Returns where it is stored, or None when
        the writer wrote nothing there (loss.png without matplotlib)."""
        if not uris.is_uri(self.location):
            path = Path(self.location) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            writer(path)
            return str(path) if path.exists() else None
        with tempfile.TemporaryDirectory(prefix="ray-diloco-results-") as staging:
            path = Path(staging) / name
            writer(path)
            if not path.exists():
                return None
            uris.upload(path, self.where(name))
        return self.where(name)
