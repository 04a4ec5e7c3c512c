"""Kernels of other projects, fetched by package name at a pinned version and loaded under
names attncheck owns.

A project whose package cannot be installed beside the pinned jax (tpu-inference pins
another jax, and importing its package imports vllm) still ships its kernel files in its
wheel. ``fetch_wheel`` downloads that wheel alone (``pip download --no-deps``) into the
cache root (``cache_root.subdir("wheels")``), or takes the file named by the pin's
environment variable. ``WheelModules`` serves the wheel's modules as submodules of an
attncheck package: their absolute imports of the wheel's top-level package are rewritten to
that name, and only that; every other line runs as shipped. Modules of the project that
would pull in its dependencies are replaced by ``shims`` that the loading module writes.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.abc
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from attncheck import cache_root


class Unavailable(RuntimeError):
    """The pinned wheel could not be fetched (no registry, no file): the reason, in one line."""


@dataclasses.dataclass(frozen=True)
class Pin:
    """A distribution at the one version attncheck verifies."""

    distribution: str  # as the registry names it
    version: str
    top_level: str  # the import name of its package

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"

    @property
    def wheel_env(self) -> str:
        """The environment variable that names a local copy of the wheel."""
        return f"ATTNCHECK_{self.distribution.upper().replace('-', '_')}_WHEEL"


def fetch_wheel(pin: Pin) -> pathlib.Path:
    """The pinned wheel, downloaded once into the cache root (or ``$<pin.wheel_env>``)."""
    if chosen := os.environ.get(pin.wheel_env):
        path = pathlib.Path(chosen)
        if not path.is_file():
            raise Unavailable(f"${pin.wheel_env} names {chosen}, which is not a file")
        return path
    directory = cache_root.subdir("wheels") or pathlib.Path(tempfile.gettempdir()) / "attncheck-wheels"
    prefix = f"{pin.distribution.replace('-', '_')}-{pin.version}-"
    found = sorted(directory.glob(f"{prefix}*.whl")) if directory.is_dir() else []
    if not found:
        directory.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--disable-pip-version-check", "-q", "-d", str(directory), pin.requirement],
                              capture_output=True, text=True, timeout=600, check=False)
        found = sorted(directory.glob(f"{prefix}*.whl"))
        if done.returncode or not found:
            last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise Unavailable(f"pip download --no-deps {pin.requirement} failed: {last}")
    return found[-1]


def rewrite_imports(source: str, filename: str, top_level: str, package: str):
    """The module's code with ``import top_level...``/``from top_level... import`` naming
    ``package...`` instead."""
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == top_level or node.module.startswith(top_level + ".")):
            node.module = package + node.module[len(top_level):]
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == top_level for a in node.names):
            raise ImportError(f"{filename}: 'import {top_level}...' binds the project's own name; only "
                              f"'from {top_level}... import' can be served under {package}")
    return compile(tree, filename, "exec")


class WheelModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``<package>.<path>`` from the wheel's ``<top_level>/<path>``; ``shims`` (module
    path after the top level -> source) stand for modules that are not to be run."""

    def __init__(self, pin: Pin, package: str, shims: dict[str, str]):
        self.pin, self.package, self.shims = pin, package, shims
        self._zip = zipfile.ZipFile(fetch_wheel(pin))
        self._names = set(self._zip.namelist())

    def _member(self, fullname: str) -> tuple[str, bool] | None:
        """(the wheel member, is a package) for a module name under the package."""
        rel = fullname[len(self.package):].lstrip(".")
        path = "/".join([self.pin.top_level, *rel.split(".")]) if rel else self.pin.top_level
        if f"{path}.py" in self._names:
            return f"{path}.py", False
        if any(n.startswith(path + "/") for n in self._names):
            return f"{path}/__init__.py", True
        return None

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.package and not fullname.startswith(self.package + "."):
            return None
        rel = fullname[len(self.package):].lstrip(".")
        if rel in self.shims:
            return importlib.util.spec_from_loader(fullname, self)
        member = self._member(fullname)
        if member is None:
            return None
        spec = importlib.util.spec_from_loader(fullname, self, origin=f"{self._zip.filename}/{member[0]}",
                                               is_package=member[1])
        spec.has_location = True
        return spec

    def exec_module(self, module):
        rel = module.__name__[len(self.package):].lstrip(".")
        if rel in self.shims:
            exec(compile(self.shims[rel], f"<attncheck shim for {self.pin.top_level}.{rel}>", "exec"),
                 module.__dict__)
            return
        member, is_package = self._member(module.__name__)
        if is_package:
            module.__path__ = []
            # A package's own __init__ is not run: the project's would import its dependencies.
            return
        source = self._zip.read(member).decode()
        exec(rewrite_imports(source, module.__spec__.origin, self.pin.top_level, self.package), module.__dict__)


def install(pin: Pin, package: str, shims: dict[str, str]) -> None:
    """Serve the pinned wheel's modules under ``package`` (once per process)."""
    if not any(isinstance(f, WheelModules) and f.package == package for f in sys.meta_path):
        sys.meta_path.append(WheelModules(pin, package, shims))


def function_source(pin: Pin, member: str, name: str) -> str:
    """The source of one top-level function of a wheel's module, for a shim that keeps a
    function of a module that cannot be imported."""
    source = zipfile.ZipFile(fetch_wheel(pin)).read(member).decode()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(source, node)
    raise Unavailable(f"{pin.requirement}: {member} defines no function {name}")
