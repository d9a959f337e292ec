//! The reader against prost: random rows encoded by prost and read back, and
//! the wire format's corners (merged occurrences, unknown fields, nesting limits)
//! byte by byte. `crate::fuzzing` holds the comparison itself.

use prost::Message as _;
use rankscope_proto::v1::agent_message::Kind;
use rankscope_proto::v1::{
    AgentMessage, Batch, CommRow, EventRow, Hello, LayerColumns, LayerRow, ModelRow, RankRow,
    RunRow, StepRow,
};

use super::*;
use crate::fuzzing::{self, Outcome, reference_records};

/// Seeded, so a failure reproduces.
struct Rng(rand::rngs::StdRng);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(rand::SeedableRng::seed_from_u64(seed))
    }

    fn next(&mut self) -> u64 {
        rand::Rng::random(&mut self.0)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, one_in: u64) -> bool {
        self.below(one_in) == 0
    }

    /// Any 64 bits, often a small or extreme value.
    fn u64(&mut self) -> u64 {
        match self.below(4) {
            0 => self.below(300),
            1 => [0, 1, u64::MAX, u64::from(u32::MAX), 1 << 63][self.below(5) as usize],
            _ => self.next(),
        }
    }

    fn f64(&mut self) -> f64 {
        match self.below(4) {
            0 => [f64::NAN, f64::INFINITY, -0.0, 0.0, f64::MIN_POSITIVE][self.below(5) as usize],
            _ => f64::from_bits(self.next()),
        }
    }

    fn opt<T>(&mut self, value: impl FnOnce(&mut Rng) -> T) -> Option<T> {
        let v = value(self);
        (!self.chance(3)).then_some(v)
    }

    /// Usually a plain label; sometimes empty, non-ASCII, with a control
    /// character, or over a limit.
    fn text(&mut self) -> String {
        match self.below(40) {
            0 | 1 => String::new(),
            6 | 7 => "層.é".repeat(1 + self.below(4) as usize),
            2 => "bad\u{1b}[31m".into(),
            3 => "x\u{85}y".into(),
            4 => "x".repeat(250 + self.below(10) as usize),
            5 => "m".repeat(4090 + self.below(10) as usize),
            _ => format!("encoder.layers.{}.attn", self.below(48)),
        }
    }
}

