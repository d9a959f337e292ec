//! What the collector runs on the bytes of one gRPC message, as plain functions
//! for the cargo-fuzz targets (`fuzz/`) and the hostile-input tests.
//!
//! [`agent_message`] takes the payload of one gRPC frame, as tonic hands it to the
//! collector's decoder, and runs the collector's own code on it in the order a
//! stream does: [`grpc::decode_agent_message`] (rows counted on the wire, then the
//! [`wire`] reader, straight into Arrow builders); [`validate::hello`] or the
//! batch's own checks; the sequence check and buffering of [`Intake::admit`]; then
//! what a commit does with the buffered rows: Parquet encoding
//! ([`store::writer::encode_parquet`]), into memory. No filesystem, no network, no
//! tokio.
//! [`hello`] and [`batch`] start from the inner messages, so a fuzzer spends its
//! time past the envelope.
//!
//! Contract: none of them panics on any input; every row of an accepted batch
//! comes out of the Parquet encoding; and the [`wire`] reader agrees with prost,
//! the reference decoder: it accepts what prost accepts, refuses what prost
//! refuses, finds the rows prost finds with the same values
//! ([`reference_records`], prost's structs converted field by field) and refuses
//! a batch for the value `validate::batch` names. These are assertions, so a
//! fuzzer reports a lost row or a disagreement as a crash.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{
    ArrayRef, BooleanArray, Float32Array, Float64Array, Int64Array, RecordBatch, StringArray,
    TimestampMicrosecondArray, UInt32Array, UInt64Array,
};
use prost::Message as _;
use rankscope_proto::MAX_ROWS_PER_BATCH;
use rankscope_proto::v1::agent_message::Kind;
use rankscope_proto::v1::{AgentMessage, Batch, Hello, RecordingMode};

use crate::grpc;
use crate::intake::{Admission, Intake};
use crate::store;
use crate::table::{self, Table};
use crate::validate::{self, Invalid};
use crate::wire::{self, DecodedBatch, Message};

/// The run a fuzzed batch is filed under (a Hello precedes it on a real stream).
const RUN_ID: &str = "fuzz";
/// The rank it is filed under.
const RANK: u32 = 0;
/// Small row groups, so multi-group files are exercised too.
const ROW_GROUP_ROWS: usize = 64;

/// What the collector made of one message.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Not a protobuf of the expected message: the stream would end.
    Undecodable,
    /// An `AgentMessage` with no kind: refused (neither Hello nor Batch).
    Empty,
    /// Refused by validation, with the message the agent would read.
    Refused(String),
    /// A valid Hello.
    Hello,
    /// A batch that passed validation and the seq check, and became `files`
    /// Parquet files (one per table it has rows for) holding `rows` rows.
    Batch { rows: usize, files: usize },
}

/// The full path of one `AgentMessage` payload.
pub fn agent_message(bytes: &[u8]) -> Outcome {
    let reference = AgentMessage::decode(bytes);
    match grpc::decode_agent_message(bytes) {
        Err(status) if status.code() == tonic::Code::InvalidArgument => {
            Outcome::Refused(status.message().to_string())
        }
        Err(status) => {
            assert!(
                reference.is_err(),
                "refused ({}) what prost decodes: {reference:?}",
                status.message()
            );
            Outcome::Undecodable
        }
        Ok(decoded) => {
            let reference =
                reference.unwrap_or_else(|e| panic!("decoded what prost refuses ({e})"));
            match (decoded, reference.kind) {
                (Message::Empty, None) => Outcome::Empty,
                (Message::Hello(h), Some(Kind::Hello(reference))) => {
                    assert_eq!(h, reference);
                    check_hello(&h)
                }
                (Message::Batch(b), Some(Kind::Batch(reference))) => {
                    // The bound holds only if the wire count never falls short
                    // of the rows decoded.
                    let on_wire = grpc::batch_rows_on_wire(bytes).expect("decoded, so walkable");
                    assert!(
                        on_wire >= b.total_rows(),
                        "{on_wire} rows counted, {} decoded",
                        b.total_rows()
                    );
                    check_batch(b, &reference)
                }
                (decoded, reference) => {
                    panic!("decoded {decoded:?}, prost decoded {reference:?}")
                }
            }
        }
    }
}

