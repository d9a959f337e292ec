"""The overhead budget's observed and device shares, without a GPU: a test-only knob
(``_inject_sampled_step_delay``) makes every sampled step slower by a sleep that the
agent's clocks do not see, as a GPU's contention would. The real collector and the
real DuckDB CLI read the rows back. No wall-clock assertion: the checks are medians
over many steps, within a factor of the injected cost."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import torch

import rankscope
from test_api import Net, clean_env, collector, duckdb, table, through_device_side  # noqa: F401 (fixtures)

DELAY_MS = 20.0
STEP_S = 0.005


def train(agent, steps: int, delay_ms: float) -> None:
    """A small model whose steps take about 5 ms (a sleep), sampled steps
    ``delay_ms`` more."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent.watch(model)
    agent._native._inject_sampled_step_delay(delay_ms)
    for step in range(steps):
        with agent.step(step) as s:
            with s.phase("data"):
                time.sleep(STEP_S)
                x, y = torch.randn(16, 8), torch.randn(16, 4)
            with s.phase("forward"):
                loss = ((model(x) - y) ** 2).mean()
            with s.phase("backward"):
                loss.backward()
            with s.phase("optimizer"):
                opt.step()
                opt.zero_grad()


def test_the_observed_slowdown_is_recorded_within_a_factor_of_its_cost(collector):
    agent = rankscope.init(collector=collector.addr, run_id="observed", sample_every=5, overhead_budget="100%")
    train(agent, 300, DELAY_MS)
    overhead = agent.overhead()
    assert overhead["budget"] == 1.0 and overhead["device_samples"] == 0, overhead
    assert overhead["observed_steps"] >= 40 and DELAY_MS / 2 < overhead["observed_per_step_ms"] < DELAY_MS * 2, overhead
    assert agent.finish().complete
    assert collector.stop() == 0
    steps = table(collector.out, "steps")
    sampled = [
        float(v)
        for v in duckdb(
            f"select overhead_observed_ms from {steps} where step % 5 = 0 and overhead_observed_ms is not null"
        ).split()
    ]
    assert len(sampled) >= 40, sampled
    median = statistics.median(sampled)
    assert DELAY_MS / 2 < median < DELAY_MS * 2, (median, sampled)
    # Steps far from a sample have no figure; the column is never set without one.
    assert duckdb(f"select count(overhead_observed_ms) from {steps} where step % 5 = 4") == "0"
    assert duckdb(f"select count(overhead_device_ms) from {steps}") == "0"
    events = table(collector.out, "events")
    message = duckdb(f"select message from {events} where kind = 'overhead_share'")
    assert "Observed slowdown:" in message and "No device time" in message, message


def test_the_budget_skips_samples_for_the_observed_slowdown_and_says_why(collector):
    agent = rankscope.init(collector=collector.addr, run_id="limited", sample_every=5, overhead_budget="2%")
    train(agent, 400, DELAY_MS)
    taken, dropped, skipped = agent.samples()
    overhead = agent.overhead()
    assert overhead["skipped_observed"] > 0 and overhead["skipped_device"] == 0, overhead
    assert agent.finish().complete
    assert collector.stop() == 0
    events = table(collector.out, "events")
    limited = duckdb(f"select message from {events} where kind = 'budget_limited' order by time")
    assert "the observed share" in limited, limited
    skipped_message = duckdb(f"select message from {events} where kind = 'samples_skipped'")
    observed = int(skipped_message.split("observed ")[1].split(":")[0].split(")")[0])
    assert observed > 0 and skipped > 0, skipped_message
    # A sampled step costs 20 ms, five steps 25 ms: the budget takes far fewer than
    # the 80 planned, and the floor still takes one at least every 100 steps.
    layers = table(collector.out, "layers")
    sampled_steps = [int(s) for s in duckdb(f"select distinct step from {layers} order by step").split()]
    assert len(sampled_steps) < 40, sampled_steps
    gaps = [b - a for a, b in zip([0] + sampled_steps, sampled_steps + [400])]
    assert max(gaps) <= 105, sampled_steps
    # The report's agent_overhead diagnosis fires on the observed share, which the
    # agent's CPU clocks never saw.
    report = collector.out.parent / "report.json"
    subprocess.run(
        [sys.executable, "-m", "rankscope", "report", str(collector.out), "--json", str(report)],
        check=True,
        capture_output=True,
    )
    diagnoses = json.loads(report.read_text())["diagnoses"]
    overhead = next((d for d in diagnoses if d["kind"] == "agent_overhead"), None)
    assert overhead is not None, diagnoses
    assert "the observed share" in overhead["message"], overhead["message"]


def test_the_device_sides_time_lands_in_overhead_device_ms(collector):
    agent = rankscope.init(collector=collector.addr, run_id="device", sample_every=2, overhead_budget="100%")
    side = through_device_side(agent)
    x = torch.randn(256, 64)
    for step in range(40):
        with agent.step(step):
            agent.observe("a", x)
        side.poll()
    assert agent.finish().complete
    assert collector.stop() == 0
    steps = table(collector.out, "steps")
    # The first hand-over is read at step 0's end, so from step 1 on every row has
    # the column: the time of the samples handed over since the row before.
    rows = duckdb(f"select count(overhead_device_ms), sum(overhead_device_ms) > 0 from {steps} where step >= 1")
    assert rows == "39,true", rows
    message = duckdb(f"select message from {table(collector.out, 'events')} where kind = 'overhead_share'")
    assert "over 20 samples" in message, message
