"""Which way imports go, read from the source (docs/architecture.md draws the same edges): the daemon reaches the
simulator only through the backend factory (mpsd.backends.factory), and the clock (mpsd.clock) is pure."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mpsd
import mpsd_client
import mpsd_protocol

ROOT = Path(mpsd.__file__).parent
# the three packages' folders (mpsd/, client/mpsd_client/, protocol/mpsd_protocol/: a distribution each)
PACKAGES = {package.__name__: Path(package.__file__).parent for package in (mpsd, mpsd_client, mpsd_protocol)}


def imported(source: str, module: str, *, typing: bool = True) -> set[str]:
    """Every module that `source`, the text of `module` (a dotted name), imports, relative imports resolved;
    ``from a import b`` counts as both a and a.b, since b may be a module. With ``typing=False`` what only a
    type checker imports (under ``if TYPE_CHECKING:``) is left out."""
    package = module.split(".")[:-1]
    found: set[str] = set()
    skipped: set[int] = set()
    tree = ast.parse(source)
    if not typing:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                skipped.update(id(child) for statement in node.body for child in ast.walk(statement))
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            name = ".".join([*base, *([node.module] if node.module else [])])
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


def within(names: set[str], package: str) -> set[str]:
    return {name for name in names if name == package or name.startswith(package + ".")}


def modules(package: str) -> list[str]:
    """The dotted name of every module of `package`, a subpackage of mpsd (``__init__`` named as such, so that
    its relative imports resolve from the package itself)."""
    folder = ROOT.joinpath(*package.split(".")[1:])
    found = sorted(folder.rglob("*.py"))
    assert found, folder
    return [".".join([package, *path.relative_to(folder).with_suffix("").parts]) for path in found]


def source(module: str) -> str:
    return ROOT.joinpath(*module.split(".")[1:]).with_suffix(".py").read_text()


@pytest.mark.parametrize(("text", "hits"), [
    ("from mpsd.sim import H200", {"mpsd.sim"}),
    ("import mpsd.sim.specs", {"mpsd.sim.specs"}),
    ("from mpsd import sim", {"mpsd.sim"}),
    ("from ..sim.clock import Host", {"mpsd.sim.clock", "mpsd.sim.clock.Host"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mpsd.sim import Op", {"mpsd.sim"}),
    ("from mpsd.simulated import x\nfrom mpsd.backends.factory import open_backend", set()),
])
def test_the_check_sees_an_import_of_the_simulator_however_written(text, hits):
    """The check below would fail for each way of writing an import of mpsd.sim, and for no other module."""
    found = within(imported(text, "mpsd.daemon.server"), "mpsd.sim")
    assert found >= hits and bool(found) == bool(hits)


def test_type_checking_imports_are_left_out_only_when_asked():
    """The clock's check leaves out what only a type checker imports; the daemon's does not."""
    text = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mpsd.sim import Op\nimport heapq"
    assert imported(text, "mpsd.clock.virtual", typing=False) == {"typing", "typing.TYPE_CHECKING", "heapq"}
    assert "mpsd.sim" in imported(text, "mpsd.clock.virtual")


@pytest.mark.parametrize("module", modules("mpsd.daemon"))
def test_the_daemon_imports_nothing_of_the_simulator(module):
    """Every module of mpsd.daemon reaches the simulator only through mpsd.backends (the factory), not even
    for a type."""
    assert within(imported(source(module), module), "mpsd.sim") == set()


@pytest.mark.parametrize("module", modules("mpsd.clock"))
def test_the_clock_is_pure(module):
    """mpsd.clock runs without trio, sockets or anything of mpsd but itself (the simulator only as types)."""
    names = imported(source(module), module, typing=False)
    assert within(names, "mpsd") <= within(names, "mpsd.clock")
    assert not {"trio", "socket", "time", "asyncio", "threading"} & {name.split(".")[0] for name in names}


LAYERS = ("mpsd.daemon", "mpsd.runtime", "mpsd.backends", "mpsd.clock", "mpsd.record", "mpsd.sim", "mpsd.stress",
          "mpsd.tools", "mpsd_client", "mpsd_protocol")
ARCHITECTURE = Path(__file__).parent.parent / "docs" / "architecture.md"


def _layer(name: str) -> str | None:
    return next((layer for layer in sorted(LAYERS, key=len, reverse=True)
                 if name == layer or name.startswith(layer + ".")), None)


def test_the_architecture_names_every_module_and_every_edge_between_the_layers():
    """docs/architecture.md names each module of the three packages (its file name), and its list of the edges
    between the layers is the code's, as it runs: a module or an edge added, or gone, without the page fails."""
    doc = ARCHITECTURE.read_text()
    files = [(p, ".".join(p.relative_to(folder.parent).with_suffix("").parts))
             for folder in PACKAGES.values() for p in sorted(folder.rglob("*.py"))
             if p.name not in ("__init__.py", "__main__.py")]
    assert [module for p, module in files if p.name not in doc] == []
    listed = {}
    for line in doc.splitlines():
        if line.startswith("- mpsd") and " imports: " in line:
            layer, _, targets = line[2:].partition(" imports: ")
            listed[layer] = set() if targets == "nothing" else set(targets.split(", "))
    found: dict[str, set[str]] = {layer: set() for layer in LAYERS}
    for path, module in files:
        layer = _layer(module)
        if layer is None:
            continue
        for name in imported(path.read_text(), module, typing=False):
            target = _layer(name)
            if target is not None and target != layer:
                found[layer].add(target)
    assert listed == found