fn random_batch(rng: &mut Rng) -> Batch {
    let n = |rng: &mut Rng| rng.below(4) as usize;
    let mut b = Batch {
        // 0 (refused) or 1: a first batch of its rank may not skip seqs.
        seq: rng.below(2),
        r#final: rng.chance(2),
        ..Default::default()
    };
    for _ in 0..n(rng) {
        b.steps.push(StepRow {
            step: rng.u64(),
            time: rng.u64() as i64,
            step_ms: rng.f64(),
            data_ms: rng.opt(Rng::f64),
            forward_ms: rng.opt(Rng::f64),
            backward_ms: rng.opt(Rng::f64),
            optimizer_ms: rng.opt(Rng::f64),
            loss: rng.opt(Rng::f64),
            grad_norm: rng.opt(Rng::f64),
            lr: rng.opt(Rng::f64),
            samples: rng.opt(Rng::u64),
            overhead_ms: rng.f64(),
            overhead_device_ms: rng.opt(Rng::f64),
            overhead_observed_ms: rng.opt(Rng::f64),
            rss_bytes: rng.opt(Rng::u64),
            device_allocated_bytes: rng.opt(Rng::u64),
            device_reserved_bytes: rng.opt(Rng::u64),
            device_peak_bytes: rng.opt(Rng::u64),
            comm_ms: rng.opt(Rng::f64),
        });
    }
    for _ in 0..n(rng) * 3 {
        b.layers.push(LayerRow {
            step: rng.u64(),
            time: rng.u64() as i64,
            layer: rng.text(),
            rows: rng.u64() as u32,
            cols: rng.u64() as u32,
            centered: rng.chance(2),
            stable_rank: rng.opt(Rng::f64),
            participation_ratio: rng.opt(Rng::f64),
            participation_ratio_sv: rng.opt(Rng::f64),
            cum_energy_90: rng.opt(|r| r.u64() as u32),
            nuclear_norm_ratio: rng.opt(Rng::f64),
            effective_rank: rng.opt(Rng::f64),
            mean: rng.opt(Rng::f64),
            std: rng.opt(Rng::f64),
            zero_fraction: rng.opt(Rng::f64),
            nonfinite: rng.u64(),
            compute_ms: rng.f64(),
            conv_layout: if rng.chance(3) {
                rng.text()
            } else {
                String::new()
            },
            method: if rng.chance(3) {
                rng.text()
            } else {
                "exact".into()
            },
            stable_rank_err: rng.opt(Rng::f64),
            participation_ratio_err: rng.opt(Rng::f64),
            participation_ratio_sv_err: rng.opt(Rng::f64),
            cum_energy_90_err: rng.opt(Rng::f64),
            nuclear_norm_ratio_err: rng.opt(Rng::f64),
            effective_rank_err: rng.opt(Rng::f64),
        });
    }
    random_columns(rng, &mut b);
    for _ in 0..n(rng) / 2 {
        b.runs.push(RunRow {
            started_at: rng.u64() as i64,
            world_size: rng.u64() as u32,
            mode: rng.u64() as i32,
            sample_every: rng.u64() as u32,
            max_rows: rng.u64() as u32,
            centered: rng.chance(2),
            layer_filter: rng.text(),
            agent_version: rng.text(),
            workload: rng.text(),
            overhead_budget: rng.opt(Rng::f64),
        });
        b.ranks.push(RankRow {
            local_rank: rng.u64() as u32,
            node_rank: rng.u64() as u32,
            world_size: rng.u64() as u32,
            hostname: rng.text(),
            pid: rng.u64() as u32,
            mode: rng.below(5) as i32,
            started_at: rng.u64() as i64,
            finished_at: rng.opt(|r| r.u64() as i64),
        });
    }
    for _ in 0..n(rng) {
        b.model.push(ModelRow {
            layer: rng.text(),
            kind: rng.text(),
            params: rng.u64(),
            param_bytes: rng.u64(),
            grad_bytes: rng.u64(),
            optimizer_bytes: rng.u64(),
            forward_flops: rng.u64(),
            output_shape: rng.text(),
        });
        b.events.push(EventRow {
            time: rng.u64() as i64,
            kind: rng.text(),
            message: rng.text(),
            value: rng.opt(|r| r.u64() as i64),
            step: rng.opt(Rng::u64),
        });
        b.comm.push(CommRow {
            step: rng.opt(Rng::u64),
            time: rng.u64() as i64,
            kind: rng.text(),
            count: rng.u64(),
            bytes: rng.u64(),
            comm_ms: rng.f64(),
        });
    }
    b
}

/// Half the time, some or all of the `layers` rows travel as columns (as an
/// agent of schema minor 3 sends them), now and then in a broken entry.
fn random_columns(rng: &mut Rng, b: &mut Batch) {
    match rng.below(4) {
        0 => {}
        1 => b.layers_as_columns(),
        _ => {
            let tail = b.layers.split_off(b.layers.len() / 2);
            b.layer_columns.push(LayerColumns::from_rows(tail.clone()));
            b.layer_columns.push(LayerColumns::from_rows(tail));
            let c = &mut b.layer_columns[rng.below(2) as usize];
            match rng.below(6) {
                // A column longer than the others.
                0 => c.time.push(rng.u64() as i64),
                // A string past the dictionary.
                1 => {
                    if let Some(i) = c.method.first_mut() {
                        *i = 1000;
                    }
                }
                // Null bits everywhere, and on fields that are not optional.
                2 => c.absent = vec![u32::MAX; c.step.len()],
                // A column with no values: every row's default.
                3 => c.rows.clear(),
                _ => {}
            }
        }
    }
}

fn agent(batch: Batch) -> Vec<u8> {
    AgentMessage {
        kind: Some(Kind::Batch(batch)),
    }
    .encode_to_vec()
}

fn decoded(bytes: &[u8]) -> DecodedBatch {
    match decode_agent_message(bytes, &[0; Table::ALL.len()]) {
        Ok(Message::Batch(b)) => b,
        other => panic!("not a batch: {other:?}"),
    }
}