/// A `Hello` payload: decode and validation.
pub fn hello(bytes: &[u8]) -> Outcome {
    match Hello::decode(bytes) {
        Err(_) => Outcome::Undecodable,
        Ok(h) => check_hello(&h),
    }
}

/// A `Batch` payload: decode (compared with prost's), validation, seq check, Arrow
/// and Parquet.
pub fn batch(bytes: &[u8]) -> Outcome {
    let capacity = [0; Table::ALL.len()];
    match (wire::decode_batch(bytes, &capacity), Batch::decode(bytes)) {
        (Err(_), Err(_)) => Outcome::Undecodable,
        (Ok(b), Ok(reference)) => check_batch(b, &reference),
        (ours, prost) => panic!("the reader and prost disagree: {ours:?} against {prost:?}"),
    }
}

fn check_hello(h: &Hello) -> Outcome {
    match validate::hello(h) {
        Ok(()) => Outcome::Hello,
        Err(invalid) => refused(invalid),
    }
}

fn refused(invalid: Invalid) -> Outcome {
    let message = invalid.to_string();
    assert!(!message.is_empty(), "every refusal explains itself");
    Outcome::Refused(message)
}

/// The rest of a stream's path for a decoded batch, checked against `reference`,
/// prost's decoding of the same bytes.
fn check_batch(b: DecodedBatch, reference: &Batch) -> Outcome {
    if reference.rows() > MAX_ROWS_PER_BATCH {
        // Refused on the wire count before decoding on a stream; a bare Batch
        // payload is refused here.
        return refused(Invalid::TooManyRows(reference.rows()));
    }
    // `layer_columns` entries read as rows, as the protocol defines them; an
    // entry that cannot be is the batch's refusal.
    let mut reference = reference.clone();
    if let Err(e) = reference.layers_as_rows() {
        let invalid = Invalid::Columns(e);
        assert_eq!(
            b.invalid(),
            Some(&invalid),
            "the reader finds the broken entry"
        );
        return refused(invalid);
    }
    let reference = &reference;
    assert_eq!(
        validate::batch(reference).err().as_ref(),
        b.invalid(),
        "the reader's checks are validate::batch's"
    );
    for table in Table::ALL {
        assert_eq!(
            b.rows(table),
            reference.table_rows(table),
            "{}",
            table.name()
        );
    }
    if let Some(invalid) = b.invalid() {
        return refused(invalid.clone());
    }
    let rows = b.total_rows();
    let records = b.finish(RUN_ID, RANK);
    assert_eq!(
        records.tables,
        reference_records(reference, RUN_ID, RANK),
        "the reader's columns are prost's values"
    );
    let intake = Intake::new(HashMap::new(), usize::MAX);
    let key = (RUN_ID.to_string(), RANK);
    match intake.admit(&key, Default::default(), records) {
        Err(seq) => return Outcome::Refused(seq.to_string()),
        Ok(Admission::Accepted) => {}
        Ok(other) => unreachable!("a first batch into an unbounded buffer: {other:?}"),
    }
    let pending = intake.take_pending();
    assert_eq!(pending.rows(), rows, "every row of the batch is buffered");
    let mut files = 0;
    let mut encoded_rows = 0;
    for (table, _run_id, group) in pending.groups() {
        let converted: usize = group.batches().iter().map(|b| b.num_rows()).sum();
        assert_eq!(converted, group.rows());
        let parquet =
            store::writer::encode_parquet(Vec::new(), table, group.batches(), ROW_GROUP_ROWS)
                .unwrap_or_else(|e| panic!("{} rows do not encode: {e}", table.name()));
        assert!(parquet.starts_with(b"PAR1") && parquet.ends_with(b"PAR1"));
        files += 1;
        encoded_rows += group.rows();
    }
    assert_eq!(encoded_rows, rows, "every row reaches a file");
    Outcome::Batch { rows, files }
}

