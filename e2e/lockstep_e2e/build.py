"""Build the local control plane's binaries through the Go module proxy.

kube-apiserver, kube-controller-manager, kube-scheduler (k8s.io/kubernetes) and
etcd (go.etcd.io/etcd/server/v3) come from one generated build module; kwok
from its own module. The binaries are cached by version under
``$LOCKSTEP_CACHE`` (default ``~/.cache/lockstep``) and never written into the
repository. A warm cache makes this a no-op.

Run as ``python -m lockstep_e2e.build``; prints where the binaries are.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

KUBERNETES_VERSION = "v1.37.2"
ETCD_VERSION = "v3.7.3"
KWOK_VERSION = "v0.8.0"
HELM_VERSION = "v4.3.2"
KUEUE_VERSION = "v0.17.0"
OTELCOL_VERSION = "v0.165.0"
"""The OpenTelemetry Collector's release (its modules at v0.165.0 go with pdata v1.71.0)."""
LWS_VERSION = "v0.9.0"
"""The newest LeaderWorkerSet the Go module proxy serves here (v0.10.0 is refused, 403); built on k8s.io v0.36
(docs/actor-groups.md)."""

KUBERNETES_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
BINARIES = (*KUBERNETES_COMMANDS, "etcd", "kwok")

ETCD_MAIN = """\
// Command etcd runs the etcd server built from go.etcd.io/etcd/server/v3.
package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
"""


def cache_root() -> Path:
    return Path(os.environ.get("LOCKSTEP_CACHE", Path.home() / ".cache" / "lockstep"))


def bin_dir() -> Path:
    """Where the binaries of the pinned versions live."""
    return cache_root() / f"k8s-{KUBERNETES_VERSION}-etcd-{ETCD_VERSION}-kwok-{KWOK_VERSION}" / "bin"


def helm_path() -> Path:
    """The helm binary, built from helm.sh/helm/v4 (its own cache folder, by version)."""
    return cache_root() / f"helm-{HELM_VERSION}" / "bin" / "helm"


def build_helm() -> Path:
    """Build helm unless it is cached; return its path."""
    version = f"-X helm.sh/helm/v4/internal/version.version={HELM_VERSION}"
    return _install_command(helm_path(), f"helm.sh/helm/v4/cmd/helm@{HELM_VERSION}", version)


def kueue_path() -> Path:
    """Kueue's controller manager, built from sigs.k8s.io/kueue (its own cache folder, by version)."""
    return cache_root() / f"kueue-{KUEUE_VERSION}" / "bin" / "kueue"


def build_kueue() -> Path:
    """Build Kueue's controller manager unless it is cached (about 4 minutes on 2 cores); return its path."""
    return _install_command(kueue_path(), f"sigs.k8s.io/kueue/cmd/kueue@{KUEUE_VERSION}")


def kueue_module() -> Path:
    """Kueue's module source (its CRDs and webhook manifests, config/components/), from the Go module cache."""
    return _module_source(f"sigs.k8s.io/kueue@{KUEUE_VERSION}")


def lws_module() -> Path:
    """LeaderWorkerSet's module source (its CRDs, config/crd/bases/), from the Go module cache."""
    return _module_source(f"sigs.k8s.io/lws@{LWS_VERSION}")


def _module_source(module: str) -> Path:
    """The source directory of ``module`` (path@version), downloaded into the Go module cache unless it is there."""
    info = json.loads(_go("mod", "download", "-json", module, cwd=cache_root()))
    return Path(info["Dir"])


def lws_path() -> Path:
    """LeaderWorkerSet's controller manager, built from sigs.k8s.io/lws (its own cache folder, by version)."""
    return cache_root() / f"lws-{LWS_VERSION}" / "bin" / "lws"


def build_lws() -> Path:
    """Build LeaderWorkerSet's controller manager unless it is cached (about 6 minutes on 2 cores); return its path.

    Built in a module that requires sigs.k8s.io/lws rather than by ``go install ...@version``, which asks the
    module proxy for the module's version list (to check deprecations), and the proxy refuses that list (403)."""
    main = "sigs.k8s.io/lws/cmd"
    requires = {"sigs.k8s.io/lws": LWS_VERSION}
    return _build_in_module(lws_path(), f"{main} {LWS_VERSION}", requires, main, tool=True)


def otelcol_path() -> Path:
    """The tests' OpenTelemetry Collector (e2e/otelcol/main.go: OTLP in, the debug exporter out), by version."""
    return cache_root() / f"otelcol-{OTELCOL_VERSION}" / "bin" / "otelcol"


def build_otelcol() -> Path:
    """Build the tests' OpenTelemetry Collector unless it is cached (a few minutes on 2 cores); return its path.

    The collector's own distributions are not modules the proxy serves, so a main of the repository's
    (e2e/otelcol/main.go) puts together the receiver and exporter the tests use, at one collector release."""
    modules = ("otelcol", "exporter/debugexporter", "receiver/otlpreceiver", "service")
    requires = {f"go.opentelemetry.io/collector/{module}": OTELCOL_VERSION for module in modules}
    main = Path(__file__).resolve().parents[1] / "otelcol" / "main.go"
    return _build_in_module(otelcol_path(), f"the OpenTelemetry Collector {OTELCOL_VERSION}", requires, ".", main)


