"""A real PostgreSQL server for tests and benchmarks: Debian's binaries, a fresh
cluster in a temporary directory, listening on a loopback port, trust
authentication. As root it runs as the package's ``postgres`` user (PostgreSQL
refuses to run as root). ``scripts/test`` installs Debian's ``postgresql``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.harness.servers import free_port


def postgres_bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


class PostgresServer:
    def __init__(self, workdir: Path, fsync: bool = False):
        bin_dir = postgres_bin_dir()
        assert bin_dir is not None
        self.bin_dir = bin_dir
        self.fsync = fsync
        self.data_dir = workdir / "pgdata"
        self.socket_dir = workdir / "pgsocket"
        self.log = workdir / "postgres.log"
        self.port = free_port()
        self.database = "streamsess"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.database}"

    def _run(self, *command: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        result = subprocess.run([*prefix, *command], capture_output=True, text=True)
        assert result.returncode == 0, f"{command[0]} failed: {result.stdout}\n{result.stderr}"

    def init(self) -> None:
        for path in (self.data_dir, self.socket_dir):
            path.mkdir(parents=True)
            if os.geteuid() == 0:
                shutil.chown(path, "postgres", "postgres")
        if os.geteuid() == 0:
            self.log.touch()
            shutil.chown(self.log, "postgres", "postgres")
        self._run(
            str(self.bin_dir / "initdb"),
            "-D",
            str(self.data_dir),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
        )
        self.start()
        self._run(
            str(self.bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", self.database
        )

    def start(self) -> None:
        options = f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1"
        if not self.fsync:
            options += " -c fsync=off"  # tests only: a commit need not reach the disk
        self._run(
            str(self.bin_dir / "pg_ctl"),
            "-D",
            str(self.data_dir),
            "-l",
            str(self.log),
            "-o",
            options,
            "-w",
            "-t",
            "60",
            "start",
        )

    def stop(self, mode: str = "fast") -> None:
        """pg_ctl's shutdown modes: fast (close connections, checkpoint), immediate (an outage)."""
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", mode, "-w", "stop")

    def running(self) -> bool:
        return (self.data_dir / "postmaster.pid").exists()


@contextlib.contextmanager
def postgres_server(fsync: bool = False) -> Iterator[PostgresServer]:
    """A fresh PostgreSQL server, stopped (and its files removed) afterwards. Its
    directory is its own under /tmp: the postgres user cannot enter pytest's."""
    workdir = Path(tempfile.mkdtemp(prefix="streamsess-pg-"))
    if os.geteuid() == 0:
        shutil.chown(workdir, "postgres", "postgres")
    server = PostgresServer(workdir, fsync)
    server.init()
    try:
        yield server
    finally:
        if server.running():
            with contextlib.suppress(AssertionError):
                server.stop()
        # A server that would not stop in time: its postmaster goes with a signal.
        deadline = time.monotonic() + 10
        while server.running() and time.monotonic() < deadline:
            time.sleep(0.2)
        shutil.rmtree(workdir, ignore_errors=True)
