"""The Python API in one process, against the real collector started from the
package (``python -m rankscope collector``) and read with the real DuckDB CLI.
DDP under torchrun is tested in tests/tests/ddp.rs."""

from __future__ import annotations

import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import rankscope

DUCKDB = shutil.which("duckdb") or str(Path(sys.executable).parent / "duckdb")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for var in list(os.environ):
        if var.startswith("RANKSCOPE_") or var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("RANKSCOPE_SPILL_DIR", str(tmp_path / "spill"))
    monkeypatch.setenv("RANKSCOPE_OVERHEAD_BUDGET", "100%")


class Collector:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rankscope", "collector", "--listen", "127.0.0.1:0", "--out", str(out)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "RANKSCOPE_LOG": "warn"},
        )
        line = self.proc.stdout.readline()
        self.addr = next(w for w in line.split() if w.startswith("127.0.0.1:")).rstrip(",")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


@pytest.fixture
def collector(tmp_path):
    c = Collector(tmp_path / "out")
    yield c
    if c.proc.poll() is None:
        c.proc.kill()


def through_device_side(agent, threaded: bool = False):
    """Sends the agent's host tensors to a device side of its own, which reduces them
    without a stream as it would a GPU's (the extension's tests of the GPU path);
    returns that device side, which ``agent._device`` polls at each step's end.
    ``threaded``: on the device side's own thread, as on a GPU (a step's reduction is
    then handed over at a later poll, or at finish)."""
    from rankscope import _device

    side = _device.DeviceSide(agent._native, _device.DEFAULT_POOL_BYTES)
    if threaded:
        side.threaded_devices.add("cpu")
    agent._native._set_device_side(side)
    agent._native._host_to_device_side(True)
    agent._device = side
    return side


def duckdb(sql: str) -> str:
    return subprocess.run(
        [DUCKDB, "-csv", "-noheader", "-c", sql], check=True, capture_output=True, text=True
    ).stdout.strip()


def table(out: Path, name: str) -> str:
    return f"read_parquet('{out}/{name}/*/*.parquet', hive_partitioning=true, union_by_name=true)"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def train(agent, steps: int, model: nn.Module | None = None) -> nn.Module:
    model = model or Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    agent.watch(model)
    agent.profile(model, torch.randn(16, 8), opt)
    for step in range(steps):
        with agent.step(step) as s:
            with s.phase("data"):
                x, y = torch.randn(16, 8), torch.randn(16, 4)
            with s.phase("forward"):
                loss = ((model(x) - y) ** 2).mean()
            with s.phase("backward"):
                loss.backward()
            with s.phase("optimizer"):
                opt.step()
                opt.zero_grad()
            s.record(loss=loss, lr=0.1, grad_norm=torch.tensor(1.5), samples=len(x))
    return model


def test_a_run_lands_steps_layers_model_and_runs(collector):
    with rankscope.init(collector=collector.addr, run_id="py-api", sample_every=5) as agent:
        assert agent.active and agent.rank == 0 and agent.run_id == "py-api"
        assert agent.watch(Net()) == ["fc1", "fc2"]
        train(agent, 12)
    report = agent.finish()
    assert report.complete and report.rows_unsent == 0 and report.connected
    assert collector.stop() == 0
    out = collector.out
    assert duckdb(f"select count(*), count(loss), sum(samples), min(grad_norm) from {table(out, 'steps')}") == "12,12,192,1.5"
    # Sampled steps 0, 5, 10; the watch() of a second Net adds nothing new by name.
    assert duckdb(f"select count(*) from {table(out, 'layers')} where layer in ('fc1', 'fc2')") == "6"
    assert duckdb(
        f"select layer, kind, params, forward_flops, optimizer_bytes from {table(out, 'model')} order by layer"
    ) == f"fc1,linear,{8 * 32 + 32},{2 * 16 * 8 * 32},{4 * (8 * 32 + 32)}\nfc2,linear,{32 * 4 + 4},{2 * 16 * 32 * 4},{4 * (32 * 4 + 4)}"
    assert duckdb(f"select workload, sample_every from {table(out, 'runs')}") == "python,5"


def test_observe_records_hand_written_activations(collector):
    agent = rankscope.init(collector=collector.addr, run_id="py-observe", sample_every=2)
    for step in range(4):
        with agent.step(step):
            agent.observe("custom.features", torch.randn(64, 16))
    agent.finish()
    assert collector.stop() == 0
    assert duckdb(
        f"select string_agg(step::varchar, ' ' order by step), max(cols) from {table(collector.out, 'layers')}"
    ) == "0 2,16"


def test_layers_filter_keeps_matching_modules_only(collector):
    agent = rankscope.init(collector=collector.addr, run_id="py-filter", layers=["fc2"])
    assert agent.watch(Net()) == ["fc2"]
    agent.finish()
    collector.stop()


def test_a_wrong_setting_raises_config_error_naming_it():
    with pytest.raises(rankscope.ConfigError, match="RANKSCOPE_SAMPLE_EVERY"):
        rankscope.init(sample_every=0)
    with pytest.raises(rankscope.ConfigError, match='mode="sometimes"' ):
        rankscope.init(mode="sometimes")
    # The keyword, not the variable it overrides, and the form to write.
    with pytest.raises(rankscope.ConfigError, match='collector="localhost".*no port.*HOST:PORT'):
        rankscope.init(collector="localhost")
    assert issubclass(rankscope.ConfigError, ValueError)