/// The `step` column of the `layers` rows of a batch that has only those.
fn layer_steps(bytes: &[u8]) -> Vec<u64> {
    let records = decoded(bytes).finish("r", 0);
    let steps = records.tables[0].1.column_by_name("step").unwrap();
    let steps = steps
        .as_any()
        .downcast_ref::<arrow::array::UInt64Array>()
        .unwrap();
    steps.values().to_vec()
}

#[test]
fn random_rows_read_back_as_prost_reads_them() {
    let mut rng = Rng::new(0x00c0_ffee_d00d_f00d);
    let mut outcomes = std::collections::HashMap::<&str, usize>::new();
    for _ in 0..2000 {
        let batch = random_batch(&mut rng);
        let bytes = agent(batch.clone());
        // Every column, every value, and the refusal, against the reference.
        let outcome = fuzzing::agent_message(&bytes);
        let ours = decoded(&bytes);
        assert_eq!(ours.seq, batch.seq);
        assert_eq!(ours.is_final, batch.r#final);
        let name = match outcome {
            Outcome::Batch { rows, .. } => {
                assert_eq!(rows, batch.rows());
                "accepted"
            }
            Outcome::Refused(m) if m.contains("start at 1") => "seq 0",
            Outcome::Refused(_) => "refused",
            other => panic!("{other:?}"),
        };
        *outcomes.entry(name).or_default() += 1;
    }
    // Both sides of every check are exercised.
    assert!(outcomes["accepted"] > 200, "{outcomes:?}");
    assert!(outcomes["refused"] > 200, "{outcomes:?}");
}

#[test]
fn a_clean_batch_reads_back_column_for_column() {
    let mut rng = Rng::new(7);
    let mut batch = random_batch(&mut rng);
    batch.layers = vec![LayerRow {
        layer: "fc1".into(),
        method: "exact".into(),
        stable_rank: Some(2.5),
        cum_energy_90: Some(3),
        ..Default::default()
    }];
    batch.runs.clear();
    batch.ranks.clear();
    batch.model.clear();
    batch.events.clear();
    let records = decoded(&agent(batch.clone())).finish("run", 2);
    assert_eq!(records.tables, reference_records(&batch, "run", 2));
    assert!(records.tables.iter().any(|(t, _)| *t == Table::Layers));
}

/// A field key.
fn key(field: u32, wire: u8) -> Vec<u8> {
    let mut out = Vec::new();
    let mut k = u64::from(field << 3 | u32::from(wire));
    while k >= 0x80 {
        out.push(k as u8 | 0x80);
        k >>= 7;
    }
    out.push(k as u8);
    out
}

/// A length-delimited field.
fn len_field(field: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = key(field, 2);
    let mut n = payload.len();
    while n >= 0x80 {
        out.push(n as u8 | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
    out.extend_from_slice(payload);
    out
}

/// Reader and prost agree on `bytes`: both refuse, or both read the same.
fn agrees(bytes: &[u8]) -> bool {
    let ours = decode_agent_message(bytes, &[0; Table::ALL.len()]);
    let _ = fuzzing::agent_message(bytes); // asserts the agreement in detail
    ours.is_ok()
}

#[test]
fn occurrences_merge_and_the_last_value_wins() {
    let row = |layer: &str| {
        LayerRow {
            layer: layer.into(),
            ..Default::default()
        }
        .encode_to_vec()
    };
    // One row with its layer sent twice: the second wins, and the bad first
    // value is not checked.
    let twice = [row("bad\u{7}"), row("good")].concat();
    let first = Batch {
        seq: 4,
        ..Default::default()
    }
    .encode_to_vec();
    let second = [len_field(4, &twice), key(1, 0), vec![9]].concat();
    let bytes = [len_field(2, &first), len_field(2, &second)].concat();
    assert!(agrees(&bytes));
    let b = decoded(&bytes);
    assert_eq!((b.seq, b.rows(Table::Layers), b.invalid()), (9, 1, None));

    // A Hello between batches replaces the first; the last one stands.
    let hello = Hello {
        run_id: "r".into(),
        ..Default::default()
    }
    .encode_to_vec();
    let three = [len_field(4, &row("a")), len_field(4, &row("b"))].concat();
    let bytes = [
        len_field(2, &three),
        len_field(1, &hello),
        len_field(2, &len_field(4, &row("c"))),
    ]
    .concat();
    assert!(agrees(&bytes));
    assert_eq!(decoded(&bytes).rows(Table::Layers), 1);
    let bytes = [len_field(2, &three), len_field(1, &hello)].concat();
    assert!(agrees(&bytes));
    assert!(matches!(
        decode_agent_message(&bytes, &[0; Table::ALL.len()]),
        Ok(Message::Hello(h)) if h.run_id == "r"
    ));
    assert!(matches!(
        decode_agent_message(&[], &[0; Table::ALL.len()]),
        Ok(Message::Empty)
    ));
}

#[test]
fn unknown_fields_are_skipped_and_broken_ones_refused() {
    let row = [
        key(40, 0),
        vec![0x96, 0x01],
        key(41, 5),
        vec![1, 2, 3, 4],
        key(42, 3),
        key(1, 0),
        vec![5],
        key(42, 4),
        len_field(43, b"\xff"),
        key(1, 0),
        vec![7],
    ]
    .concat();
    let bytes = len_field(2, &[key(15, 1), vec![0; 8], len_field(3, &row)].concat());
    assert!(agrees(&bytes));
    assert_eq!(decoded(&bytes).rows(Table::Steps), 1);
    let broken: [&[u8]; 10] = [
        &[0x12, 0x02, 0x1a, 0x05],                   // row longer than the batch
        &[0x12, 0x03, 0x1a, 0x01, 0x08],             // varint past the row's end
        &[0x12, 0x04, 0x22, 0x02, 0x1a, 0x80],       // layer: length past the end
        &[0x12, 0x05, 0x22, 0x03, 0x1a, 0x01, 0xff], // layer: not UTF-8
        &[0x12, 0x04, 0x22, 0x02, 0x19, 0x00],       // layer as fixed64
        &[0x12, 0x02, 0x08, 0x80],                   // seq: unterminated varint
        &[0x12, 0x02, 0x0a, 0x00],                   // seq as bytes
        &[0x10, 0x01],                               // batch as a varint
        &[0x12, 0x03, 0x1a, 0x01, 0x07],             // wire type 7 in a row
        &[0x12, 0x04, 0x1a, 0x02, 0x53, 0x5c],       // group ends with another's tag
    ];
    for bytes in broken {
        assert!(!agrees(bytes), "{bytes:x?}");
    }
    // Ten-byte varints: the last byte may only carry bit 63.
    let mut seq = vec![0x08];
    seq.extend_from_slice(&[0xff; 9]);
    for (last, ok) in [(0x01, true), (0x02, false)] {
        let payload = [seq.clone(), vec![last]].concat();
        assert_eq!(agrees(&len_field(2, &payload)), ok, "{last}");
    }
}

#[test]
fn nesting_limits_are_prosts() {
    // Unknown groups (field 30, which no message has) nested `depth` deep, in the
    // AgentMessage, a Batch and a row.
    let groups = |depth: usize| [key(30, 3).repeat(depth), key(30, 4).repeat(depth)].concat();
    for depth in [97, 98, 99, 100, 101] {
        let top = groups(depth);
        let in_batch = len_field(2, &groups(depth));
        let in_row = len_field(2, &len_field(4, &groups(depth)));
        for (bytes, limit) in [(top, 100), (in_batch, 99), (in_row, 98)] {
            assert_eq!(
                agrees(&bytes),
                depth <= limit,
                "{depth} deep, limit {limit}"
            );
        }
    }
}

#[test]
fn columns_read_as_prost_reads_them_packed_or_not() {
    let rows: Vec<LayerRow> = (0..3)
        .map(|i| LayerRow {
            step: i,
            time: 10 + i as i64,
            layer: format!("l{i}"),
            method: "sketch".into(),
            stable_rank: (i != 1).then_some(1.5),
            cum_energy_90: Some(i as u32),
            compute_ms: 0.5,
            ..Default::default()
        })
        .collect();
    let columns = LayerColumns::from_rows(rows.clone()).encode_to_vec();
    let packed = len_field(11, &columns);
    assert!(agrees(&len_field(2, &packed)));
    let b = decoded(&len_field(2, &packed));
    assert_eq!((b.rows(Table::Layers), b.invalid()), (3, None));

    // The same steps unpacked, one occurrence each, between the other columns:
    // prost appends them in order, and so does the reader.
    let unpacked = [
        key(1, 0),
        vec![0],
        key(30, 2),
        vec![1, b'a'],
        key(1, 0),
        vec![1],
        len_field(1, &[2, 3]),
        key(3, 0),
        vec![0],
        len_field(3, &[0, 0, 0]),
    ]
    .concat();
    let bytes = len_field(2, &len_field(11, &unpacked));
    assert!(agrees(&bytes));
    let b = decoded(&bytes);
    assert_eq!((b.rows(Table::Layers), b.invalid()), (4, None));
    assert_eq!(layer_steps(&bytes), [0, 1, 2, 3]);

    // Packed varints of 10 bytes, the longest there is: the tenth byte may be 0
    // or 1 (the value's top bit), and both readers take the full 64 bits.
    let ten = |last: u8| [[0xff; 9].as_slice(), &[last]].concat();
    for last in [0, 1] {
        let bytes = len_field(
            2,
            &len_field(11, &len_field(1, &[&ten(last)[..], &[7]].concat())),
        );
        assert!(agrees(&bytes), "tenth byte {last}");
        let top = u64::from(last) << 63;
        assert_eq!(layer_steps(&bytes), [top | (u64::MAX >> 1), 7]);
    }
    // Values of every varint length, 1 to 10 bytes, each at both ends of its
    // range, in one packed column: read back as they were sent.
    let values: Vec<u64> = (1..10)
        .flat_map(|bytes| [1u64 << (7 * (bytes - 1)), (1u64 << (7 * bytes)) - 1])
        .chain([1 << 63, u64::MAX, 0, 1_764_000_000_000_000])
        .collect();
    let rows: Vec<LayerRow> = values
        .iter()
        .map(|&step| LayerRow {
            step,
            ..Default::default()
        })
        .collect();
    let bytes = len_field(
        2,
        &len_field(11, &LayerColumns::from_rows(rows).encode_to_vec()),
    );
    assert!(agrees(&bytes));
    assert_eq!(layer_steps(&bytes), values);
    // A double column of 12 bytes, a packed varint cut short, one whose tenth byte
    // is over 1, one of 11 bytes, a string that is not UTF-8: prost refuses each,
    // and so does the reader.
    for broken in [
        len_field(7, &[0; 12]),
        len_field(1, &[0x80]),
        len_field(1, &[5, 0x80]),
        len_field(1, &ten(2)),
        len_field(1, &[[0xff; 10].as_slice(), &[0]].concat()),
        len_field(30, b"\xff"),
        [key(7, 0), vec![1]].concat(),
    ] {
        assert!(
            !agrees(&len_field(2, &len_field(11, &broken))),
            "{broken:x?}"
        );
    }
    // A column shorter than the others, an index past the dictionary: prost
    // reads them, and the batch is refused for the first, with its words.
    for (broken, words) in [
        (
            [len_field(1, &[1, 2]), len_field(2, &[5])].concat(),
            "column time has 1 values for 2 rows",
        ),
        (
            [len_field(3, &[0, 1]), len_field(30, b"x")].concat(),
            "row 1's layer is string 1",
        ),
    ] {
        let bytes = len_field(2, &[key(1, 0), vec![1], len_field(11, &broken)].concat());
        assert!(agrees(&bytes));
        match fuzzing::agent_message(&bytes) {
            Outcome::Refused(m) => assert!(m.contains(words), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn mutated_column_batches_agree_with_prost() {
    // Random bits of agent-like batches flipped, one to three at a time: the
    // reader and prost agree on each (fuzzing::agent_message asserts it).
    let mut rng = Rng::new(31);
    for _ in 0..20 {
        let mut batch = random_batch(&mut rng);
        batch.layers_as_columns();
        batch.seq = 1;
        let bytes = agent(batch);
        for _ in 0..100 {
            let mut mutated = bytes.clone();
            for _ in 0..1 + rng.below(3) {
                let i = rng.below(bytes.len() as u64) as usize;
                mutated[i] ^= 1 << rng.below(8);
            }
            let _ = fuzzing::agent_message(&mutated);
        }
    }
}
