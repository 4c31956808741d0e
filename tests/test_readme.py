# The README's Python snippets run as pasted, as real processes against a real daemon: a snippet people copy
# must not be a sketch. The IPC pair (exporter.py, importer.py) runs as the pipeline the README shows.
from __future__ import annotations

import re
from pathlib import Path

import pytest

from daemons import run_worker, spawn_worker, start_daemon

README = Path(__file__).parent.parent / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
PAIR = {s.splitlines()[0]: s for s in SNIPPETS if s.startswith(("# exporter.py", "# importer.py"))}
ALONE = [s for s in SNIPPETS if s not in PAIR.values()]


def test_the_readme_has_the_snippets_it_should():
    """Every Python snippet the README shows is found here (and so run below): one that lost its fence, or a
    new one, changes the count, which is then to be set here anew."""
    assert (len(ALONE), len(PAIR)) == (12, 2)


@pytest.mark.parametrize("code", ALONE, ids=[s.splitlines()[0][:40] for s in ALONE])
@pytest.mark.parametrize("clock", ["wall", "virtual"])
def test_a_snippet_runs_as_pasted(daemon_factory, code, clock):
    """Each snippet runs to its end under either daemon clock (on two devices, or with the example modules,
    where it says it needs them)."""
    devices = ["--devices", "h200:2"] if "--devices h200:2" in code else []
    if "--module-path examples/modules" in code:
        devices += ["--module-path", str(README.parent / "examples" / "modules")]
    daemon = start_daemon("--clock", clock, *(["--time-scale", "100"] if clock == "wall" else []), *devices)
    daemon_factory.append(daemon)
    result = run_worker(code, daemon.pipe_dir)
    assert result.returncode == 0, result.stderr


def test_the_ipc_pair_runs_as_the_pipeline_shown(daemon_factory):
    """python exporter.py | python importer.py: the importer prints the sum of the exporter's fill."""
    daemon = start_daemon("--clock", "virtual")
    daemon_factory.append(daemon)
    exporter = spawn_worker(PAIR["# exporter.py: fills a buffer, shares it and an event, and keeps them until the "
                                 "importer is done"], daemon.pipe_dir)
    importer = spawn_worker(PAIR["# importer.py: another process, given the two handles on stdin"], daemon.pipe_dir)
    importer.stdin.write(exporter.stdout.readline())
    importer.stdin.flush()
    out, err = importer.communicate(timeout=60)
    assert importer.returncode == 0, err
    assert float(out) == 1048576.0
    exporter.communicate("\n", timeout=60)
    assert exporter.returncode == 0
