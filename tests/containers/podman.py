"""Podman as these machines run it (``docs/deploy.md``, "The container check"): runc with
cgroupfs, explicit rlimits under the shell's hard limits, CNI bridge networks with
the dnsname plugin (compose's service names resolve), builds on the host's network
with the machine's CA bundle and pip wheel folder passed in. Set through a
``containers.conf`` of the check's own (``CONTAINERS_CONF``), so the commands below
are the plain ones a user types and nothing under ``/etc`` changes."""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

BASE_IMAGE = "localhost/streamsess-debian:bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
NPROC_MAX = 32768


class Podman:
    def __init__(self, workdir: Path):
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        # At most the shell's hard limits (root here cannot raise them); nproc lower still:
        # runc was refused 65,536 and the hard limit (96,367) and accepted 32,768.
        self.ulimits = {"nofile": min(nofile, 1 << 20), "nproc": min(nproc, NPROC_MAX)}
        conf = workdir / "containers.conf"
        conf.write_text(
            "[containers]\n"
            f'default_ulimits = ["nofile={self.ulimits["nofile"]}:{self.ulimits["nofile"]}", '
            f'"nproc={self.ulimits["nproc"]}:{self.ulimits["nproc"]}"]\n'
            "[engine]\n"
            'runtime = "runc"\n'
            'cgroup_manager = "cgroupfs"\n'
            'events_logger = "file"\n'
        )
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}
        self.socket = workdir / "podman.sock"
        self._service: subprocess.Popen[bytes] | None = None

    def __call__(
        self, *args: str, check: bool = True, timeout: float = 600, capture: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["podman", *args], env=self.env, check=check, timeout=timeout, text=True, capture_output=capture
        )

    def ulimit_args(self) -> list[str]:
        return [f"--ulimit={name}={value}:{value}" for name, value in self.ulimits.items()]

    def image_exists(self, name: str) -> bool:
        return self("image", "exists", name, check=False).returncode == 0

    # ------------------------------------------------------------------ images
    def base_image(self) -> str:
        """A Debian bookworm image made here with debootstrap (no registry is reachable)."""
        if self.image_exists(BASE_IMAGE):
            return BASE_IMAGE
        root = self.workdir / "rootfs"
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run(
            ["debootstrap", "--variant=minbase", "bookworm", str(root), apt_mirror()],
            check=True,
            timeout=900,
            capture_output=True,
        )
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(
            ["podman", "import", "-", BASE_IMAGE],
            stdin=tar.stdout,
            env=self.env,
            check=True,
            timeout=600,
            capture_output=True,
        )
        tar.wait()
        shutil.rmtree(root, ignore_errors=True)
        return BASE_IMAGE

    def build(
        self,
        tag: str,
        dockerfile: Path,
        context: Path,
        build_args: dict[str, str] | None = None,
        log: Path | None = None,
    ) -> float:
        """``podman build``, with the host's pip settings passed in; seconds it took."""
        # Docker's image format: OCI's has no HEALTHCHECK (podman drops it, with a warning).
        args = [
            "build",
            "--format",
            "docker",
            "--network",
            "host",
            *self.ulimit_args(),
            "-f",
            str(dockerfile),
            "-t",
            tag,
        ]
        pip_args, pip_volumes = pip_build_options()
        for name, value in {**pip_args, **(build_args or {})}.items():
            args += ["--build-arg", f"{name}={value}"]
        args += pip_volumes
        args.append(str(context))
        log = log or self.workdir / f"build-{re.sub(r'[^a-z0-9]+', '-', tag)}.log"
        start = time.monotonic()
        with log.open("w") as output:  # written as it goes: a cold build takes minutes
            returncode = subprocess.run(
                ["podman", *args], env=self.env, stdout=output, stderr=subprocess.STDOUT, timeout=3600
            ).returncode
        if returncode:
            raise RuntimeError(f"podman build of {tag} failed (log: {log}):\n{log.read_text()[-4000:]}")
        return time.monotonic() - start

    # ------------------------------------------------------------------ compose
    def start_service(self) -> str:
        """podman's Docker-compatible API, for docker-compose; its DOCKER_HOST."""
        if self._service is None:
            self.socket.unlink(missing_ok=True)
            self._service = subprocess.Popen(
                ["podman", "system", "service", "--time=0", f"unix://{self.socket}"],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + 30
            while not self.socket.exists():
                if time.monotonic() > deadline or self._service.poll() is not None:
                    raise RuntimeError("podman system service did not start")
                time.sleep(0.1)
        return f"unix://{self.socket}"

    def stop_service(self) -> None:
        if self._service is not None:
            self._service.terminate()
            self._service.wait(timeout=30)
            self._service = None


# The host's pip settings, as the build sees them: a CA bundle and a wheel folder,
# each mounted read-only at a path of its own (mounting over /etc/ssl/certs breaks dpkg).
CERT_IN_BUILD = "/run/streamsess-build/ca.crt"
WHEELS_IN_BUILD = "/run/streamsess-build/wheels"


def _pip_setting(name: str) -> str | None:
    value = os.environ.get(f"PIP_{name.upper().replace('-', '_')}")
    if value:
        return value
    found = subprocess.run(["pip", "config", "get", f"global.{name}"], capture_output=True, text=True)
    return found.stdout.strip() or None if found.returncode == 0 else None


def pip_build_options() -> tuple[dict[str, str], list[str]]:
    """The build arguments and read-only mounts that hand the host's pip settings to a build."""
    cert, links = _pip_setting("cert"), _pip_setting("find-links")
    args: dict[str, str] = {}
    volumes: list[str] = []
    if cert:
        args["PIP_CERT"] = CERT_IN_BUILD
        volumes += ["-v", f"{cert}:{CERT_IN_BUILD}:ro"]
    if links:
        args["PIP_FIND_LINKS"] = WHEELS_IN_BUILD
        args["PIP_EXTRA_INDEX_URL"] = ""  # torch comes from the wheel folder, not PyTorch's index
        if Path(links).is_dir():
            volumes += ["-v", f"{links}:{WHEELS_IN_BUILD}:ro"]
    return args, volumes


def apt_mirror() -> str:
    """The Debian mirror apt uses here (deb822 sources or sources.list)."""
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        try:
            text = path.read_text()
        except OSError:
            continue
        found = re.search(r"^URIs:\s*(\S+/debian)\s*$", text, re.M) or re.search(r"^deb\s+(\S+/debian)\s", text, re.M)
        if found:
            return found.group(1)
    return DEBIAN_MIRROR


DNSNAME_PLUGIN = Path("/usr/lib/cni/dnsname")


def missing_tools(tools: Sequence[str] = ("podman", "runc", "debootstrap", "docker-compose")) -> list[str]:
    missing = [tool for tool in tools if shutil.which(tool) is None]
    return missing + ([] if DNSNAME_PLUGIN.exists() else ["CNI's dnsname plugin"])
