"""A real S3-compatible object store on 127.0.0.1: `rclone serve s3` over a local folder.

The tests ship to it as to any bucket (the AWS variables, an endpoint URL); they kill it, restart
it on the same port, and read its files on disk to see what landed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

from tests.sshd_server import free_port
from worker.ship import rclone_binary

ACCESS_KEY = "fleettestaccess"        # rclone serve s3 refuses keys shorter than a few characters
SECRET_KEY = "fleettestsecretkey0123"


@dataclass
class S3Store:
    root: str                         # the bucket "bucket" is root/bucket
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    address: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()      # run it so (e.g. inside a network namespace: ip netns exec NS)

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}:{self.port}"

    def env(self, credentials_file: str | None = None) -> dict[str, str]:
        """What a host's environment holds to reach it: the keys, or a credentials file of them."""
        env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1"}
        if credentials_file is None:
            return env | {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        with open(credentials_file, "w") as f:
            f.write(f"[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
        return env | {"AWS_SHARED_CREDENTIALS_FILE": credentials_file}

    def bucket_dir(self, prefix: str = "") -> str:
        return os.path.join(self.root, "bucket", prefix)

    def start(self) -> "S3Store":
        os.makedirs(self.bucket_dir(), exist_ok=True)
        self.proc = subprocess.Popen(
            [*self.prefix, rclone_binary(), "serve", "s3", "--addr", f"{self.address}:{self.port}", "--auth-key",
             f"{ACCESS_KEY},{SECRET_KEY}", "--config", os.devnull, "-q", self.root],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection((self.address, self.port), timeout=1).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"rclone serve s3 exited {self.proc.returncode}")
                time.sleep(0.1)
        raise RuntimeError("rclone serve s3 did not listen within 30 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def files(self, prefix: str) -> dict[str, int]:
        """Relative path -> size of every file under the bucket's `prefix`, as on the store's disk."""
        top = self.bucket_dir(prefix)
        out = {}
        for folder, _, names in os.walk(top):
            for n in names:
                p = os.path.join(folder, n)
                out[os.path.relpath(p, top)] = os.path.getsize(p)
        return out
