"""A real S3 API server for tests: moto's server mode (`python -m moto.server`) in a subprocess on a free
127.0.0.1 port. The code under test reaches it as it would reach any S3-compatible store, through the standard
AWS environment (`AWS_ENDPOINT_URL`, credentials, region): nothing in pyarrow or boto is patched.

    server = S3Server().start()          # waits until it answers
    monkeypatch.setenv(...) for server.environment().items()
    bucket = server.new_bucket()         # "s3://<fresh name>"
    server.stop()                        # by its PID
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pyarrow.fs as pafs
from conftest import free_port

# AWS variables that would take precedence over ours or add to them (a developer's profile, a session token, the
# S3-only endpoint variable that outranks AWS_ENDPOINT_URL): removed for the test.
SHADOWING_VARIABLES = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_CONFIG_FILE",
                       "AWS_SHARED_CREDENTIALS_FILE")

START_SECONDS = 60.0


class S3Server:
    """One moto server process; buckets are made per test (`new_bucket`) so tests never see each other's keys."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        # Its request log goes to a file: a pipe nobody reads would fill up and stall the server.
        self.log = tempfile.TemporaryFile(mode="w+")
        self._names = itertools.count()

    def environment(self) -> dict[str, str]:
        """What a client (this process, a `ray-diloco train` subprocess and the Ray workers it starts) needs."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1",
                # No instance-metadata lookups (a 1 s timeout each, on machines that are not EC2).
                "AWS_EC2_METADATA_DISABLED": "true"}

    def start(self) -> "S3Server":
        self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                        stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_until_it_answers()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_until_it_answers(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"moto server exited with {self.process.returncode}: {self.log.read()[-2000:]}")
            try:
                urllib.request.urlopen(self.endpoint, timeout=2).close()
                return
            except urllib.error.HTTPError:  # an S3 error response is an answer
                return
            except OSError:  # not listening yet
                time.sleep(0.1)
        raise RuntimeError(f"moto server did not answer on {self.endpoint} within {START_SECONDS:.0f} s")

    def filesystem(self) -> pafs.S3FileSystem:
        """The tests' own client, told the endpoint explicitly: it does not depend on what is under test."""
        env = self.environment()
        return pafs.S3FileSystem(endpoint_override=self.endpoint, access_key=env["AWS_ACCESS_KEY_ID"],
                                 secret_key=env["AWS_SECRET_ACCESS_KEY"], region=env["AWS_DEFAULT_REGION"],
                                 allow_bucket_creation=True, allow_bucket_deletion=True)

    def new_bucket(self) -> str:
        name = f"test-{os.getpid()}-{next(self._names)}"
        self.filesystem().create_dir(name)
        return f"s3://{name}"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self.log.close()