/// prost's rows of `batch`, converted to Arrow field by field from the generated
/// structs: the reference the [`wire`] reader's columns are compared with. One
/// record batch per table with rows, in [`Table::ALL`] order, as
/// `DecodedBatch::finish` makes them.
pub fn reference_records(batch: &Batch, run_id: &str, rank: u32) -> Vec<(Table, RecordBatch)> {
    let seq = batch.seq;
    let mut out = Vec::new();
    for table in Table::ALL {
        if batch.table_rows(table) == 0 {
            continue;
        }
        let mut cols = Columns::default();
        match table {
            Table::Runs => {
                let rows = &batch.runs;
                cols.head(run_id, rank, seq, rows.len());
                cols.time(rows, |r| Some(r.started_at));
                cols.u32(rows, |r| Some(r.world_size));
                cols.str(rows, |r| mode_label(r.mode));
                cols.u32(rows, |r| Some(r.sample_every));
                cols.u32(rows, |r| Some(r.max_rows));
                cols.bool(rows, |r| r.centered);
                cols.str(rows, |r| &r.layer_filter);
                cols.str(rows, |r| &r.agent_version);
                cols.str(rows, |r| &r.workload);
                cols.f64(rows, |r| r.overhead_budget);
            }
            Table::Ranks => {
                let rows = &batch.ranks;
                cols.head(run_id, rank, seq, rows.len());
                cols.u32(rows, |r| Some(r.local_rank));
                cols.u32(rows, |r| Some(r.node_rank));
                cols.u32(rows, |r| Some(r.world_size));
                cols.str(rows, |r| &r.hostname);
                cols.u32(rows, |r| Some(r.pid));
                cols.str(rows, |r| mode_label(r.mode));
                cols.time(rows, |r| Some(r.started_at));
                cols.time(rows, |r| r.finished_at);
            }
            Table::Steps => {
                let rows = &batch.steps;
                cols.head(run_id, rank, seq, rows.len());
                cols.u64(rows, |r| Some(r.step));
                cols.time(rows, |r| Some(r.time));
                cols.f64(rows, |r| Some(r.step_ms));
                cols.f64(rows, |r| r.data_ms);
                cols.f64(rows, |r| r.forward_ms);
                cols.f64(rows, |r| r.backward_ms);
                cols.f64(rows, |r| r.optimizer_ms);
                cols.f64(rows, |r| r.loss);
                cols.f64(rows, |r| r.grad_norm);
                cols.f64(rows, |r| r.lr);
                cols.u64(rows, |r| r.samples);
                cols.f64(rows, |r| r.comm_ms);
                cols.f64(rows, |r| Some(r.overhead_ms));
                cols.f64(rows, |r| r.overhead_device_ms);
                cols.f64(rows, |r| r.overhead_observed_ms);
                cols.u64(rows, |r| r.rss_bytes);
                cols.u64(rows, |r| r.device_allocated_bytes);
                cols.u64(rows, |r| r.device_reserved_bytes);
                cols.u64(rows, |r| r.device_peak_bytes);
            }
            Table::Layers => {
                let rows = &batch.layers;
                cols.head(run_id, rank, seq, rows.len());
                cols.u64(rows, |r| Some(r.step));
                cols.time(rows, |r| Some(r.time));
                cols.str(rows, |r| &r.layer);
                cols.u32(rows, |r| Some(r.rows));
                cols.u32(rows, |r| Some(r.cols));
                cols.bool(rows, |r| r.centered);
                cols.str(rows, |r| &r.conv_layout);
                cols.str(rows, |r| &r.method);
                cols.f32(rows, |r| r.stable_rank);
                cols.f32(rows, |r| r.participation_ratio);
                cols.f32(rows, |r| r.participation_ratio_sv);
                cols.u32(rows, |r| r.cum_energy_90);
                cols.f32(rows, |r| r.nuclear_norm_ratio);
                cols.f32(rows, |r| r.effective_rank);
                cols.f32(rows, |r| r.stable_rank_err);
                cols.f32(rows, |r| r.participation_ratio_err);
                cols.f32(rows, |r| r.participation_ratio_sv_err);
                cols.f32(rows, |r| r.cum_energy_90_err);
                cols.f32(rows, |r| r.nuclear_norm_ratio_err);
                cols.f32(rows, |r| r.effective_rank_err);
                cols.f32(rows, |r| r.mean);
                cols.f32(rows, |r| r.std);
                cols.f32(rows, |r| r.zero_fraction);
                cols.u64(rows, |r| Some(r.nonfinite));
                cols.f32(rows, |r| Some(r.compute_ms));
            }
            Table::Model => {
                let rows = &batch.model;
                cols.head(run_id, rank, seq, rows.len());
                cols.str(rows, |r| &r.layer);
                cols.str(rows, |r| &r.kind);
                cols.u64(rows, |r| Some(r.params));
                cols.u64(rows, |r| Some(r.param_bytes));
                cols.u64(rows, |r| Some(r.grad_bytes));
                cols.u64(rows, |r| Some(r.optimizer_bytes));
                cols.u64(rows, |r| Some(r.forward_flops));
                cols.str(rows, |r| &r.output_shape);
            }
            Table::Events => {
                let rows = &batch.events;
                cols.head(run_id, rank, seq, rows.len());
                cols.time(rows, |r| Some(r.time));
                cols.str(rows, |r| &r.kind);
                cols.str(rows, |r| &r.message);
                cols.i64(rows, |r| r.value);
                cols.u64(rows, |r| r.step);
            }
            Table::Comm => {
                let rows = &batch.comm;
                cols.head(run_id, rank, seq, rows.len());
                cols.u64(rows, |r| r.step);
                cols.time(rows, |r| Some(r.time));
                cols.str(rows, |r| &r.kind);
                cols.u64(rows, |r| Some(r.count));
                cols.u64(rows, |r| Some(r.bytes));
                cols.f64(rows, |r| Some(r.comm_ms));
            }
        }
        let record_batch = RecordBatch::try_new(table::schema(table), cols.0)
            .unwrap_or_else(|e| panic!("the reference columns of {}: {e}", table.name()));
        out.push((table, record_batch));
    }
    out
}

