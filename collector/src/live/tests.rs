//! The live view on batches decoded by the collector's own reader.

use super::*;
use rankscope_proto::v1::{Batch, EventRow, LayerRow, RankRow, StepRow};

/// The record batches the collector makes of `batch`, sent by `rank` of `run`.
fn records(run: &str, rank: u32, batch: Batch) -> Vec<(Table, RecordBatch)> {
    let bytes = prost::Message::encode_to_vec(&batch);
    crate::wire::decode_batch(&bytes, &[0; Table::ALL.len()])
        .expect("prost's encoding decodes")
        .finish(run, rank)
        .tables
}

fn steps(range: std::ops::Range<u64>, step_ms: f64) -> Batch {
    Batch {
        seq: 1,
        steps: range
            .map(|step| StepRow {
                step,
                time: 1_000_000 + step as i64,
                step_ms,
                comm_ms: Some(2.0),
                loss: Some(1.0 / (step + 1) as f64),
                samples: Some(32),
                rss_bytes: Some(1 << 30),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

#[test]
fn keeps_the_last_steps_of_each_rank_in_step_order() {
    let view = LiveView::new(8);
    view.record("r", 0, &records("r", 0, steps(0..20, 10.0)));
    view.record("r", 1, &records("r", 1, steps(0..3, 30.0)));
    let run = view.run("r", usize::MAX).expect("the run is held");
    assert_eq!(run.summary.ranks_seen, 2);
    assert_eq!(run.summary.last_step, Some(19));
    assert_eq!(run.counters.step_rows, 23);
    let r0 = &run.ranks[0];
    assert_eq!(
        r0.steps.iter().map(|s| s.step).collect::<Vec<_>>(),
        (12..20).collect::<Vec<_>>()
    );
    assert_eq!(r0.steps[0].comm_ms, Some(2.0));
    assert_eq!(r0.steps[0].samples, Some(32));
    assert_eq!(r0.steps[0].rss_bytes, Some(1 << 30));
    assert_eq!(r0.steps[0].data_ms, None);
    assert_eq!(run.ranks[1].steps.len(), 3);
    assert_eq!(run.ranks[1].steps[2].step_ms, 30.0);
    // A request for fewer steps gets the newest.
    let few = view.run("r", 2).unwrap();
    assert_eq!(few.ranks[0].steps[0].step, 18);
    // A resend (a restarted rank) repeats steps: no duplicates, order kept.
    view.record("r", 0, &records("r", 0, steps(15..21, 11.0)));
    let again = view.run("r", usize::MAX).unwrap();
    let order: Vec<u64> = again.ranks[0].steps.iter().map(|s| s.step).collect();
    assert_eq!(order, (13..21).collect::<Vec<_>>());
    assert_eq!(again.ranks[0].steps.last().unwrap().step_ms, 11.0);
}

#[test]
fn counts_the_telemetry_events_and_finished_ranks() {
    let view = LiveView::new(8);
    let event = |kind: &str, value| EventRow {
        kind: kind.into(),
        value: Some(value),
        ..Default::default()
    };
    let last = Batch {
        seq: 2,
        r#final: true,
        events: vec![
            event("samples_skipped", 5),
            event("samples_dropped", 2),
            event("rows_dropped", 7),
            event("nonfinite_activation", 64),
            event("overhead_share", 20_000),
        ],
        ranks: vec![RankRow {
            hostname: "node-a".into(),
            node_rank: 3,
            finished_at: Some(2_000_000),
            ..Default::default()
        }],
        ..Default::default()
    };
    view.record("r", 2, &records("r", 2, last));
    view.record("r", 0, &records("r", 0, steps(0..1, 1.0)));
    let run = view.run("r", 8).unwrap();
    assert_eq!(run.summary.ranks_seen, 2);
    assert_eq!(run.summary.ranks_finished, 1);
    let c = &run.counters;
    assert_eq!(
        (
            c.samples_skipped,
            c.samples_dropped,
            c.rows_dropped,
            c.nonfinite_events
        ),
        (5, 2, 7, 1)
    );
    let r2 = run.ranks.iter().find(|r| r.rank == 2).unwrap();
    assert!(r2.finished);
    assert_eq!((r2.hostname.as_str(), r2.node_rank), ("node-a", 3));
    assert_eq!((r2.samples_skipped, r2.samples_dropped), (5, 2));
}

#[test]
fn follows_each_layer_on_its_lowest_rank_with_a_short_history() {
    let view = LiveView::new(8);
    let layers = |rank_value: f64, range: std::ops::Range<u64>| Batch {
        seq: 1,
        layers: range
            .flat_map(|step| {
                ["blocks.0", "blocks.1"].map(|name| LayerRow {
                    step,
                    layer: name.into(),
                    stable_rank: Some(rank_value),
                    zero_fraction: Some(0.5),
                    nonfinite: 0,
                    ..Default::default()
                })
            })
            .collect(),
        ..Default::default()
    };
    view.record("r", 3, &records("r", 3, layers(3.0, 0..2)));
    view.record(
        "r",
        1,
        &records("r", 1, layers(1.0, 0..(LAYER_HISTORY as u64 + 5))),
    );
    view.record("r", 3, &records("r", 3, layers(3.0, 2..4)));
    let run = view.run("r", 8).unwrap();
    assert_eq!(run.layers.len(), 2);
    let l = &run.layers[0];
    assert_eq!((l.layer.as_str(), l.rank), ("blocks.0", 1));
    assert_eq!(l.history.len(), LAYER_HISTORY);
    assert_eq!(l.history.last().unwrap().step, LAYER_HISTORY as u64 + 4);
    assert_eq!(l.history[0].stable_rank, Some(1.0));
    assert_eq!(l.history[0].zero_fraction, Some(0.5));
}

#[test]
fn holds_at_most_max_ranks_and_lets_a_new_run_push_out_the_stalest() {
    let view = LiveView::new(1);
    let one = |run: &str, rank| records(run, rank, steps(0..1, 1.0));
    for rank in 0..MAX_RANKS as u32 {
        view.record("old", rank, &one("old", rank));
    }
    // A rank past the bound, of a run held: left out and counted.
    view.record("old", MAX_RANKS as u32, &one("old", MAX_RANKS as u32));
    let old = view.run("old", 1).unwrap();
    assert_eq!(old.ranks.len(), MAX_RANKS);
    assert_eq!(old.counters.rows_not_shown, 1);
    // A new run: the stalest run goes.
    view.record("new", 0, &one("new", 0));
    assert!(view.run("old", 1).is_none());
    let list = view.runs();
    assert_eq!(list.runs.len(), 1);
    assert_eq!(list.runs[0].run_id, "new");
}

#[test]
fn knows_a_run_from_its_hello_before_any_row() {
    let view = LiveView::new(4);
    let hello = Hello {
        run_id: "r".into(),
        rank: 5,
        world_size: 8,
        hostname: "h".into(),
        node_rank: 1,
        ..Default::default()
    };
    view.hello(&hello);
    let run = view.run("r", 4).unwrap();
    assert_eq!(run.summary.world_size, 8);
    assert_eq!(run.summary.last_step, None);
    assert_eq!(run.ranks[0].rank, 5);
    assert_eq!(run.ranks[0].hostname, "h");
    assert!(view.run("other", 4).is_none());
}

#[test]
fn its_json_reads_back() {
    let view = LiveView::new(4);
    view.record("r", 0, &records("r", 0, steps(0..3, 5.0)));
    let run = view.run("r", 4).unwrap();
    let json = serde_json::to_string(&run).unwrap();
    assert!(json.contains("\"step_ms\":5.0"), "{json}");
    assert!(
        !json.contains("data_ms"),
        "absent values are left out: {json}"
    );
    let back: RunSnapshot = serde_json::from_str(&json).unwrap();
    assert_eq!(back, run);
}

#[test]
fn a_rank_takes_what_the_header_says() {
    // The header's memory figures: 232 bytes a step, 96 a layer sample.
    assert_eq!(std::mem::size_of::<StepPoint>(), 232);
    assert_eq!(std::mem::size_of::<LayerPoint>(), 96);
    let view = LiveView::new(DEFAULT_STEPS);
    view.record("r", 0, &records("r", 0, steps(0..200, 1.0)));
    let inner = view.lock();
    let rank = &inner.runs["r"].ranks[&0];
    assert_eq!(rank.steps.len(), DEFAULT_STEPS);
    assert_eq!(
        rank.steps.capacity(),
        DEFAULT_STEPS,
        "the deque never grows past its steps"
    );
}

#[test]
fn a_step_without_comm_ms_shows_the_sum_of_its_comm_rows() {
    use rankscope_proto::v1::CommRow;
    let view = LiveView::new(8);
    let comm = |step: Option<u64>, kind: &str, comm_ms: f64| CommRow {
        step,
        time: 1_000_000,
        kind: kind.into(),
        count: 2,
        bytes: 1 << 20,
        comm_ms,
    };
    // An FSDP step: no comm_ms in its row, its all-gathers and reduce-scatters in
    // `comm`, the second kind in a later batch, and a row between steps.
    let mut fsdp = steps(0..2, 10.0);
    for row in &mut fsdp.steps {
        row.comm_ms = None;
    }
    fsdp.comm = vec![
        comm(Some(0), "all_gather", 3.0),
        comm(Some(1), "all_gather", 4.0),
        comm(None, "broadcast", 100.0),
    ];
    view.record("f", 0, &records("f", 0, fsdp));
    let later = Batch {
        seq: 2,
        comm: vec![comm(Some(1), "reduce_scatter", 1.5)],
        ..Default::default()
    };
    view.record("f", 0, &records("f", 0, later));
    // A DDP step keeps its own comm_ms: its bucket all-reduces in `comm` are the
    // same time, not more.
    let mut ddp = steps(0..1, 10.0);
    ddp.comm = vec![comm(Some(0), "all_reduce", 2.0)];
    view.record("d", 0, &records("d", 0, ddp));

    let f = view.run("f", usize::MAX).unwrap();
    let comm_ms: Vec<Option<f64>> = f.ranks[0].steps.iter().map(|s| s.comm_ms).collect();
    assert_eq!(comm_ms, [Some(3.0), Some(5.5)]);
    let d = view.run("d", usize::MAX).unwrap();
    assert_eq!(d.ranks[0].steps[0].comm_ms, Some(2.0));
}

#[test]
fn the_runs_row_gives_the_plan_of_samples() {
    let view = LiveView::new(8);
    view.record("r", 1, &records("r", 1, steps(0..3, 10.0)));
    assert_eq!(view.run("r", 8).unwrap().sample_every, None);
    let mut first = steps(0..3, 10.0);
    first.runs = vec![rankscope_proto::v1::RunRow {
        sample_every: 25,
        ..Default::default()
    }];
    view.record("r", 0, &records("r", 0, first));
    let run = view.run("r", 8).unwrap();
    assert_eq!(run.sample_every, Some(25));
    let json = serde_json::to_value(&run).unwrap();
    assert_eq!(json["sample_every"], 25);
}

#[test]
fn carries_the_agents_device_and_observed_figures_and_its_cost() {
    let view = LiveView::new(64);
    let mut batch = steps(0..20, 10.0);
    for row in &mut batch.steps {
        row.overhead_ms = 0.1;
        // Sampled every 10 steps; each sampled step and the next 0.5 ms slower.
        row.overhead_observed_ms = (row.step % 10 < 2).then_some(0.5);
        row.overhead_device_ms = Some(if row.step % 10 == 0 { 0.2 } else { 0.0 });
    }
    view.record("r", 0, &records("r", 0, batch));
    view.record("r", 1, &records("r", 1, steps(0..20, 10.0)));
    let run = view.run("r", usize::MAX).unwrap();
    let r0 = &run.ranks[0];
    assert_eq!(r0.steps[0].overhead_observed_ms, Some(0.5));
    assert_eq!(r0.steps[2].overhead_observed_ms, None);
    assert_eq!(r0.steps[0].overhead_device_ms, Some(0.2));
    let cost = r0
        .agent_cost
        .as_ref()
        .expect("a rank with steps has a cost");
    assert!((cost.host - 0.01).abs() < 1e-12, "{cost:?}");
    assert!(
        (cost.observed.unwrap() - 2.0 / 200.0).abs() < 1e-12,
        "{cost:?}"
    );
    assert!(
        (cost.device.unwrap() - 0.4 / 200.0).abs() < 1e-12,
        "{cost:?}"
    );
    assert_eq!(cost.observed_steps, 4);
    // A rank without the figures: no device or observed share, not zero.
    let r1 = run.ranks[1].agent_cost.as_ref().unwrap();
    assert_eq!((r1.device, r1.observed), (None, None));
    // The JSON carries them; a viewer's shorter window has its own cost.
    let json = serde_json::to_value(&run).unwrap();
    assert_eq!(json["ranks"][0]["steps"][0]["overhead_observed_ms"], 0.5);
    assert_eq!(json["ranks"][0]["agent_cost"]["observed_steps"], 4);
    let mut short = run.clone();
    short.keep_last_steps(5);
    let c = short.ranks[0].agent_cost.as_ref().unwrap();
    assert_eq!((c.steps, c.observed_steps), (5, 0));
}