def _build_in_module(
    target: Path, what: str, requires: dict[str, str], package: str, main: Path | None = None, tool: bool = False
) -> Path:
    """Build ``package`` into ``target`` unless it is there, in a module of its own beside it (``target``'s
    grandparent/module) that requires ``requires`` (module: version) and holds ``main``, if given, as its main.go;
    ``tool``: the package is the module's tool. Return ``target``."""
    if not target.is_file():
        workdir = target.parent.parent / "module"
        workdir.mkdir(parents=True, exist_ok=True)
        if main is not None:
            shutil.copyfile(main, workdir / "main.go")
        lines = "".join(f"\t{module} {version}\n" for module, version in requires.items())
        tools = f"\ntool {package}\n" if tool else ""
        name = target.name
        (workdir / "go.mod").write_text(f"module lockstep.local/{name}\n\ngo 1.26.0\n\nrequire (\n{lines})\n{tools}")
        _step(f"building {what} (a few minutes on 2 cores)")
        _go("mod", "tidy", cwd=workdir)
        _go("build", "-trimpath", "-ldflags", "-s -w", "-o", str(target), package, cwd=workdir)
    return target


def _install_command(target: Path, package: str, ldflags: str = "") -> Path:
    """``go install package`` into ``target``'s folder unless ``target`` is there; return ``target``."""
    if not target.is_file():
        _step(f"building {package} (a few minutes on 2 cores)")
        target.parent.mkdir(parents=True, exist_ok=True)
        flags = f"-s -w {ldflags}".strip()
        _go("install", "-trimpath", "-ldflags", flags, package, cwd=target.parent, env={"GOBIN": str(target.parent)})
    return target


def _step(message: str) -> None:
    print(f"[build {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _go(*args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    merged = {**os.environ, "CGO_ENABLED": "0", **(env or {})}
    result = subprocess.run(["go", *args], cwd=cwd, env=merged, text=True, capture_output=True)
    if result.returncode != 0:
        raise SystemExit(f"`go {' '.join(args)}` failed in {cwd}:\n{result.stderr[-4000:]}")
    return result.stdout


def staging_replacements(workdir: Path) -> dict[str, str]:
    """Each k8s.io staging module that k8s.io/kubernetes replaces with ./staging,
    mapped to its published version (v0.X.Y for kubernetes v1.X.Y)."""
    info = json.loads(_go("mod", "download", "-json", f"k8s.io/kubernetes@{KUBERNETES_VERSION}", cwd=workdir))
    gomod = json.loads(_go("mod", "edit", "-json", info["GoMod"], cwd=workdir))
    published = "v0." + KUBERNETES_VERSION.removeprefix("v1.")
    return {
        replace["Old"]["Path"]: published
        for replace in gomod.get("Replace") or []
        if replace["New"]["Path"].startswith("./staging/")
    }


def version_ldflags() -> str:
    major, minor, _ = KUBERNETES_VERSION.removeprefix("v").split(".")
    values = {
        "gitVersion": KUBERNETES_VERSION,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    flags = [
        f"-X {package}.{key}={value}"
        for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
        for key, value in values.items()
    ]
    return " ".join(["-s", "-w", *flags])


def write_build_module(workdir: Path) -> None:
    replacements = staging_replacements(workdir)
    _step(f"k8s.io/kubernetes {KUBERNETES_VERSION} replaces {len(replacements)} staging modules; pinning them")
    lines = ["module lockstep.local/controlplane", "", "go 1.26.0", "", "require ("]
    lines += [f"\tk8s.io/kubernetes {KUBERNETES_VERSION}", f"\tgo.etcd.io/etcd/server/v3 {ETCD_VERSION}", ")", ""]
    lines += ["replace ("] + [f"\t{path} => {path} {version}" for path, version in sorted(replacements.items())]
    lines += [")", ""]
    lines += [f"tool k8s.io/kubernetes/cmd/{name}" for name in KUBERNETES_COMMANDS]
    (workdir / "go.mod").write_text("\n".join(lines) + "\n")
    (workdir / "etcd").mkdir(exist_ok=True)
    (workdir / "etcd" / "main.go").write_text(ETCD_MAIN)


def build() -> Path:
    """Build every missing binary; return the directory that holds them."""
    target = bin_dir()
    missing = [name for name in BINARIES if not (target / name).is_file()]
    if not missing:
        _step(f"cache is warm: {target}")
        return target
    started = time.monotonic()
    workdir = target.parent / "module"
    if not (workdir / "go.sum").is_file():
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        write_build_module(workdir)
        _step("resolving modules (go mod tidy; downloads from the Go module proxy)")
        _go("mod", "tidy", cwd=workdir)
    target.mkdir(parents=True, exist_ok=True)
    ldflags = version_ldflags()
    for position, name in enumerate(missing, start=1):
        _step(f"[{position}/{len(missing)}] building {name} (a few minutes each on 2 cores)")
        output = str(target / name)
        if name in KUBERNETES_COMMANDS:
            _go("build", "-trimpath", "-ldflags", ldflags, "-o", output, f"k8s.io/kubernetes/cmd/{name}", cwd=workdir)
        elif name == "etcd":
            _go("build", "-trimpath", "-ldflags", "-s -w", "-o", output, "./etcd", cwd=workdir)
        else:
            _go(
                "install",
                "-trimpath",
                "-ldflags",
                "-s -w",
                f"sigs.k8s.io/kwok/cmd/kwok@{KWOK_VERSION}",
                cwd=workdir,
                env={"GOBIN": str(target)},
            )
    _step(f"built {', '.join(missing)} in {time.monotonic() - started:.0f}s into {target}")
    return target


if __name__ == "__main__":
    print(build())
    print(build_helm())
