"""Screenshot of the Ray dashboard's job page during a short 2-region run: `docs/dashboard-job.png`.

    python docs/dashboard_screenshot.py [--out docs/dashboard-job.png] [--chromium /usr/bin/chromium]

Starts its own Ray head (`ray start --head`, free ports) with its dashboard, submits `jobs/train.py` (2 regions, 3 outer steps) through the
Jobs API with metadata, waits until the driver's live summary printed an outer step, and has headless
Chromium open the job's page with the token in the `ray-authentication-token` cookie, as a user's browser
would after pasting `ray get-auth-token`. Chromium is driven over the DevTools protocol on a pipe
(`--remote-debugging-pipe`: fds 3 and 4, NUL-separated JSON), so nothing beyond the standard library and
Debian's `chromium` is needed. Everything it starts it stops (the job, Chromium, the head, by process group).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

REPO = pathlib.Path(__file__).resolve().parents[1]
TOKEN_COOKIE = "ray-authentication-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DevTools:
    """The Chrome DevTools protocol over `--remote-debugging-pipe`."""

    def __init__(self, chromium: str, user_data_dir: str, width: int, height: int):
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def child_fds():  # the pipe ends become fds 3 (commands in) and 4 (answers out) in Chromium
            # Through high fds: a pipe end may already be 3 or 4, and dup2 onto itself keeps close-on-exec.
            os.dup2(to_chrome_r, 200)
            os.dup2(from_chrome_w, 201)
            os.dup2(200, 3)
            os.dup2(201, 4)

        self.process = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", f"--user-data-dir={user_data_dir}", "--remote-debugging-pipe",
             f"--window-size={width},{height}", "about:blank"],
            preexec_fn=child_fds, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next_id, self._buffer = 0, b""

    def send(self, method: str, session: str | None = None, **params) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        while True:  # answers and events arrive in order; skip events
            while b"\0" not in self._buffer:
                chunk = os.read(self._from_chrome, 1 << 20)
                if not chunk:
                    raise RuntimeError("Chromium closed the DevTools pipe")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except Exception:  # noqa: BLE001 — already gone
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def screenshot(chromium: str, url: str, token: str, out: pathlib.Path, width: int = 1500, height: int = 1600,
               settle: float = 12.0, log_filter: str = "") -> None:
    host = url.split("//", 1)[1].split("/", 1)[0].split(":")[0]
    with tempfile.TemporaryDirectory() as profile:
        tools = DevTools(chromium, profile, width, height)
        try:
            target = tools.send("Target.createTarget", url="about:blank")["targetId"]
            session = tools.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            tools.send("Network.enable", session)
            tools.send("Network.setCookie", session, name=TOKEN_COOKIE, value=token, domain=host, path="/")
            tools.send("Emulation.setDeviceMetricsOverride", session, width=width, height=height,
                       deviceScaleFactor=1, mobile=False)
            tools.send("Page.enable", session)
            tools.send("Page.navigate", session, url=url)
            time.sleep(settle)  # the dashboard is a single-page app that fetches as it renders
            if log_filter:  # type into the driver log's Keyword box, as a user would, to show those lines
                found = tools.send("Runtime.evaluate", session, returnByValue=True, expression=(
                    "(() => { const box = [...document.querySelectorAll('input')].find(i => i.placeholder === "
                    "'Keyword' || [...(i.labels || [])].some(l => l.textContent.includes('Keyword')));"
                    " if (!box) return false; box.focus(); return true; })()"))
                if found.get("result", {}).get("value"):
                    tools.send("Input.insertText", session, text=log_filter)
                    time.sleep(4)
            data = tools.send("Page.captureScreenshot", session, format="png")["data"]
            out.write_bytes(base64.b64decode(data))
        finally:
            tools.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs" / "dashboard-job.png"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--outer-steps", type=int, default=4)
    args = parser.parse_args(argv)

    # Before Ray is imported (it reads the mode once): the Jobs API client sends ~/.ray/auth_token.
    os.environ["RAY_AUTH_MODE"] = "token"
    from ray.job_submission import JobStatus, JobSubmissionClient

    # A head of its own (`ray start --head --block`) on free ports: with Ray's default agent port, another Ray
    # on this machine would keep its job agent from starting. Token auth is on, as for any 2.60 head.
    ray_cli = str(pathlib.Path(sys.executable).with_name("ray"))
    port, dashboard_port = free_port(), free_port()
    head = subprocess.Popen(
        [ray_cli, "start", "--head", "--block", "--num-cpus=6", f"--port={port}", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dashboard_port}", "--disable-usage-stats",
         *(f"--{flag}={free_port()}" for flag in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                  "runtime-env-agent-port", "metrics-export-port",
                                                  "ray-client-server-port"))],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    job_id = None
    dashboard = f"http://127.0.0.1:{dashboard_port}"
    try:
        token = subprocess.run([ray_cli, "get-auth-token"], capture_output=True, text=True, check=True).stdout.strip()
        client = None
        run = f"dashboard-demo-{uuid.uuid4().hex[:4]}"
        output = tempfile.mkdtemp(prefix="ray-diloco-screenshot-")
        submit = lambda: client.submit_job(  # noqa: E731
            entrypoint=f"{sys.executable} jobs/train.py --regions 2 --inner-steps 8 "
                       f"--outer-steps {args.outer_steps} --eval-every 1 --run-name {run} --output-dir {output}",
            runtime_env={"working_dir": str(REPO), "excludes": [".venv", ".ci-venv", ".git", "docs/*.png"],
                         "env_vars": {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}},
            metadata={"ray_diloco_run": run, "regions": "region-a,region-b", "preset": "tiny-cpu"},
            submission_id=f"diloco-{run}")
        for attempt in range(60):  # the head answers before its job agent takes jobs
            try:
                client = client or JobSubmissionClient(dashboard)
                job_id = submit()
                break
            except Exception:  # noqa: BLE001 — not up yet, or no agent yet
                if attempt == 59:
                    raise
                time.sleep(2)
        print(f"submitted {job_id}; dashboard {dashboard}", flush=True)
        deadline = time.monotonic() + 600
        while "[driver] outer 3/" not in client.get_job_logs(job_id):  # live summary lines to show
            status = client.get_job_status(job_id)
            if status in (JobStatus.FAILED, JobStatus.STOPPED) or time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} {status}:\n{client.get_job_logs(job_id)[-3000:]}")
            time.sleep(2)
        out = pathlib.Path(args.out)
        screenshot(args.chromium, f"{dashboard}/#/jobs/{job_id}", token, out, log_filter="[driver]")
        print(f"wrote {out}", flush=True)
        while client.get_job_status(job_id) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            time.sleep(2)
        print(f"job {job_id}: {client.get_job_status(job_id)}", flush=True)
        job_id = None
        return 0
    finally:
        if job_id is not None:
            try:
                JobSubmissionClient(dashboard).stop_job(job_id)
            except Exception:  # noqa: BLE001
                pass
        os.killpg(head.pid, signal.SIGTERM)  # the head and everything it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