def test_disable_turns_a_config_error_into_one_warning(monkeypatch):
    monkeypatch.setenv("RANKSCOPE_ON_CONFIG_ERROR", "disable")
    monkeypatch.setenv("RANKSCOPE_MAX_ROWS", "lots")
    with pytest.warns(RuntimeWarning, match="RANKSCOPE_MAX_ROWS"):
        agent = rankscope.init()
    assert isinstance(agent, rankscope.InertAgent)
    train(agent, 3)
    assert agent.finish().rows_sent == 0
    # A keyword's wrong value too; a wrong type is a programming error, raised.
    monkeypatch.delenv("RANKSCOPE_MAX_ROWS")
    for keywords, named in (({"sample_every": 0}, "sample_every=0"), ({"mode": "bogus"}, 'mode="bogus"')):
        with pytest.warns(RuntimeWarning, match=named):
            assert isinstance(rankscope.init(**keywords), rankscope.InertAgent)
    with pytest.raises(TypeError, match="sample_every"):
        rankscope.init(sample_every="10")


def test_off_and_rank0_on_other_ranks_are_inert(monkeypatch):
    assert isinstance(rankscope.init(mode="off"), rankscope.InertAgent)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    agent = rankscope.init(mode="rank0", run_id="py-rank0")
    assert isinstance(agent, rankscope.InertAgent) and not agent.active
    with agent.step(0) as s:
        with s.phase("forward"):
            pass
        s.record(loss=1.0)


def test_unknown_phase_is_a_value_error(collector):
    agent = rankscope.init(collector=collector.addr, run_id="py-phase")
    with agent.step(0) as s:
        with pytest.raises(ValueError, match='"fwd" is not a phase'):
            s.phase("fwd")
        with pytest.raises(TypeError, match="loss"):
            s.record(loss="low")
        with pytest.raises(ValueError, match="0-d tensor"):
            s.record(loss=torch.ones(3))
    with pytest.raises(ValueError, match="is not a phase"):
        rankscope.InertAgent().step(0).phase("fwd")
    agent.finish()
    collector.stop()


def test_a_dead_collector_neither_raises_nor_stalls_and_keeps_the_rows(tmp_path):
    # Nothing listens on this port: rows wait in the spill, finish reports them.
    agent = rankscope.init(collector="127.0.0.1:9", run_id="py-dead")
    started = time.monotonic()
    train(agent, 20)
    training_s = time.monotonic() - started
    # A value the events table cannot hold is refused, naming the fix.
    with pytest.raises(TypeError, match=r"value=1\.5 has type float, not a whole number"):
        agent.event("note", "a float", value=1.5)
    report = agent.finish()
    print(f"20 steps with no collector: {training_s:.2f} s; {report}")
    assert not report.connected
    assert report.rows_unsent > 0 and report.rows_unsent == report.rows_spilled
    assert report.rows_dropped == 0
    assert Path(report.spill_dir).is_dir()


