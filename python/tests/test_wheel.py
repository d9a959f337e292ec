"""The wheel as a user installs it: a fresh venv, ``pip install torch==<pinned>`` and
the wheel, no Rust toolchain on PATH. The ``rankscope`` console command starts the
collector, two DDP ranks of the package's example train under the venv's real
``torchrun``, ``rankscope report`` writes HTML and JSON, and the real DuckDB CLI
counts the rows. ``rankscope demo`` runs from the venv's ``bin/`` without the venv
on PATH.

``make test`` builds the wheel (dev profile, packed from the build the other tests
use) and passes its path in ``RANKSCOPE_WHEEL``; ``make wheel`` builds the release
one that users get.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

WHEEL = os.environ.get("RANKSCOPE_WHEEL")
DUCKDB = shutil.which("duckdb") or str(Path(sys.executable).parent / "duckdb")
RUN_ID = "wheel-run"
STEPS = 12
RANKS = 2

pytestmark = pytest.mark.skipif(
    not WHEEL, reason="RANKSCOPE_WHEEL is not set: `make test` builds the wheel and sets it"
)


def elf(path: Path) -> tuple[list[str], list[str]]:
    """(NEEDED libraries, RUNPATH/RPATH entries) of an ELF file, from readelf."""
    text = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\).*\[(.+?)\]", text)
    paths = [p for found in re.findall(r"\((?:RUNPATH|RPATH)\).*\[(.+?)\]", text) for p in found.split(":")]
    return needed, paths


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh venv with the pinned torch and the wheel, as a user makes it.

    Removed when the module's tests are done: it holds a whole torch, and pytest
    keeps the folders of its last three runs."""
    root = tmp_path_factory.mktemp("user")
    # The space the venv needs: one figure, the Makefile's (`make test` passes it).
    gib = os.environ.get("RANKSCOPE_USER_VENV_GIB")
    assert gib, "RANKSCOPE_USER_VENV_GIB is not set: `make test` sets it with RANKSCOPE_WHEEL"
    free = shutil.disk_usage(root).free
    assert free >= int(gib) << 30, (
        f"the user's venv needs about {gib} GiB free under {root.parent}, "
        f"and {free / 2**30:.1f} GiB are: free some space (old pytest folders, cargo's target/)"
    )
    try:
        yield (root, *make_venv(root))
    finally:
        shutil.rmtree(root / "venv", ignore_errors=True)


def make_venv(root: Path) -> tuple[Path, dict[str, str]]:
    """(bin folder, environment) of a new venv under ``root`` with torch and the wheel."""
    with zipfile.ZipFile(WHEEL) as wheel:
        meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        requires = re.findall(r"^Requires-Dist: (.+)$", wheel.read(meta).decode(), re.M)
    torch_pin = next(r for r in requires if r.startswith("torch"))
    assert re.fullmatch(r"torch==\d+\.\d+\.\d+", torch_pin), f"the wheel must pin one torch: {requires}"
    # Python's own tool, not this venv's: a user's environment has nothing of ours.
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(root / "venv")], check=True)
    bin_dir = root / "venv" / "bin"
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(root),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    # The user's torch (numpy too, as every training environment has it: torch
    # warns without it).
    import numpy

    # pip keeps the real HOME (its cache already holds the pinned torch) and the
    # user's own pip settings (an index, a certificate, a folder of wheels).
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "--quiet"]
    pip_settings = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    pip_env = {**pip_settings, **env, "HOME": os.environ["HOME"]}
    subprocess.run([*pip, torch_pin, f"numpy=={numpy.__version__}"], check=True, env=pip_env)
    started = time.monotonic()
    subprocess.run([*pip, WHEEL], check=True, env=pip_env)
    print(f"\npip install of the wheel into a venv with torch: {time.monotonic() - started:.1f} s")
    return bin_dir, env