def _requirement_names(pyproject: Path) -> set[str]:
    """The import names of a distribution's declared dependencies (mpsd-protocol==0.1.0 -> mpsd_protocol)."""
    import re
    import tomllib

    declared = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {re.split(r"[<>=!~\[; ]", name, maxsplit=1)[0].replace("-", "_") for name in declared}


@pytest.mark.parametrize("package", ["mpsd_protocol", "mpsd_client"])
def test_the_protocol_and_the_client_are_light_distributions(package):
    """protocol/ and client/ are distributions of their own, for worker processes: every module of theirs imports
    only the standard library, its own package and what its pyproject.toml declares (the protocol nothing, the
    client the protocol and trio), so neither the emulator nor numpy, matplotlib or rich come with them."""
    import sys

    folder = PACKAGES[package]
    allowed = _requirement_names(folder.parent / "pyproject.toml") | {package}
    assert allowed == ({"mpsd_protocol"} if package == "mpsd_protocol" else {"mpsd_client", "mpsd_protocol", "trio"})
    foreign = {}
    for path in sorted(folder.rglob("*.py")):
        module = ".".join(path.relative_to(folder.parent).with_suffix("").parts)  # __init__: its package
        tops = {name.split(".")[0] for name in imported(path.read_text(), module)}
        if extra := tops - allowed - set(sys.stdlib_module_names) - {"__future__"}:
            foreign[module] = extra
    assert foreign == {}


def test_a_worker_that_imports_the_client_loads_nothing_of_the_emulator():
    """Importing mpsd_client (and through it mpsd_protocol and its compiled codec) loads no module of mpsd, numpy,
    matplotlib, rich or psutil: what a worker process pays for the client."""
    import subprocess
    import sys

    code = ("import sys, mpsd_client; print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'mpsd', 'numpy', 'matplotlib', 'rich', 'psutil', 'msgpack', 'mpsd_protocol'}))")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["['mpsd_protocol']"]


INTERPRETERS = ("mpsd.daemon.control", "mpsd.daemon.control_v3")


def _reached(start: str) -> set[str]:
    """Every module `start` imports when it runs, through mpsd's own modules (what only a type checker
    imports left out)."""
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for name in imported(source(module), module, typing=False):
            if name.split(".")[0] == "mpsd" and ROOT.joinpath(*name.split(".")[1:]).with_suffix(".py").exists():
                todo.append(name)
            elif name.split(".")[0] != "mpsd":
                seen.add(name)
    return seen


@pytest.mark.parametrize("start", INTERPRETERS)
def test_the_control_interpreters_are_sans_io(start):
    """The v2 and v3 control languages run on the control plane's state alone: nothing they import, even
    through others, is trio, a socket, a process, or the daemon's side (its server, its control plane, its
    listeners, its sessions, its logs), so a test replays a recorded corpus on them in-process."""
    reached = _reached(start)
    assert {"mpsd.daemon.control_state", "mpsd.daemon.control_text"} <= reached  # (the walk follows imports)
    assert not {"trio", "socket", "subprocess", "os"} & {name.split(".")[0] for name in reached}
    daemon_side = {f"mpsd.daemon.{name}" for name in ("server", "control_plane", "listeners", "routes", "session",
                                                      "servlog", "clients", "server_process")}
    assert not daemon_side & reached