def test_an_agent_collected_unfinished_finishes_and_the_process_exits(collector):
    # Collected before the interpreter's exit (del, or a function's local), the agent
    # finishes as finish() does: its metrics threads stop, its rows land.
    code = textwrap.dedent(
        f"""
        import torch, rankscope
        agent = rankscope.init(collector={collector.addr!r}, run_id="py-collected")
        model = torch.nn.Sequential(torch.nn.Linear(8, 8))
        assert agent.watch(model) == ["0"]
        for step in range(3):
            with agent.step(step):
                model(torch.randn(4, 8))
        del agent
        print("collected")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "collected" in done.stdout, done.stderr
    assert "had not measured" not in done.stderr, done.stderr
    assert collector.stop() == 0
    out = collector.out
    assert duckdb(f"select count(*) from {table(out, 'steps')}") == "3"
    assert duckdb(f"select count(*) from {table(out, 'ranks')} where finished_at is not null") == "1"


class DictLeaf(nn.Module):
    """A layer whose output is a dict (as a Hugging Face ModelOutput is)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return {"hidden": x @ self.weight}


class NoTensorLeaf(nn.Module):
    """A layer whose output holds no tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return {"scale": self.weight.detach().item()}


class OddOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.d = DictLeaf()
        self.n = NoTensorLeaf()

    def forward(self, x):
        self.n(x)
        return self.d(x)["hidden"]


def test_odd_models_and_outputs_are_watched_or_said(collector):
    import copy
    import io

    with rankscope.init(collector=collector.addr, run_id="py-odd", sample_every=1) as agent:
        with pytest.warns(RuntimeWarning, match="no layer to watch in this Linear"):
            assert agent.watch(nn.Linear(4, 4)) == []
        with pytest.raises(TypeError, match="str is not a torch.nn.Module"):
            agent.watch("model")
        model = OddOutputs()
        assert agent.watch(model) == ["d", "n"]
        for step in range(2):
            with agent.step(step):
                model(torch.randn(16, 8))
                # A copy made while the hooks are in place holds inert ones.
                twin = copy.deepcopy(model)
                torch.save(model, io.BytesIO())
        twin(torch.randn(16, 8))
    assert collector.stop() == 0
    out = collector.out
    # The dict's tensor is sampled; the output without one is an event each sampled step.
    assert duckdb(f"select layer, count(*) from {table(out, 'layers')} group by layer") == "d,2"
    assert duckdb(
        f"select count(*) from {table(out, 'events')} where kind = 'sample_unreadable' "
        "and message like '%layer''s output, a dict, holds no tensor%'"
    ) == "2"


def test_numbers_and_text_out_of_range_are_errors_naming_the_fix(collector, capfd):
    agent = rankscope.init(collector=collector.addr, run_id="py-range")
    for bad, error, named in ((-1, ValueError, "0 or more"), (2**64, ValueError, "below 2"), ("3", TypeError, "whole")):
        with pytest.raises(error, match=named):
            agent.step(bad)
    with agent.step(0) as s:
        for keywords, named in (
            ({"samples": 1.5}, "a whole number"),
            ({"samples": 2**70}, "a whole number"),
            ({"loss": 10**400}, "too large for a float64"),
        ):
            with pytest.raises(ValueError, match=named):
                s.record(**keywords)
    with pytest.raises(ValueError, match="outside Int64"):
        agent.event("note", "m", 2**63)
    with pytest.raises(TypeError, match="kind=3 has type int"):
        agent.event(3, "m")
    # Text that is not valid Unicode is kept, with U+FFFD in place of what is not.
    agent.event("note", "half a pair \ud800")
    # One agent a process: a second would claim the same rank.
    with pytest.raises(RuntimeError, match="py-range.* is already running in this process"):
        rankscope.init(collector=collector.addr, run_id="py-range")
    assert agent.finish().complete
    with pytest.raises(rankscope.ConfigError, match="overhead_budget=1000"):
        rankscope.init(overhead_budget=10**400)
    with pytest.raises(rankscope.ConfigError, match="workload=.* lone surrogate"):
        rankscope.init(workload="\ud800")
    # A step after finish is not sent, and the log says so (not "queue full").
    with agent.step(1):
        pass
    assert "rows recorded after finish() (steps, events, samples) are not sent" in capfd.readouterr().err
    assert collector.stop() == 0
    kept = duckdb(f"select count(*) from {table(collector.out, 'events')} where message like 'half a pair \ufffd%'")
    assert kept == "1"


def test_a_variable_that_is_not_utf8_is_a_config_error_naming_it():
    env = dict(os.environb)
    env[b"RANKSCOPE_MODE"] = b"st\xffps"
    code = "import rankscope\ntry:\n    rankscope.init()\nexcept rankscope.ConfigError as e:\n    print(e)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "RANKSCOPE_MODE is set to bytes that are not UTF-8 text" in done.stdout, done.stdout + done.stderr


def test_the_dropped_rows_a_small_spill_evicts_are_all_reported(tmp_path, monkeypatch):
    # No collector, and a spill that holds about one segment: most batches are
    # evicted, and with them the rows_dropped reports they carried. What reaches the
    # collector in the end still reports every dropped row.
    monkeypatch.setenv("RANKSCOPE_SPILL_MAX_BYTES", "4K")
    agent = rankscope.init(collector="127.0.0.1:9", run_id="py-evicted", mode="steps")
    for step in range(3000):
        with agent.step(step) as s:
            s.record(loss=1.0, samples=16)
    report = agent.finish()
    assert report.rows_dropped > 1000 and report.rows_spilled > 0
    collector = Collector(tmp_path / "out")
    replayed = subprocess.run(
        [sys.executable, "-m", "rankscope", "replay", "--spill-dir", str(tmp_path / "spill"), "--collector", collector.addr],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert replayed.returncode == 0, replayed.stderr
    assert collector.stop() == 0
    events = table(collector.out, "events")
    assert duckdb(f"select sum(value) from {events} where kind = 'rows_dropped'") == str(report.rows_dropped)


def test_import_refuses_a_torch_below_the_floor_and_takes_local_versions(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        import torch
        torch.__version__ = sys.argv[1]
        try:
            import rankscope
            print("imported")
        except ImportError as e:
            print(e)
        """
    )

    def run(version: str) -> str:
        return subprocess.run([sys.executable, "-c", code, version], capture_output=True, text=True).stdout

    out = run("2.10.1")
    assert "needs torch 2.11 or newer" in out and "torch 2.10.1 is installed" in out, out
    assert "pip install 'torch>=2.11'" in out, out
    for version in ("2.11.0+cu130", "2.15.0", "2.16.0a0+git1234", "3.0.0"):
        assert run(version).strip() == "imported", version


