"""The wheel as a user installs it, beside the torch they already have: for the oldest
and the newest supported torch, a fresh venv with that torch, then ``pip install`` of
the wheel, no Rust toolchain on PATH. pip's own report shows it installed rankscope
and nothing else (torch untouched). The extension links no libtorch. The ``rankscope``
console command starts the collector, two DDP ranks of the package's example train
under the venv's real ``torchrun``, ``rankscope report`` writes HTML and JSON, and the
real DuckDB CLI counts the rows. One fixed input gives the same metrics under both
torch versions and against a float64 oracle; tensors DLPack cannot read give an
``events`` row each and no crash. ``rankscope demo`` runs from the venv's ``bin/``
without the venv on PATH.

``make test`` builds the wheel (dev profile, packed from the build the other tests
use) and passes its path in ``RANKSCOPE_WHEEL`` and the two torch versions in
``RANKSCOPE_TORCH_VERSIONS``; ``make wheel`` builds the manylinux one users get. The
venvs are made one after the other and each is removed when its tests end (a torch
with its CUDA packages takes about 4.6 GB).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
from oracle import COLUMNS

WHEEL = os.environ.get("RANKSCOPE_WHEEL")
TORCH_VERSIONS = os.environ.get("RANKSCOPE_TORCH_VERSIONS", "").split()
DUCKDB = shutil.which("duckdb") or str(Path(sys.executable).parent / "duckdb")
RUN_ID = "wheel-run"
STEPS = 12
RANKS = 2
REL_TOL = 1e-5

pytestmark = pytest.mark.skipif(
    not WHEEL or not TORCH_VERSIONS,
    reason="RANKSCOPE_WHEEL and RANKSCOPE_TORCH_VERSIONS are not set: `make test` sets them",
)

# The metrics of the fixed input under each torch version, compared at the end.
FIXED_METRICS: dict[str, dict] = {}


def elf(path: Path) -> tuple[list[str], list[str]]:
    """(NEEDED libraries, RUNPATH/RPATH entries) of an ELF file, from readelf."""
    text = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\).*\[(.+?)\]", text)
    paths = [p for found in re.findall(r"\((?:RUNPATH|RPATH)\).*\[(.+?)\]", text) for p in found.split(":")]
    return needed, paths


@pytest.fixture(scope="module", params=TORCH_VERSIONS or ["none"])
def venv(request, tmp_path_factory):
    """A fresh venv with one supported torch, then the wheel, as a user makes it.

    Removed when its tests are done: it holds a whole torch, and pytest keeps the
    folders of its last three runs."""
    version = request.param
    root = tmp_path_factory.mktemp(f"user-torch-{version}")
    # The space the venv needs: one figure, the Makefile's (`make test` passes it).
    gib = os.environ.get("RANKSCOPE_USER_VENV_GIB")
    assert gib, "RANKSCOPE_USER_VENV_GIB is not set: `make test` sets it with RANKSCOPE_WHEEL"
    free = shutil.disk_usage(root).free
    assert free >= int(gib) << 30, (
        f"the user's venv needs about {gib} GiB free under {root.parent}, "
        f"and {free / 2**30:.1f} GiB are: free some space (old pytest folders, cargo's target/)"
    )
    try:
        yield (version, root, *make_venv(root, version))
    finally:
        shutil.rmtree(root / "venv", ignore_errors=True)


def make_venv(root: Path, torch_version: str) -> tuple[Path, dict[str, str]]:
    """(bin folder, environment) of a new venv under ``root`` with ``torch_version``
    and then the wheel; asserts that installing the wheel changed nothing else."""
    with zipfile.ZipFile(WHEEL) as wheel:
        meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        requires = re.findall(r"^Requires-Dist: (.+)$", wheel.read(meta).decode(), re.M)
    torch_requirement = next(r for r in requires if r.startswith("torch"))
    floor = min(TORCH_VERSIONS, key=lambda v: tuple(map(int, v.split("."))))
    assert torch_requirement.replace(" ", "") == f"torch>={floor.rsplit('.', 1)[0]}", (
        f"the wheel must require the oldest torch tested as a floor, never a pin: {requires}"
    )
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

    # pip keeps the real HOME (its cache) and the user's own pip settings (an index,
    # a certificate, a folder of wheels).
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "--quiet"]
    pip_settings = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    pip_env = {**pip_settings, **env, "HOME": os.environ["HOME"]}
    started = time.monotonic()
    subprocess.run([*pip, f"torch=={torch_version}", f"numpy=={numpy.__version__}"], check=True, env=pip_env)
    print(f"\npip install torch=={torch_version}: {time.monotonic() - started:.1f} s")
    started = time.monotonic()
    report = root / "pip-report.json"
    subprocess.run([*pip, "--report", str(report), WHEEL], check=True, env=pip_env)
    print(f"pip install of the wheel beside torch {torch_version}: {time.monotonic() - started:.1f} s")
    installed = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installed == ["rankscope"], f"pip installed more than rankscope beside torch: {installed}"
    return bin_dir, env


def test_wheel_is_abi3_holds_the_command_and_links_no_libtorch(venv):
    version, root, bin_dir, env = venv
    assert re.search(r"-cp39-abi3-(manylinux|linux)_", Path(WHEEL).name), WHEEL
    assert shutil.which("cargo", path=env["PATH"]) is None, "cargo must not be on the user's PATH"
    site = next((root / "venv" / "lib").glob("python3*/site-packages"))
    extension = next((site / "rankscope").glob("_native*.so"))
    assert extension.name == "_native.abi3.so", extension.name
    for binary in (extension, bin_dir / "rankscope"):
        needed, paths = elf(binary)
        linked = [n for n in needed if re.match(r"lib(torch|c10)", n)]
        assert linked == [], f"{binary.name} must link no libtorch: {needed}"
        assert paths == [], f"{binary.name} needs no run path: {paths}"

    probe = "import rankscope, torch; print(rankscope.__file__, torch.__version__)"
    out = subprocess.run(
        [str(bin_dir / "python"), "-c", probe], cwd=root, env=env, capture_output=True, text=True, check=True
    )
    assert str(site / "rankscope") in out.stdout and version in out.stdout, out.stdout
    assert "Warning" not in out.stderr, out.stderr

    started = time.monotonic()
    help_text = subprocess.run(
        [str(bin_dir / "rankscope"), "--help"], env=env, capture_output=True, text=True, check=True
    ).stdout
    print(f"\n`rankscope --help` from the wheel: {time.monotonic() - started:.3f} s")
    for sub in ("collector", "report", "compare", "compact", "jumps", "top", "summary", "replay", "launch", "loadgen", "demo"):
        assert re.search(rf"^\s+{sub}\b", help_text, re.M), f"{sub} missing from --help:\n{help_text}"
    via_python = subprocess.run(
        [str(bin_dir / "python"), "-m", "rankscope", "--version"], env=env, capture_output=True, text=True
    )
    assert via_python.returncode == 0 and via_python.stdout.startswith("rankscope "), via_python


class Collector:
    def __init__(self, bin_dir: Path, env: dict, out: Path) -> None:
        self.process = subprocess.Popen(
            [str(bin_dir / "rankscope"), "collector", "--listen", "127.0.0.1:0", "--out", str(out)],
            stdout=subprocess.PIPE,
            text=True,
            env={**env, "RANKSCOPE_LOG": "warn"},
        )
        line = self.process.stdout.readline()
        self.addr = next(w for w in line.split() if w.startswith("127.0.0.1:")).rstrip(",")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=60) == 0


def query(sql: str) -> str:
    return subprocess.run([DUCKDB, "-csv", "-noheader", "-c", sql], check=True, capture_output=True, text=True).stdout.strip()


def table(out: Path, name: str) -> str:
    return f"read_parquet('{out}/{name}/*/*.parquet', hive_partitioning=true, union_by_name=true)"


def test_collector_ddp_run_and_report_from_the_wheel(venv):
    version, root, bin_dir, env = venv
    out = root / "out"
    collector = Collector(bin_dir, env, out)
    try:
        ranks = subprocess.run(
            [
                str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", str(RANKS),
                "-m", "rankscope.examples.ddp_train", "--steps", str(STEPS),
            ],
            cwd=root,
            env={
                **env,
                "RANKSCOPE_COLLECTOR": collector.addr,
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
        collector.stop()

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
    assert query(f"select count(*), count(distinct rank) from {table(out, 'steps')} where run_id='{RUN_ID}'") == (
        f"{RANKS * STEPS},{RANKS}"
    )
    assert query(f"select count(*) from {table(out, 'ranks')} where run_id='{RUN_ID}'") == str(RANKS)
    # Every watched layer of every rank at every sampled step (0, 4, 8), measured.
    layers = query(
        f"select count(distinct rank), count(distinct step), count(distinct layer), count(*), "
        f"count(stable_rank) from {table(out, 'layers')} where run_id='{RUN_ID}'"
    )
    ranks_with_layers, sampled_steps, names, rows, measured = map(int, layers.split(","))
    assert (ranks_with_layers, sampled_steps) == (RANKS, 3), layers
    assert rows == RANKS * 3 * names and measured == rows, layers


# Run inside the user's venv: one fixed input observed, its layers row against a
# float64 oracle written independently of rankscope; and tensors DLPack cannot read.
FIXED_INPUT_SCRIPT = textwrap.dedent(
    """
    import json, math, sys
    import torch
    import rankscope

    g = torch.Generator().manual_seed(7)
    # 300 x 40 with a decaying spectrum, float32 as a layer's output would be.
    u = torch.linalg.qr(torch.randn(300, 40, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(40, 40, generator=g, dtype=torch.float64))[0]
    s = torch.tensor([0.9 ** i for i in range(40)], dtype=torch.float64)
    x = ((u * s) @ v.T).float()

    agent = rankscope.init(collector=sys.argv[1], run_id=sys.argv[2], sample_every=1, overhead_budget=1.0)
    with agent.step(0):
        agent.observe("fixed", x)
        agent.observe("fixed_bf16", x.bfloat16())
        agent.observe("sparse", x.to_sparse())
        agent.observe("meta", torch.empty(4, 4, device="meta"))
        agent.observe("quantized", torch.quantize_per_tensor(x, 0.1, 0, torch.qint8))
        agent.observe("integers", torch.ones(4, 4, dtype=torch.int64))
    report = agent.finish()
    assert report.complete, report

    # The oracle (python/tests/oracle.py, above): the same float32 values in float64.
    print(json.dumps(oracle(x)))
    """
)

# The oracle's source goes ahead of the script in the user's venv.
ORACLE = Path(__file__).with_name("oracle.py").read_text()


def test_a_fixed_input_matches_the_oracle_and_unreadable_tensors_are_events(venv):
    version, root, bin_dir, env = venv
    out = root / "fixed-out"
    script = root / "fixed.py"
    script.write_text(ORACLE + FIXED_INPUT_SCRIPT)
    collector = Collector(bin_dir, env, out)
    try:
        run = subprocess.run(
            [str(bin_dir / "python"), str(script), collector.addr, "fixed"],
            cwd=root,
            env={**env, "RANKSCOPE_SPILL_DIR": str(root / "spill")},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stdout + run.stderr
    finally:
        collector.stop()
    oracle = json.loads(run.stdout.strip().splitlines()[-1])
    cols = ", ".join(COLUMNS)
    rows = {}
    for line in query(f"select layer, {cols}, method from {table(out, 'layers')} where run_id='fixed'").splitlines():
        layer, *values = line.split(",")
        rows[layer] = values
    assert sorted(rows) == ["fixed", "fixed_bf16"], rows
    fixed = dict(zip(COLUMNS, map(float, rows["fixed"][:6])))
    assert rows["fixed"][6] == "exact", rows["fixed"]
    for name in COLUMNS:
        assert math.isclose(fixed[name], oracle[name], rel_tol=REL_TOL), (name, fixed[name], oracle[name])
    # bfloat16 is measured, never refused: its rounding moves the metrics a little.
    bf16 = dict(zip(COLUMNS, map(float, rows["fixed_bf16"][:6])))
    assert math.isclose(bf16["stable_rank"], oracle["stable_rank"], rel_tol=1e-2), bf16
    FIXED_METRICS[version] = fixed

    events = query(
        f"select message from {table(out, 'events')} where run_id='fixed' and kind='sample_unreadable' order by message"
    ).splitlines()
    layers = sorted(re.match(r'"?layer (\w+):', e).group(1) for e in events)
    assert layers == ["integers", "meta", "quantized", "sparse"], events
    # One line each: torch's C++ backtrace is cut off.
    assert not any("Exception raised from" in e or "frame #" in e for e in events), events
    dropped = query(f"select value from {table(out, 'events')} where run_id='fixed' and kind='samples_dropped'")
    assert dropped == "4", dropped

    if len(FIXED_METRICS) == len(TORCH_VERSIONS) > 1:
        first, *others = FIXED_METRICS.values()
        for other in others:
            for name in COLUMNS:
                assert math.isclose(first[name], other[name], rel_tol=REL_TOL), (name, FIXED_METRICS)


def test_demo_from_the_wheel_without_the_venv_on_path(venv):
    version, root, bin_dir, env = venv
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