fn mode_label(mode: i32) -> &'static str {
    RecordingMode::try_from(mode).map_or("unknown", RecordingMode::label)
}

/// The reference's columns, in the order they are added.
#[derive(Default)]
struct Columns(Vec<ArrayRef>);

impl Columns {
    fn head(&mut self, run_id: &str, rank: u32, seq: u64, n: usize) {
        let run: StringArray = std::iter::repeat_n(Some(run_id), n).collect();
        self.0.push(Arc::new(run));
        self.0.push(Arc::new(UInt32Array::from(vec![rank; n])));
        self.0.push(Arc::new(UInt64Array::from(vec![seq; n])));
    }

    fn f64<R>(&mut self, rows: &[R], f: impl Fn(&R) -> Option<f64>) {
        self.0
            .push(Arc::new(rows.iter().map(f).collect::<Float64Array>()));
    }

    /// A `double` field stored as float32: rounded to nearest, as `table` does.
    fn f32<R>(&mut self, rows: &[R], f: impl Fn(&R) -> Option<f64>) {
        self.0.push(Arc::new(
            rows.iter()
                .map(|r| f(r).map(|v| v as f32))
                .collect::<Float32Array>(),
        ));
    }

    fn u64<R>(&mut self, rows: &[R], f: impl Fn(&R) -> Option<u64>) {
        self.0
            .push(Arc::new(rows.iter().map(f).collect::<UInt64Array>()));
    }

    fn i64<R>(&mut self, rows: &[R], f: impl Fn(&R) -> Option<i64>) {
        self.0
            .push(Arc::new(rows.iter().map(f).collect::<Int64Array>()));
    }

    fn u32<R>(&mut self, rows: &[R], f: impl Fn(&R) -> Option<u32>) {
        self.0
            .push(Arc::new(rows.iter().map(f).collect::<UInt32Array>()));
    }

    fn bool<R>(&mut self, rows: &[R], f: impl Fn(&R) -> bool) {
        let a: BooleanArray = rows.iter().map(|r| Some(f(r))).collect();
        self.0.push(Arc::new(a));
    }

    fn str<R>(&mut self, rows: &[R], f: impl Fn(&R) -> &str) {
        let a: StringArray = rows.iter().map(|r| Some(f(r))).collect();
        self.0.push(Arc::new(a));
    }

    fn time<R>(&mut self, rows: &[R], f: impl Fn(&R) -> Option<i64>) {
        let a: TimestampMicrosecondArray = rows.iter().map(f).collect();
        self.0.push(Arc::new(a.with_timezone("UTC")));
    }
}

#[cfg(test)]
mod tests {
    //! The fuzz targets' contract, exercised on stable Rust with a fixed seed:
    //! random bytes, and valid messages mutated the way a fuzzer mutates them.

