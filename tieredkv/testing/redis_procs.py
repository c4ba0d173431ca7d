"""Real redis-server processes on loopback ports, for the remote-tier tests and benchmarks.

One :class:`RedisServer` (no persistence: ``--save ''``, no AOF, its own directory) that can
be killed, paused and restarted, and :class:`RedisClusterProcs`, three masters joined into
one Redis Cluster. Ports come from :func:`tieredkv.tools.ports.free_port` (10000-19999,
with the cluster bus port +10000 free too); a server whose port we picked moves to another
one if something bound it first.

Nothing here is a mock: a machine without ``redis-server``/``redis-cli`` gets
:class:`RedisNotInstalledError`, which says how to install them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from tieredkv.tools.ports import free_port as free_loopback_port

SETUP_HINT = (
    "run scripts/setup_env.sh (as root it installs Debian's redis-server package), "
    "or `sudo apt-get install -y redis-server`"
)
CLUSTER_BUS_OFFSET = 10000


class RedisNotInstalledError(RuntimeError):
    """``redis-server`` or ``redis-cli`` is not on PATH."""


class PortTakenError(RuntimeError):
    """Another process bound the port between our check and redis-server's bind."""


def binaries() -> tuple[str, str]:
    """``(redis-server, redis-cli)``; raises :class:`RedisNotInstalledError` when missing."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        raise RedisNotInstalledError(f"redis-server/redis-cli are not installed: {SETUP_HINT}")
    return server, cli


def free_port() -> int:
    """A loopback port whose cluster bus port (+10000) is free too."""
    return free_loopback_port(also_free_at=CLUSTER_BUS_OFFSET)


class RedisServer:
    """One real redis-server on 127.0.0.1 (no persistence); can be killed and restarted."""

    def __init__(self, directory: Path, port: int | None = None, args: Sequence[str] = ()) -> None:
        self.binary, self.cli_binary = binaries()
        self.port = port or free_port()
        self.directory = directory
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        directory.mkdir(parents=True, exist_ok=True)
        self.log = directory / f"redis-{self.port}.log"
        self.port_is_fixed = port is not None  # restarts and cluster nodes keep their port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start and wait for PING; a server whose port we picked retries another on EADDRINUSE."""
        for _ in range(5):
            try:
                return self._start_once(timeout_s)
            except PortTakenError:
                if self.port_is_fixed:
                    raise
                self.port = free_port()
                self.log = self.directory / f"redis-{self.port}.log"
        return self._start_once(timeout_s)

    def _start_once(self, timeout_s: float) -> RedisServer:
        cmd = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(self.directory), *self.args,
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log.read_text()[-2000:]
                if "Address already in use" in log:
                    raise PortTakenError(f"port {self.port} was taken before redis-server bound it")
                raise RuntimeError(f"redis-server exited: {log}")
            if self._answers():
                return self
            time.sleep(0.01)
        raise RuntimeError(f"redis-server on port {self.port} did not answer in {timeout_s}s")

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                sock.sendall(b"*1\r\n$4\r\nPING\r\n")
                return bool(sock.recv(64))  # +PONG, or -NOAUTH with requirepass: both answer
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: the outage a crashed or OOM-killed server causes."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()

    def cli(self, *args: str, check: bool = True, timeout_s: float = 10.0) -> str:
        done = subprocess.run(
            [self.cli_binary, "-h", "127.0.0.1", "-p", str(self.port), *args],
            capture_output=True, text=True, timeout=timeout_s,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"redis-cli {args}: {done.stdout}{done.stderr}")
        return done.stdout.strip()


class RedisClusterProcs:
    """Three masters joined into one Redis Cluster (no replicas)."""

    def __init__(self, directory: Path, size: int = 3) -> None:
        self.directory = directory
        self.size = size
        self.servers = self._fresh_servers()

    def _fresh_servers(self) -> list[RedisServer]:
        servers = []
        for _ in range(self.size):
            port = free_port()
            servers.append(RedisServer(self.directory, port, [
                "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", "2000",
            ]))
        return servers

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def start(self, timeout_s: float = 30.0, attempts: int = 3) -> RedisClusterProcs:
        """Start the nodes and join them; a join that fails or hangs (a CI run once saw
        ``--cluster create`` hang on a loaded machine) is retried on fresh ports, and the
        final error carries every attempt's redis-cli output and node logs."""
        failures = []
        for attempt in range(1, attempts + 1):
            try:
                for server in self.servers:
                    server.start()
                self.servers[0].cli(
                    "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in self.servers),
                    "--cluster-replicas", "0", "--cluster-yes", timeout_s=60.0,
                )
                return self.wait_ok(timeout_s)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                output = getattr(exc, "stdout", None) or b""
                logs = "\n".join(
                    f"{s.log.name}: {s.log.read_text()[-600:] if s.log.exists() else '(none)'}"
                    for s in self.servers
                )
                failures.append(f"attempt {attempt}: {exc}\n{output!r}\n{logs}")
                self.stop()
                self.servers = self._fresh_servers()
        raise RuntimeError("the test Redis Cluster could not be created:\n" + "\n".join(failures))

    def wait_ok(self, timeout_s: float = 30.0) -> RedisClusterProcs:
        """Wait until every node reports ``cluster_state:ok``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in s.cli("cluster", "info", check=False) for s in self.servers):
                return self
            time.sleep(0.05)
        raise RuntimeError("the test Redis Cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