def test_wheel_holds_the_command_and_links_torch_from_the_installed_package(venv):
    root, bin_dir, env = venv
    assert shutil.which("cargo", path=env["PATH"]) is None, "cargo must not be on the user's PATH"
    site = next((root / "venv" / "lib").glob("python3*/site-packages"))
    extension = next((site / "rankscope").glob("_native*.so"))
    needed, paths = elf(extension)
    assert any(n.startswith("libtorch") for n in needed), needed
    # The installed torch package's libraries, never a path of the build tree.
    assert paths == ["$ORIGIN/../torch/lib"], paths
    ldd = subprocess.run(["ldd", str(extension)], capture_output=True, text=True, check=True).stdout
    for lib in ("libtorch_cpu.so", "libc10.so"):
        line = next(l for l in ldd.splitlines() if lib in l)
        found = Path(line.split("=>")[1].split("(")[0].strip()).resolve()
        assert found == (site / "torch" / "lib" / lib).resolve(), line
    command = bin_dir / "rankscope"
    needed, paths = elf(command)
    assert not any("torch" in n for n in needed), f"the command must not need libtorch: {needed}"
    assert paths == [], paths

    # The extension in a user's process loads the torch of this venv.
    probe = (
        "import rankscope, torch\n"
        "maps = open('/proc/self/maps').read()\n"
        "print(rankscope.__file__)\n"
        "print(sorted({l.split()[-1] for l in maps.splitlines() if 'libtorch_cpu' in l}))\n"
    )
    out = subprocess.run(
        [str(bin_dir / "python"), "-c", probe], cwd=root, env=env, capture_output=True, text=True, check=True
    )
    assert str(site / "rankscope") in out.stdout, out.stdout
    assert f"['{site / 'torch' / 'lib' / 'libtorch_cpu.so'}']" in out.stdout, out.stdout
    assert "Warning" not in out.stderr, out.stderr

    started = time.monotonic()
    help_text = subprocess.run(
        [str(command), "--help"], env=env, capture_output=True, text=True, check=True
    ).stdout
    print(f"\n`rankscope --help` from the wheel: {time.monotonic() - started:.3f} s")
    for sub in ("collector", "report", "compare", "compact", "jumps", "top", "summary", "replay", "launch", "loadgen", "demo"):
        assert re.search(rf"^\s+{sub}\b", help_text, re.M), f"{sub} missing from --help:\n{help_text}"
    via_python = subprocess.run(
        [str(bin_dir / "python"), "-m", "rankscope", "--version"], env=env, capture_output=True, text=True
    )
    assert via_python.returncode == 0 and via_python.stdout.startswith("rankscope "), via_python


def test_collector_ddp_run_and_report_from_the_wheel(venv):
    root, bin_dir, env = venv
    out = root / "out"
    collector = subprocess.Popen(
        [str(bin_dir / "rankscope"), "collector", "--listen", "127.0.0.1:0", "--out", str(out)],
        stdout=subprocess.PIPE,
        text=True,
        env={**env, "RANKSCOPE_LOG": "warn"},
    )
    try:
        line = collector.stdout.readline()
        addr = next(w for w in line.split() if w.startswith("127.0.0.1:")).rstrip(",")
        ranks = subprocess.run(
            [
                str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", str(RANKS),
                "-m", "rankscope.examples.ddp_train", "--steps", str(STEPS),
            ],
            cwd=root,
            env={
                **env,
                "RANKSCOPE_COLLECTOR": addr,
                "RANKSCOPE_RUN_ID": RUN_ID,
                "RANKSCOPE_SAMPLE_EVERY": "4",
                "RANKSCOPE_OVERHEAD_BUDGET": "100%",
                "RANKSCOPE_SPILL_DIR": str(root / "spill"),
                "OMP_NUM_THREADS": "1",
            },
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert ranks.returncode == 0, ranks.stdout + ranks.stderr
        assert "Warning" not in ranks.stderr, ranks.stderr
    finally:
        collector.send_signal(signal.SIGTERM)
        assert collector.wait(timeout=60) == 0

    html, summary = root / "report.html", root / "report.json"
    subprocess.run(
        [str(bin_dir / "rankscope"), "report", str(out), "--run", RUN_ID, "--html", str(html), "--json", str(summary)],
        env=env,
        check=True,
        capture_output=True,
    )
    assert html.read_text().lstrip().lower().startswith("<!doctype html"), html.read_text()[:200]
    report = json.loads(summary.read_text())
    assert report["run"]["run_id"] == RUN_ID
    assert report["run"]["ranks_seen"] == RANKS and report["run"]["ranks_finished"] == RANKS, report["run"]

    def count(sql: str) -> str:
        return subprocess.run(
            [DUCKDB, "-csv", "-noheader", "-c", sql], check=True, capture_output=True, text=True
        ).stdout.strip()

    def table(name: str) -> str:
        return f"read_parquet('{out}/{name}/*/*.parquet', hive_partitioning=true, union_by_name=true)"

    assert count(f"select count(*), count(distinct rank) from {table('steps')} where run_id='{RUN_ID}'") == (
        f"{RANKS * STEPS},{RANKS}"
    )
    assert count(f"select count(*) from {table('ranks')} where run_id='{RUN_ID}'") == str(RANKS)
    layers = count(f"select count(distinct rank), count(distinct step) from {table('layers')} where run_id='{RUN_ID}'")
    ranks_with_layers, sampled_steps = map(int, layers.split(","))
    assert ranks_with_layers == RANKS and sampled_steps >= 1, layers


def test_demo_from_the_wheel_without_the_venv_on_path(venv):
    root, bin_dir, env = venv
    out = root / "demo-out"
    demo = subprocess.run(
        [str(bin_dir / "rankscope"), "demo", "--nproc-per-node", str(RANKS), "--steps", str(STEPS), "--out", str(out)],
        cwd=root,
        env={**env, "PATH": "/usr/bin:/bin", "RANKSCOPE_LOG": "warn"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "rankscope.examples.ddp_train" in demo.stdout, demo.stdout
    assert "parameters identical on all 2 ranks: True" in demo.stdout, demo.stdout
    report = re.search(r"^report: (.+\.html)$", demo.stdout, re.M)
    assert report and (root / report.group(1)).is_file(), demo.stdout
    assert "Warning" not in demo.stderr, demo.stderr