    use super::*;
    use rankscope_proto::v1::{
        CommRow, EventRow, LayerColumns, LayerRow, ModelRow, RankRow, RunRow, StepRow,
    };

    /// Seeded, so a failure reproduces.
    struct Rng(rand::rngs::StdRng);

    impl Rng {
        fn new(seed: u64) -> Rng {
            Rng(rand::SeedableRng::seed_from_u64(seed))
        }

        fn next(&mut self) -> u64 {
            rand::Rng::random(&mut self.0)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }

        fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next() as u8).collect()
        }
    }

    fn valid_hello() -> AgentMessage {
        AgentMessage {
            kind: Some(Kind::Hello(Hello {
                run_id: "run-1".into(),
                rank: 1,
                world_size: 4,
                hostname: "node-0".into(),
                schema_major: rankscope_proto::SCHEMA_MAJOR,
                agent_version: "0.1.0".into(),
                ..Default::default()
            })),
        }
    }

    /// A batch with rows in every table and awkward floats.
    fn valid_batch(seq: u64) -> AgentMessage {
        let floats = [f64::NAN, f64::INFINITY, -0.0, f64::MIN_POSITIVE, 1e308];
        AgentMessage {
            kind: Some(Kind::Batch(Batch {
                seq,
                r#final: seq.is_multiple_of(2),
                dropped_from: 0,
                steps: floats
                    .iter()
                    .enumerate()
                    .map(|(i, &x)| StepRow {
                        step: i as u64,
                        step_ms: x,
                        loss: Some(x),
                        rss_bytes: Some(u64::MAX),
                        ..Default::default()
                    })
                    .collect(),
                layers: vec![LayerRow {
                    layer: "encoder.layers.0.attn.层".into(),
                    stable_rank: Some(f64::NEG_INFINITY),
                    conv_layout: "channelwise".into(),
                    ..Default::default()
                }],
                // Two more as columns, as this agent sends them.
                layer_columns: vec![LayerColumns::from_rows(
                    floats[..2]
                        .iter()
                        .map(|&x| LayerRow {
                            layer: "encoder.layers.1.层".into(),
                            stable_rank: Some(x),
                            method: "sketch".into(),
                            stable_rank_err: Some(x),
                            ..Default::default()
                        })
                        .collect(),
                )],
                runs: vec![RunRow {
                    mode: 99,
                    workload: "mlp".into(),
                    overhead_budget: Some(f64::NAN),
                    ..Default::default()
                }],
                ranks: vec![RankRow {
                    finished_at: Some(i64::MIN),
                    ..Default::default()
                }],
                model: vec![ModelRow {
                    layer: "fc".into(),
                    output_shape: "[8, 16]".into(),
                    ..Default::default()
                }],
                events: vec![EventRow {
                    kind: "rows_dropped".into(),
                    message: "é".repeat(100),
                    value: Some(-1),
                    ..Default::default()
                }],
                comm: vec![CommRow {
                    step: Some(3),
                    kind: "reduce_scatter".into(),
                    count: 2,
                    bytes: u64::MAX,
                    comm_ms: f64::NAN,
                    ..Default::default()
                }],
            })),
        }
    }

    /// One fuzzer-style mutation of `input`.
    fn mutate(rng: &mut Rng, input: &mut Vec<u8>) {
        let len = input.len();
        match rng.below(7) {
            0 if len > 0 => input[rng.below(len)] ^= 1 << rng.below(8),
            1 if len > 0 => input[rng.below(len)] = rng.next() as u8,
            2 => {
                let at = rng.below(len + 1);
                let n = 1 + rng.below(8);
                let extra = rng.bytes(n);
                input.splice(at..at, extra);
            }
            3 => input.truncate(rng.below(len + 1)),
            4 if len > 0 => {
                // Repeat a slice: repeated fields, duplicated tags.
                let start = rng.below(len);
                let end = start + rng.below(len - start) + 1;
                let chunk = input[start..end].to_vec();
                let at = rng.below(len + 1);
                input.splice(at..at, chunk);
            }
            5 if len > 0 => {
                // An "interesting" varint byte where a length or tag was.
                let at = rng.below(len);
                input[at] = [0x00, 0x7f, 0x80, 0xff, 0x0a, 0x12][rng.below(6)];
            }
            _ if len > 0 => {
                // Flip a bit in the second half, where a batch's later rows are.
                let at = len / 2 + rng.below(len - len / 2);
                input[at] ^= 1 << rng.below(8);
            }
            _ => {}
        }
    }

    #[test]
    fn valid_messages_pass_the_whole_path() {
        assert_eq!(
            agent_message(&valid_hello().encode_to_vec()),
            Outcome::Hello
        );
        assert_eq!(
            agent_message(&valid_batch(1).encode_to_vec()),
            Outcome::Batch { rows: 13, files: 7 }
        );
        assert!(matches!(
            agent_message(&valid_batch(0).encode_to_vec()),
            Outcome::Refused(m) if m.contains("start at 1")
        ));
        assert_eq!(agent_message(&[]), Outcome::Empty);
        assert_eq!(agent_message(&[0xff, 0xff]), Outcome::Undecodable);
    }

    #[test]
    fn an_explicit_negative_zero_keeps_its_sign_through_the_reader() {
        // StepRow.step_ms (field 3, fixed64) = -0.0, as spec-conforming encoders
        // send it (prost's own encoder drops it: tokio-rs/prost#1177).
        let mut row = vec![0x19];
        row.extend_from_slice(&(-0.0f64).to_bits().to_le_bytes());
        let mut bytes = vec![0x08, 0x01, 0x1a, row.len() as u8];
        bytes.extend_from_slice(&row);
        let decoded = Batch::decode(&bytes[..]).unwrap();
        assert!(decoded.steps[0].step_ms.is_sign_negative());
        let decoded = wire::decode_batch(&bytes, &[0; Table::ALL.len()]).unwrap();
        let records = decoded.finish(RUN_ID, 0);
        let (table, record_batch) = &records.tables[0];
        assert_eq!(*table, Table::Steps);
        let step_ms = record_batch
            .column_by_name("step_ms")
            .unwrap()
            .as_any()
            .downcast_ref::<arrow::array::Float64Array>()
            .unwrap();
        assert_eq!(step_ms.value(0).to_bits(), (-0.0f64).to_bits());
        assert_eq!(batch(&bytes), Outcome::Batch { rows: 1, files: 1 });
    }

    #[test]
    fn thousands_of_random_and_mutated_messages_never_panic() {
        let mut rng = Rng::new(0x5eed_0f4a_11da_7a00);
        let inner = |m: AgentMessage| match m.kind {
            Some(Kind::Hello(h)) => h.encode_to_vec(),
            Some(Kind::Batch(b)) => b.encode_to_vec(),
            None => Vec::new(),
        };
        type Target = fn(&[u8]) -> Outcome;
        let targets: [(Target, Vec<Vec<u8>>); 3] = [
            (
                agent_message,
                vec![
                    valid_hello().encode_to_vec(),
                    valid_batch(1).encode_to_vec(),
                    valid_batch(7).encode_to_vec(),
                ],
            ),
            (hello, vec![inner(valid_hello())]),
            (batch, vec![inner(valid_batch(1)), inner(valid_batch(2))]),
        ];
        let mut seen: HashMap<&'static str, usize> = HashMap::new();
        for (target, seeds) in &targets {
            for i in 0..1500 {
                let input = if i % 5 == 0 {
                    let len = rng.below(256);
                    rng.bytes(len)
                } else {
                    let mut input = seeds[rng.below(seeds.len())].clone();
                    for _ in 0..1 + rng.below(2) {
                        mutate(&mut rng, &mut input);
                    }
                    input
                };
                let name = match target(&input) {
                    Outcome::Undecodable => "undecodable",
                    Outcome::Empty => "empty",
                    Outcome::Refused(_) => "refused",
                    Outcome::Hello => "hello",
                    Outcome::Batch { .. } => "batch",
                };
                *seen.entry(name).or_default() += 1;
            }
        }
        eprintln!("{seen:?}");
        // The mix proves the mutations reach every stage, not just the decoder.
        for outcome in ["undecodable", "refused", "hello", "batch"] {
            assert!(
                seen.get(outcome).copied().unwrap_or(0) > 100,
                "too few {outcome} outcomes to trust the mix: {seen:?}"
            );
        }
    }
}
