"""Reading the run's secret (what `auth.py` signs and checks with), without importing hivemind: the driver checks
the file among its inputs, within a second, before anything starts."""

from __future__ import annotations

from pathlib import Path

MIN_SECRET_BYTES = 32


def read_secret(path: str, flag: str = "--secret-file") -> bytes:
    """The secret in `path` (surrounding whitespace removed), or ValueError naming the flag and the fix."""
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file, e.g. `openssl rand -hex 32 > run.secret` "
                         f"and {flag} run.secret, the same file in every region")
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot be read ({error.strerror}); create it with "
                         f"`openssl rand -hex 32 > {path}` and give every region the same file") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{flag} {path}: holds {len(secret)} bytes, at least {MIN_SECRET_BYTES} are needed; "
                         f"create it with `openssl rand -hex 32 > {path}`")
    return secret
