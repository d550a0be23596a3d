"""Run a real S3-compatible server (moto's server mode) on loopback.

Used by the tests and the checkpoint benchmark wherever an object store is
needed: a ``python -m moto.server`` from this interpreter's environment (the
``moto[server]`` package of the ``test`` extra), on a free port of 127.0.0.1,
that answers the S3 REST API in one process, with any credentials. It counts as
started when it has bound its port and an HTTP GET on its endpoint answers.

>>> with S3Server() as srv:
...     srv.create_bucket("ckpt")
...     store = S3Store("ckpt", endpoint=srv.endpoint, access_key_id="testing",
...                     secret_access_key="testing", region="us-east-1",
...                     client_options={"allow_http": True})   # obstore.store.S3Store
>>> srv.env()   # the same settings for clients that read the AWS_* variables
{'AWS_ACCESS_KEY_ID': 'testing', ..., 'AWS_ENDPOINT_URL': 'http://127.0.0.1:40123', ...}

Objects live in the server's memory (small ones) and in unlinked temporary files
(larger than ~5 MiB); all of it goes when the server stops. The server stops with
:meth:`S3Server.stop`, at the end of a ``with`` block, when this interpreter exits,
and when this process dies (the server watches its parent process).

Moto is a test double, not a fast store: on a 2-core machine a single PUT runs at
~150-190 MB/s, a multipart upload (obstore's default above 5 MiB) at 40-90 MB/s,
and completing a 1 GiB multipart upload briefly takes ~5 GiB of the server's memory.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from phalanx.devstack.natsserver import free_port
from phalanx.lifecycle import exit_on_sigterm

ACCESS_KEY_ID = "testing"
SECRET_ACCESS_KEY = "testing"
REGION = "us-east-1"

# Run in the server process before moto: exit when the process that started it is
# gone (PR_SET_PDEATHSIG would fire when the starting *thread* exits, e.g. a pool thread).
_BOOT = """
import os, sys, threading, time
parent = int(sys.argv[1])
def _watch():
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)
threading.Thread(target=_watch, daemon=True, name="parent-watch").start()
from moto.server import main
main(sys.argv[2:])
"""


class S3ServerError(RuntimeError):
    pass


class S3Server:
    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.host = host
        self._auto_port = not port
        self.port = port or free_port(host)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Path | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """The AWS_* variables that point an S3 client (obstore, boto3, s3fs) at this server."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
            "AWS_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
        }

    def start(self, timeout_s: float = 20.0) -> S3Server:
        if self.proc is not None and self.proc.poll() is None:
            return self
        exit_on_sigterm()  # a SIGTERM of this process runs the stop() in its finally/with
        for _ in range(3):
            try:
                return self._start(timeout_s)
            except S3ServerError as e:
                if not (self._auto_port and "address already in use" in str(e).lower()):
                    raise
            self.port = free_port(self.host)
        return self._start(timeout_s)

    def _start(self, timeout_s: float) -> S3Server:
        fd, log_name = tempfile.mkstemp(prefix="phalanx-s3-", suffix=".log")
        self._log = Path(log_name)
        args = [sys.executable, "-c", _BOOT, str(os.getpid()), "-H", self.host, "-p", str(self.port)]
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout_s
        # werkzeug logs "Running on" once it has bound the port: an answer before that
        # may come from another process on the same port
        while not (self._bound() and self._answers()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self._log.read_text(errors="replace")[-2000:]
                why = "exited" if self.proc.poll() is not None else f"did not answer within {timeout_s:g} s"
                self.stop()
                raise S3ServerError(f"moto S3 server on {self.endpoint} {why}:\n{tail}")
            time.sleep(0.05)
        return self

    def _bound(self) -> bool:
        assert self._log is not None
        return b"Running on" in self._log.read_bytes()

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint + "/", timeout=1.0) as r:
                return int(r.status) < 500
        except urllib.error.HTTPError as e:
            return e.code < 500
        except OSError:
            return False

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (moto takes an unsigned ``PUT /name``); an existing one is kept."""
        if self.proc is None or self.proc.poll() is not None:
            raise S3ServerError("the S3 server is not running")
        req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT", data=b"")
        try:
            with urllib.request.urlopen(req, timeout=10.0) as r:
                r.read()
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")
            if "BucketAlreadyOwnedByYou" not in body:
                raise S3ServerError(f"could not create bucket {name!r}: HTTP {e.code}: {body}") from e

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL); its objects are gone with it."""
        atexit.unregister(self.stop)
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
        if self._log is not None:
            self._log.unlink(missing_ok=True)
            self._log = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