def test_python_m_rankscope_runs_the_summary(collector):
    agent = rankscope.init(collector=collector.addr, run_id="py-summary", sample_every=2)
    train(agent, 4)
    agent.finish()
    assert collector.stop() == 0
    text = subprocess.run(
        [sys.executable, "-m", "rankscope", "summary", "--out", str(collector.out), "--run-id", "py-summary"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "py-summary" in text, text
    bad = subprocess.run(
        [sys.executable, "-m", "rankscope", "collector", "--max-file-age", "soon"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "soon" in bad.stderr


def test_help_is_useful():
    assert "RANKSCOPE_ON_CONFIG_ERROR" in rankscope.init.__doc__
    assert "comm_ms" in rankscope.Agent.watch.__doc__


# Every keyword of init, with a good value and with wrong ones. mode="off" checks
# the settings without starting the agent's threads.
GOOD = {
    "mode": "off",
    "collector": "127.0.0.1:50051",
    "run_id": "exp-42",
    "sample_every": 10,
    "layers": ["fc1", "blocks.*"],
    "max_rows": 4096,
    "workload": "gpt-small",
    "overhead_budget": 0.05,
}
WRONG_TYPE = {
    "collector": 50051,
    "run_id": 42,
    "mode": 1,
    "sample_every": "10",
    "layers": [1, 2],
    "max_rows": 4096.0,
    "workload": b"gpt",
    "overhead_budget": [5],
}
OUT_OF_RANGE = {
    "sample_every": 0,
    "max_rows": -1,
    "overhead_budget": 1.5,
}


@pytest.mark.parametrize("keyword", sorted(GOOD))
def test_every_init_keyword_takes_its_type(keyword):
    agent = rankscope.init(**{"mode": "off", keyword: GOOD[keyword]})
    assert isinstance(agent, rankscope.InertAgent)


def test_overhead_budget_takes_a_fraction_or_a_percentage_and_records_the_fraction(collector):
    for budget in (0.05, "5%", 1, "100%"):
        rankscope.init(mode="off", overhead_budget=budget)
    agent = rankscope.init(collector=collector.addr, run_id="py-budget", overhead_budget=0.05)
    agent.finish()
    assert collector.stop() == 0
    assert duckdb(f"select overhead_budget from {table(collector.out, 'runs')}") == "0.05"


@pytest.mark.parametrize("keyword", sorted(WRONG_TYPE))
def test_a_wrong_type_is_a_type_error_naming_keyword_value_and_fix(keyword):
    value = WRONG_TYPE[keyword]
    with pytest.raises(TypeError) as error:
        rankscope.init(**{"mode": "off", keyword: value})
    message = str(error.value)
    assert f"{keyword}={value!r}" in message, message
    assert "e.g." in message, message


@pytest.mark.parametrize("keyword", sorted(OUT_OF_RANGE))
def test_a_value_out_of_range_is_a_config_error_naming_keyword_value_and_fix(keyword):
    value = OUT_OF_RANGE[keyword]
    with pytest.raises(rankscope.ConfigError) as error:
        rankscope.init(**{"mode": "off", keyword: value})
    message = str(error.value)
    assert f"{keyword}={value!r}" in message, message
    assert "e.g." in message, message


def test_a_sampled_step_is_sampled_whole_under_a_saturated_worker(collector):
    # Three wide layers at every step and no training work: the metrics thread
    # falls behind at once, so steps must be skipped, and none may be partial.
    layers = ["a", "b", "c"]
    steps = 120
    agent = rankscope.init(collector=collector.addr, run_id="py-whole", sample_every=1)
    x = torch.randn(1024, 384)
    for step in range(steps):
        with agent.step(step):
            for name in layers:
                agent.observe(name, x)
    taken, dropped, skipped = agent.samples()
    agent.finish()
    assert collector.stop() == 0
    assert skipped > 0 and dropped == 0, (taken, dropped, skipped)
    layers_table = table(collector.out, "layers")
    assert duckdb(f"select count(*) from {layers_table}") == str(taken)
    assert duckdb(
        f"select count(*) from (select step from {layers_table} group by step having count(*) <> {len(layers)})"
    ) == "0"
    sampled_steps = int(duckdb(f"select count(distinct step) from {layers_table}"))
    assert 0 < sampled_steps < steps and taken == sampled_steps * len(layers)
    message = duckdb(f"select message from {table(collector.out, 'events')} where kind = 'samples_skipped'")
    assert f"{steps - sampled_steps} planned steps skipped" in message, message


def test_overhead_ms_holds_what_a_sampled_step_costs_the_training_thread(collector):
    # The agent's own accounting against the clock, as a ratio of two medians from
    # one run (no time is asserted): a sampled step's extra overhead_ms must be at
    # least 70 % of its extra time on the training thread. The model is the pre-norm
    # block of the DDP example (d = 64, sequence 16, batch 64), whose samples are
    # large enough for the extra to be clear.
    #
    # What is compared is the training thread's own cost, which overhead_ms is to
    # hold. The metrics thread's work is kept out: its CPU time is counted elsewhere
    # (layers.compute_ms, the overhead_share event, the budget), and what it does to
    # the caches training shares, for several steps after each sample, is bounded in
    # docs/columns.md, not timed. So the samples, taken and copied as always, are held
    # back from the metrics thread and dropped after each sampled step. The measure is
    # the training thread's CPU time, so other processes on a loaded machine do not
    # enter it (overhead_ms is wall time, which load can only make larger). Each
    # sampled step is compared with the two unsampled steps before it (neither right
    # after a sampled step), so load that comes and goes over the run cancels out,
    # and the extra is the median of those differences over some 480 sampled steps.
    # Before the agent counted its Python side and reused its sample buffers it
    # recorded about a third of this extra (BENCHMARKS.md, "overhead_ms told truly").
    from rankscope.examples.ddp_train import Block

    steps, every, warmup = 2000, 4, 50
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = Block(64, 4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(64, 16, 64)
        agent = rankscope.init(collector=collector.addr, run_id="py-accounting", sample_every=every)
        agent.watch(model)
        native = agent._native
        native._hold_samples(True)
        cpu_ms, sampled = {}, set()
        for step in range(steps):
            started = time.thread_time_ns()
            with agent.step(step) as s:
                if s.sampled:
                    sampled.add(step)
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                s.record(loss=loss.detach())
            cpu_ms[step] = (time.thread_time_ns() - started) / 1e6
            native._discard_held_samples()
        agent.finish()
    finally:
        torch.set_num_threads(threads)
    assert collector.stop() == 0
    rows = {}
    for line in duckdb(f"select step, overhead_ms, step_ms from {table(collector.out, 'steps')}").split():
        step, overhead_ms, step_ms = line.split(",")
        rows[int(step)] = (float(overhead_ms), float(step_ms))
    on = [s for s in range(warmup, steps) if s in sampled and not sampled & {s - 1, s - 2, s - 3}]
    assert len(on) >= 400, len(on)

    def extra(value) -> float:
        return statistics.median(value(s) - (value(s - 1) + value(s - 2)) / 2 for s in on)

    measured = extra(lambda s: cpu_ms[s])
    recorded = extra(lambda s: rows[s][0])
    wall = extra(lambda s: rows[s][1])
    figures = (
        f"a sampled step's extra: {measured:.3f} ms of training-thread CPU time "
        f"({wall:.3f} ms of step_ms), of which overhead_ms recorded {recorded:.3f} ms"
    )
    print(figures)
    unsampled = statistics.median(cpu_ms[s] for s in range(warmup, steps) if s not in sampled)
    # The sampled extra is clearly there (a ratio, not a time) ...
    assert measured > 0.02 * unsampled, figures
    # ... and the agent's accounting holds most of it.
    assert recorded >= 0.7 * measured, figures


SPECTRAL = ("stable_rank", "participation_ratio", "participation_ratio_sv", "nuclear_norm_ratio", "effective_rank", "cum_energy_90")


def test_a_batch_reduces_as_its_samples_one_at_a_time():
    """The device side stacks a step's samples alike in shape into one batch: each
    one's Gram matrix and sums are those it gets alone, bit for bit, centred or not,
    a non-finite sample beside finite ones included."""
    from rankscope import _device

    g = torch.Generator().manual_seed(5)
    samples = [torch.randn(64, 24, generator=g) * (i + 1) for i in range(3)]
    samples[1][3, 4] = float("inf")
    for centered in (False, True):
        health, gram = _device.reduce(torch.stack(samples), centered)
        for i, x in enumerate(samples):
            alone_health, alone_gram = _device.reduce(x.unsqueeze(0), centered)
            assert torch.equal(health[i], alone_health[0]), (i, centered)
            if i != 1:
                assert torch.equal(gram[i], alone_gram[0]), (i, centered)
    assert health[1][1].item() == 1  # the one non-finite element


class _FakeNative:
    """The extension's side of the device side's calls, recorded."""

    def __init__(self) -> None:
        self.handed: list = []
        self.device_samples = 0
        self.thread_ns = 0

    def pinned_bytes_held(self) -> int:
        return 0

    def hand_over_failed(self, token, why: str) -> None:
        self.handed.append((token, why))

    def hand_over_reduced(self, token, finite, nonfinite, total, total_sq, zeros, gram) -> None:
        self.handed.append((token, finite, gram.shape if gram is not None else None))

    def add_device_ns(self, ns: int, samples: int) -> None:
        self.device_samples += samples

    def add_overhead_since(self, since: int, sampling: bool = False) -> None:
        pass

    def add_thread_ns(self, ns: int) -> None:
        self.thread_ns += ns

    def hand_over_sketched(self, token, finite, nonfinite, total, total_sq, zeros, trace, packed) -> None:
        self.handed.append((token, finite, packed.shape if packed is not None else None))


def test_the_device_sides_two_bounds_skip_a_sample_and_free_with_its_reduction(monkeypatch):
    """The pinned-memory pool and the bound on the device copies each skip a sample that
    would pass them, before its copy, handed over as failed with a message naming the
    variable; their bytes come back once the samples taken are reduced and handed over,
    and the next step's samples fit again. Bad values are refused by name."""
    from rankscope import _device
    from rankscope._native import ConfigError

    x = torch.randn(30, 8)  # 960 bytes to copy; a Gram matrix of 8 × 8 (and 48) to pin: 304
    pinned = 8 * 8 * 4 + 48
    for pool, copies, why in (
        (2 * pinned, None, "RANKSCOPE_PINNED_POOL_BYTES=608"),
        (_device.DEFAULT_POOL_BYTES, 2 * 960, "RANKSCOPE_DEVICE_COPY_BYTES=1920"),
    ):
        native = _FakeNative()
        side = _device.DeviceSide(native, pool, copy_bytes=copies)
        for token in ("a", "b", "c"):
            side.submit(x, token, (0, 1), 30, 8, None, False)
        assert len(side._taken) == 2 and native.handed[0][0] == "c", native.handed
        assert why in native.handed[0][1] and "skipped" in native.handed[0][1], native.handed
        side.poll()
        assert side._pending_bytes == 0 and side._copies_held == 0
        side.submit(x, "d", (0, 1), 30, 8, None, False)
        side.flush()
        assert [h[0] for h in native.handed] == ["c", "a", "b", "d"], native.handed
    for variable, read in (
        ("RANKSCOPE_DEVICE_COPY_BYTES", _device.copy_bytes_from_env),
        ("RANKSCOPE_PINNED_POOL_BYTES", _device.pool_bytes_from_env),
    ):
        monkeypatch.setenv(variable, "2G")
        with pytest.raises(ConfigError, match=f"{variable}='2G' is not a byte count"):
            read()
        monkeypatch.setenv(variable, "4096")
        assert read() == 4096
        monkeypatch.delenv(variable)
    assert _device.copy_bytes_from_env() is None
    assert _device.pool_bytes_from_env() == _device.DEFAULT_POOL_BYTES


def test_a_reduction_that_fails_hands_its_samples_over_as_failed(monkeypatch):
    """An exception in the device side's reduction (out of memory, say) reaches neither
    the training loop nor the other samples: the batch's samples are handed over as
    failed, with the first line of the error, and their bytes leave the pool."""
    from rankscope import _device

    def broken(batch, centered):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    native = _FakeNative()
    side = _device.DeviceSide(native, _device.DEFAULT_POOL_BYTES)
    monkeypatch.setattr(_device, "reduce", broken)
    for token in ("a", "b"):
        side.submit(torch.randn(30, 8), token, (0, 1), 30, 8, None, False)
    side.poll()
    assert native.handed == [(t, "the device side failed: CUDA out of memory. Tried to allocate 2.00 GiB") for t in "ab"]
    assert side._pending_bytes == 0 and not side._pending


def test_the_device_side_waits_for_the_step_end_up_to_its_held_bytes(monkeypatch):
    """A step's row copies wait for poll() (the step's end) and are reduced by batch;
    past HELD_BYTES of them they go on at once. Every sample is handed over once, in
    the order taken, with its own Gram matrix."""
    from rankscope import _device

    x = torch.randn(30, 8)
    for held, waiting in ((_device.HELD_BYTES, 3), (0, 0)):
        monkeypatch.setattr(_device, "HELD_BYTES", held)
        native = _FakeNative()
        side = _device.DeviceSide(native, _device.DEFAULT_POOL_BYTES)
        for token in ("a", "b", "c"):
            side.submit(x, token, (0, 1), 30, 8, None, False)
        assert len(side._taken) == waiting, held
        side.poll()
        assert native.handed == [(t, 240, (8, 8)) for t in "abc"], native.handed
        assert native.device_samples == 3 and not side._taken and not side._pending


def test_several_metrics_threads_measure_every_sample_once(tmp_path):
    """RANKSCOPE_METRICS_THREADS=3: three threads take samples from one queue; every
    sample taken is measured once, and their CPU time together is the agent's."""
    collector = Collector(tmp_path / "threads")
    os.environ["RANKSCOPE_METRICS_THREADS"] = "3"
    try:
        agent = rankscope.init(collector=collector.addr, run_id="threads", sample_every=1, overhead_budget="100%")
        g = torch.Generator().manual_seed(4)
        inputs = {f"layer{i}": torch.randn(300, 48, generator=g) * (i + 1) for i in range(6)}
        for step in range(6):
            with agent.step(step):
                for name, x in inputs.items():
                    agent.observe(name, x)
        # Every sample measured: each thread has reported its CPU time by then.
        deadline = time.monotonic() + 60
        while agent._native.queued_samples() and time.monotonic() < deadline:
            time.sleep(0.02)
        taken, dropped, _skipped = agent.samples()
        overhead = agent.overhead()
        assert agent.finish().complete
    finally:
        del os.environ["RANKSCOPE_METRICS_THREADS"]
    assert collector.stop() == 0
    assert taken >= 6 and dropped == 0, (taken, dropped)
    found = duckdb(
        f"select count(*), count(distinct (step, layer)), count(stable_rank) from {table(collector.out, 'layers')}"
    )
    assert found == f"{taken},{taken},{taken}", (found, taken)
    assert overhead["metrics_thread_ms"] > 0, overhead


def _metrics_threads_alive(expected: int) -> int:
    # Thread names are cut to 15 bytes in /proc ("rankscope-metri"), and a new thread
    # names itself once it runs: look for a few seconds until `expected` are there.
    deadline = time.monotonic() + 10
    while True:
        names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
        alive = sum(name.startswith("rankscope-metri") for name in names)
        if alive == expected or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


def test_a_cuda_rank_starts_two_metrics_threads_unless_told(monkeypatch, collector):
    """Where RANKSCOPE_METRICS_THREADS is unset, a rank whose torch sees a CUDA GPU
    starts two metrics threads (the keyword the package passes starts them), and any
    other rank, or a rank told by the variable, the agent's own count."""
    from rankscope import _agent

    monkeypatch.delenv("RANKSCOPE_METRICS_THREADS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _agent._default_metrics_threads() == _agent.GPU_METRICS_THREADS == 2
    monkeypatch.setenv("RANKSCOPE_METRICS_THREADS", "1")
    assert _agent._default_metrics_threads() is None
    monkeypatch.delenv("RANKSCOPE_METRICS_THREADS")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _agent._default_metrics_threads() is None
    native = rankscope._native.init(collector=collector.addr, run_id="threads-kw", metrics_threads=2)
    try:
        assert _metrics_threads_alive(2) == 2
    finally:
        native.finish()
    assert _metrics_threads_alive(0) == 0
    for bad, error in ((0, rankscope.ConfigError), ("2", TypeError)):
        with pytest.raises(error, match="metrics_threads"):
            rankscope._native.init(collector=collector.addr, run_id="threads-kw", metrics_threads=bad)


def test_the_device_sides_thread_reduces_every_sample_and_counts_its_time():
    """On the device side's own thread (as on a GPU; here without a stream) a launch
    returns before its reduction: every sample is handed over once, by a later poll or
    at flush, launches in order, the Gram path and the sketch's alike; the thread's CPU
    time reaches the agent, and the thread is gone after flush. A reduction that fails
    there hands its samples over as failed and the thread serves the next launch."""
    from rankscope import _device

    native = _FakeNative()
    side = _device.DeviceSide(native, _device.DEFAULT_POOL_BYTES, threaded=True)
    side.threaded_devices.add("cpu")
    g = torch.Generator().manual_seed(2)
    small, wide = torch.randn(30, 8, generator=g), torch.randn(600, 560, generator=g)
    for step in range(3):
        for token, x, sketch in (("a", small, False), ("b", wide, True), ("c", small, False)):
            side.submit(x, f"{token}{step}", (0, 1), x.shape[0], x.shape[1], None, False, sketch, step)
        side.poll()
    side.flush()
    packed = (_native_packed_len(),)
    expected = [(f"{t}{s}", n, shape) for s in range(3) for t, n, shape in (("a", 240, (8, 8)), ("b", 336000, packed), ("c", 240, (8, 8)))]
    # Within a launch, batches go in group order (the two small samples together).
    assert sorted(native.handed) == sorted(expected), native.handed
    assert [h[0] for h in native.handed if h[0].startswith("b")] == ["b0", "b1", "b2"]
    assert native.thread_ns > 0 and side._thread is None
    assert side._pending_bytes == 0 and not side._pending

    def broken(batch, centered):
        raise RuntimeError("no room on the device")

    side = _device.DeviceSide(native, _device.DEFAULT_POOL_BYTES, threaded=True)
    side.threaded_devices.add("cpu")
    native.handed.clear()
    original = _device.reduce
    _device.reduce = broken
    try:
        side.submit(small, "x", (0, 1), 30, 8, None, False)
        side.poll()
        side._work.join()
    finally:
        _device.reduce = original
    side.submit(small, "y", (0, 1), 30, 8, None, False)
    side.flush()
    assert native.handed == [("x", "the device side failed: no room on the device"), ("y", 240, (8, 8))], native.handed
    assert side._pending_bytes == 0


def _native_packed_len() -> int:
    from rankscope import _native

    return _native.SKETCH_PACKED_LENS[-1]


def observe_once(collector: "Collector", inputs: dict, device: bool, max_rows: int) -> None:
    """One step of run "same" that observes every input, through the device side (on
    its own thread, as on a GPU) or the host path, sent to `collector` (the paths draw
    the same rows)."""
    agent = rankscope.init(collector=collector.addr, run_id="same", max_rows=max_rows, sample_every=1)
    if device:
        through_device_side(agent, threaded=True)
    with agent.step(0):
        for name, x in inputs.items():
            agent.observe(name, x)
    if agent._device is not None:
        agent._device.poll()
    assert agent.finish().complete


def test_the_device_sides_reduction_gives_the_host_paths_metrics(tmp_path, low_precision):
    """The GPU path's reduction (rankscope._device: row sample, float32 health sums and
    Gram matrix, handed over as a pinned buffer through DLPack; samples alike in shape
    reduced in one batch), run here without a stream, against the host path (the float64 Gram on the metrics thread) for the same
    activations, wide and tall, centred and not, with more rows than the cap. The same
    run id draws the same rows on both paths; each path has its own collector."""
    g = torch.Generator().manual_seed(3)
    inputs = {
        "tall": torch.randn(700, 48, generator=g) * torch.linspace(3, 0.1, 48),
        # Alike in shape and type: reduced in one batch with "tall".
        "tall_b": torch.randn(700, 48, generator=g) * torch.linspace(0.1, 5, 48),
        "wide": torch.randn(40, 90, generator=g),
        "seq": torch.randn(4, 50, 24, generator=g),
        "bf16": torch.randn(300, 32, generator=g).bfloat16(),
        "bad": torch.tensor([[1.0, float("nan")], [0.0, 2.0]]),
        # A finite sample in the non-finite one's batch keeps its spectrum.
        "bad_b": torch.tensor([[1.0, 3.0], [0.0, 2.0]]),
    }
    cols = ", ".join(SPECTRAL + ("mean", "std", "zero_fraction", "nonfinite", "rows", "cols", "centered"))
    results = {}
    for path, centered in (("host", False), ("device", False), ("host_c", True), ("device_c", True)):
        collector = Collector(tmp_path / path)
        os.environ["RANKSCOPE_CENTER"] = "1" if centered else "0"
        observe_once(collector, inputs, path.startswith("device"), max_rows=512)
        del os.environ["RANKSCOPE_CENTER"]
        assert collector.stop() == 0
        for line in duckdb(f"select layer, {cols} from {table(collector.out, 'layers')}").splitlines():
            layer, *values = line.split(",")
            results[(path, layer)] = values
    assert len(results) == 4 * len(inputs), sorted(results)
    worst = 0.0
    for host, device in (("host", "device"), ("host_c", "device_c")):
        for layer in inputs:
            a, b = results[(host, layer)], results[(device, layer)]
            assert a[-4:] == b[-4:], (layer, a, b)  # nonfinite, rows, cols, centered
            for i, (x, y) in enumerate(zip(a[:-4], b[:-4])):
                if x in ("", "NULL") or y in ("", "NULL"):
                    assert x == y, (layer, i, a, b)
                    continue
                # A float32 Gram against a float64 one.
                assert math.isclose(float(x), float(y), rel_tol=1e-4, abs_tol=1e-6), (host, layer, i, a, b)
                if i < 5:
                    worst = max(worst, abs(float(x) - float(y)) / abs(float(x)))
    print(f"\nfloat32 device Gram against the float64 host path: largest relative difference {worst:.2e}")


@pytest.fixture(params=[False, True], ids=["float32", "as_is"])
def low_precision(request, monkeypatch):
    """Both ways the device side multiplies a bfloat16 sample: in float32, and (``as_is``)
    as it is with float32 results (torch.bmm's out_dtype: CUDA only, so emulated here,
    with the same values), which sends the sketch's Krylov process to the Gram matrix."""
    from rankscope import _device

    monkeypatch.setattr(_device, "_LOW_PRECISION_GRAM", {})
    if request.param:

        def emulated(x):
            x = x.float()
            _, rows, cols = x.shape
            return x.transpose(1, 2) @ x if cols <= rows else x @ x.transpose(1, 2)

        monkeypatch.setattr(_device, "low_precision_gram", emulated)
    return request.param


def test_the_device_runs_the_sketch_within_its_bounds(tmp_path, low_precision):
    """Where the sketch measures a sample, the device side runs its Krylov process
    (rankscope._device.krylov, here without a stream; for a bfloat16 sample multiplied
    as it is, krylov_on_gram) and hands over a summary, not the Gram matrix: every
    column it stores is within the bound docs/metrics.md states of the exact float64
    value, with its error estimate, wide and tall, centred and not, two alike in one
    batch, bfloat16 included; a non-finite sample has no spectrum."""
    g = torch.Generator().manual_seed(8)

    def power(n: int, d: int, alpha: float) -> torch.Tensor:
        return torch.randn(n, d, generator=g) * torch.arange(1, d + 1).float() ** -alpha

    inputs = {
        "tall": power(900, 560, 0.5),
        "tall_b": power(900, 560, 1.0),
        "wide": power(600, 800, 0.3).T.contiguous(),
        "bf16": power(700, 540, 0.6).bfloat16(),
        "bad": power(600, 520, 0.5),
    }
    inputs["bad"][5, 5] = float("nan")
    bounds = {
        "stable_rank": 0.02,
        "participation_ratio": 0.02,
        "effective_rank": 0.05,
        "participation_ratio_sv": 0.10,
        "nuclear_norm_ratio": 0.05,
        "cum_energy_90": 0.15,
    }
    names = tuple(bounds)
    cols = ", ".join(names + tuple(f"{n}_err" for n in names) + ("method", "nonfinite"))
    results = {}
    for path, spectrum, centered in (
        ("exact", "exact", False),
        ("device", "sketch", False),
        ("exact_c", "exact", True),
        ("device_c", "sketch", True),
    ):
        collector = Collector(tmp_path / path)
        os.environ["RANKSCOPE_CENTER"] = "1" if centered else "0"
        os.environ["RANKSCOPE_SPECTRUM"] = spectrum
        try:
            observe_once(collector, inputs, path.startswith("device"), max_rows=1024)
        finally:
            del os.environ["RANKSCOPE_CENTER"], os.environ["RANKSCOPE_SPECTRUM"]
        assert collector.stop() == 0
        for line in duckdb(f"select layer, {cols} from {table(collector.out, 'layers')}").splitlines():
            layer, *values = line.split(",")
            results[(path, layer)] = values
    n = len(names)
    stored = 0
    for exact, device in (("exact", "device"), ("exact_c", "device_c")):
        for layer in inputs:
            truth, got = results[(exact, layer)], results[(device, layer)]
            if layer == "bad":
                assert got[-1] == "1" and all(v in ("", "NULL") for v in got[:n]), got
                continue
            assert got[-2] == "sketch", (layer, got)
            for i, name in enumerate(names):
                value, estimate = got[i], got[n + i]
                assert estimate not in ("", "NULL"), (layer, name, got)
                if value in ("", "NULL"):
                    assert float(estimate) > bounds[name], (layer, name, got)
                    continue
                stored += 1
                error = abs(float(value) - float(truth[i])) / abs(float(truth[i]))
                assert error <= bounds[name], (device, layer, name, value, truth[i])
    # The two columns the sketch is built around are stored for every sample.
    assert stored >= 2 * 4 * 2, stored


def _with_spectrum(rows: int, eigenvalues: torch.Tensor, seed: int) -> torch.Tensor:
    """A rows × len(eigenvalues) float32 matrix whose Gram matrix has those eigenvalues."""
    g = torch.Generator().manual_seed(seed)
    cols = len(eigenvalues)
    u, _ = torch.linalg.qr(torch.randn(rows, cols, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=g, dtype=torch.float64))
    return ((u * eigenvalues.sqrt()) @ v.T).float()


def test_a_layers_device_sketch_runs_as_deep_as_its_last_sample_needed(tmp_path, monkeypatch):
    """The device side runs a layer's Krylov process only as deep as the layer's last
    summary needed (agent/src/sampling/depths.rs): after its first sample, a layer whose
    spectrum vouches at the schedule's first depth runs that one, and its columns are
    those of a process run to every depth (to round-off: the products of a narrower
    space round apart). A layer whose spectrum turns steeper than its depth allows
    loses its unvouched columns in that one sample (null, with their _err over the
    bound), then runs deeper, and again gives what every depth gives. The same run id
    draws the same rows and vectors in both runs."""
    from rankscope import _device

    j = torch.arange(1, 601, dtype=torch.float64)
    # 1/j vouches at the first depth, 1/j² at the second (measured on this sketch).
    easy, steep = _with_spectrum(900, j**-1.0, 1), _with_spectrum(900, j**-2.0, 2)
    # "turns" has its own shape, so that it is a batch of its own.
    turns = [easy[:800], easy[:800], steep[:800], steep[:800]]
    inputs = [{"easy": easy, "turns": t} for t in turns]
    ran: list = []
    original = _device._krylov_space

    def spy(times, k, r, device, seed, depths=None):
        ran.append((r, depths))
        return original(times, k, r, device, seed, depths)

    monkeypatch.setattr(_device, "_krylov_space", spy)
    names = SPECTRAL + tuple(f"{n}_err" for n in SPECTRAL)
    rows = {}
    monkeypatch.setenv("RANKSCOPE_SPECTRUM", "sketch")
    for path in ("learnt", "every_depth"):
        if path == "every_depth":
            monkeypatch.setattr(_device, "_batch_depths", lambda items: None)
        collector = Collector(tmp_path / path)
        agent = rankscope.init(collector=collector.addr, run_id="depths", sample_every=1, overhead_budget="100%")
        through_device_side(agent)
        ran.clear()
        for step, observed in enumerate(inputs):
            with agent.step(step):
                for name, x in observed.items():
                    agent.observe(name, x)
            agent._device.poll()
            # The next step's depths are learnt from this one's summaries.
            deadline = time.monotonic() + 60
            while agent._native.queued_samples() and time.monotonic() < deadline:
                time.sleep(0.01)
        assert agent.finish().complete
        assert collector.stop() == 0
        if path == "learnt":
            # Both layers have side 600; the easy one's batch comes first at each step.
            assert [d for _, d in ran] == [3, 3, 1, 1, 1, 1, 1, 2], ran
        else:
            assert all(d is None for _, d in ran), ran
        sql = f"select layer, step, method, {', '.join(names)} from {table(collector.out, 'layers')} order by layer, step"
        for line in duckdb(sql).splitlines():
            layer, step, *values = line.split(",")
            rows[(path, layer, int(step))] = values
    assert len(rows) == 2 * 2 * len(inputs), sorted(rows)
    for layer in ("easy", "turns"):
        for step in range(len(inputs)):
            learnt, every = rows[("learnt", layer, step)], rows[("every_depth", layer, step)]
            if (layer, step) != ("turns", 2):
                assert learnt[0] == every[0] == "sketch", (layer, step, learnt, every)
                for x, y in zip(learnt[1:], every[1:]):
                    assert (x in ("", "NULL")) == (y in ("", "NULL")), (layer, step, learnt, every)
                    if x not in ("", "NULL"):
                        assert math.isclose(float(x), float(y), rel_tol=1e-5), (layer, step, learnt, every)
                continue
            # One depth where it needed two: a column over its bound is null, its
            # estimate kept; every depth measured it.
            n = len(SPECTRAL)
            missing = [i for i in range(n) if learnt[1 + i] in ("", "NULL")]
            assert missing and all(learnt[1 + n + i] not in ("", "NULL") for i in missing), learnt
            assert all(every[1 + i] not in ("", "NULL") for i in range(n - 1)), every
