//! The gRPC service: one task per rank stream, from Hello to the last Ack.
//!
//! A stream is refused with a clear status when its Hello is wrong
//! (`FAILED_PRECONDITION` for an unknown schema major, `INVALID_ARGUMENT` for a bad
//! run id or rank), when its bytes are not rankscope.v1 messages or a batch breaks a
//! limit (`INVALID_ARGUMENT`), when too many streams are open or the output
//! filesystem is below `--min-free-bytes` (`RESOURCE_EXHAUSTED`). A full buffer
//! (the disk cannot keep up or is failing) answers `UNAVAILABLE`. Agents keep
//! unacknowledged batches and resend them after any of these. One stream's failure
//! ends that stream only.
//!
//! It counts into [`crate::counters`] and watches [`crate::phase`], both below it;
//! `ops` reads the counters, so it never imports the service.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::Stream;
use rankscope_proto::v1::collector_message::Kind as CollectorKind;
use rankscope_proto::v1::{Ack, CollectorMessage, Hello, Welcome};
use tokio::sync::{mpsc, watch};
use tonic::{Request, Response, Status, Streaming};

use crate::buffer::RankKey;
use crate::counters::{BatchRows, Refusal, StreamCounters};
use crate::grpc::{ReadEnd, StreamService, Undecoded};
use crate::intake::{self, Admission, Intake, OnStream};
use crate::live::LiveView;
use crate::phase::{Phase, until};
use crate::sequence::SeqError;
use crate::sink::Sink;
use crate::space::SpaceGuard;
use crate::validate::{self, Invalid};
use crate::wire::{DecodedBatch, Message};

/// How long a new stream may take to send its Hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a batch waits for room in a full buffer before the stream is told to retry.
const FULL_WAIT: Duration = Duration::from_secs(10);

/// The `rankscope.v1.Collector` service.
#[derive(Debug, Clone)]
pub struct CollectorService {
    intake: Arc<Intake>,
    space: Arc<SpaceGuard>,
    phase: watch::Receiver<Phase>,
    open_streams: Arc<AtomicUsize>,
    max_streams: usize,
    counters: Arc<StreamCounters>,
    /// Fed with every accepted batch; `None` with `--live-steps 0`.
    live: Option<Arc<LiveView>>,
    /// Asked for the durable watermark of a rank the intake does not know yet
    /// (a Delta output keeps them in its log).
    sink: Option<Arc<Sink>>,
}

impl CollectorService {
    pub fn new(
        intake: Arc<Intake>,
        space: Arc<SpaceGuard>,
        phase: watch::Receiver<Phase>,
        max_streams: usize,
        counters: Arc<StreamCounters>,
    ) -> CollectorService {
        CollectorService {
            intake,
            space,
            phase,
            open_streams: Arc::new(AtomicUsize::new(0)),
            max_streams,
            counters,
            live: None,
            sink: None,
        }
    }

    /// Looks the durable watermark of each new rank up in `sink`.
    pub fn with_sink(mut self, sink: Arc<Sink>) -> CollectorService {
        self.sink = Some(sink);
        self
    }

    /// Feeds `live` with every batch accepted from now on.
    pub fn with_live(mut self, live: Option<Arc<LiveView>>) -> CollectorService {
        self.live = live;
        self
    }

    /// The number of streams open now (for `/metrics`).
    pub fn open_streams(&self) -> Arc<AtomicUsize> {
        self.open_streams.clone()
    }
}

/// Frees a stream slot when the stream task ends.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What one open stream takes of the memory bound ([`intake::stream_bytes`] of
/// its largest message so far), counted while it is open.
struct StreamMemory {
    intake: Arc<Intake>,
    largest: usize,
}

impl StreamMemory {
    fn open(intake: Arc<Intake>) -> StreamMemory {
        intake.resize_stream(0, intake::stream_bytes(0));
        StreamMemory { intake, largest: 0 }
    }

    /// Counts a message of `len` bytes.
    fn message(&mut self, len: usize) {
        if len > self.largest {
            self.intake.resize_stream(
                intake::stream_bytes(self.largest),
                intake::stream_bytes(len),
            );
            self.largest = len;
        }
    }
}

impl Drop for StreamMemory {
    fn drop(&mut self) {
        self.intake
            .resize_stream(intake::stream_bytes(self.largest), 0);
    }
}

fn refuse(invalid: Invalid) -> Status {
    match invalid {
        Invalid::Schema(_) => Status::failed_precondition(invalid.to_string()),
        _ => Status::invalid_argument(invalid.to_string()),
    }
}

/// Why reading the agent's side of a stream failed with `status`, if it was a
/// refusal or the agent going away ([`ReadEnd`]; otherwise from its code).
fn read_refusal(status: &Status) -> Option<Refusal> {
    match ReadEnd::of(status) {
        Some(ReadEnd::Disconnected) => Some(Refusal::Disconnected),
        Some(ReadEnd::MessageTimeout) => Some(Refusal::MessageTimeout),
        None => Refusal::of_read_error(status.code()),
    }
}

/// The status for a failure to read the agent's side of the stream. tonic reports
/// bytes that do not decode (not protobuf, a truncated or flagged frame) as
/// `INTERNAL`, the gRPC convention for library-made parse errors; the fault is the
/// sender's, so the collector answers `INVALID_ARGUMENT` and says so.
fn from_agent(status: Status) -> Status {
    if status.code() == tonic::Code::Internal && ReadEnd::of(&status).is_none() {
        Status::invalid_argument(format!(
            "malformed message from the agent ({}): send rankscope.v1 AgentMessage protobufs in gRPC frames",
            status.message()
        ))
    } else {
        status
    }
}

type Outbound = Pin<Box<dyn Stream<Item = Result<CollectorMessage, Status>> + Send>>;

#[tonic::async_trait]
impl StreamService for CollectorService {
    type Outbound = Outbound;

    async fn stream(
        &self,
        request: Request<Streaming<Undecoded>>,
    ) -> Result<Response<Outbound>, Status> {
        if *self.phase.borrow() != Phase::Serving {
            self.counters.refuse(Refusal::ShuttingDown);
            return Err(Status::unavailable(
                "collector is shutting down; retry later",
            ));
        }
        let open = self.open_streams.fetch_add(1, Ordering::Relaxed) + 1;
        let slot = Slot(self.open_streams.clone());
        if open > self.max_streams {
            self.counters.refuse(Refusal::TooManyStreams);
            return Err(Status::resource_exhausted(format!(
                "too many streams: {} are open (limit {}); raise --max-streams",
                open - 1,
                self.max_streams
            )));
        }
        let mut memory = StreamMemory::open(self.intake.clone());
        let mut inbound = request.into_inner();
        let first = tokio::time::timeout(HELLO_TIMEOUT, inbound.message())
            .await
            .map(|read| {
                read.and_then(|m| {
                    m.map(|m| {
                        memory.message(m.encoded_len());
                        m.decode()
                    })
                    .transpose()
                })
            });
        let hello = match first {
            Err(_) => {
                self.counters.refuse(Refusal::NoHello);
                return Err(Status::deadline_exceeded("no Hello within 10 s"));
            }
            Ok(Err(status)) => {
                if let Some(reason) = read_refusal(&status) {
                    self.counters.refuse(reason);
                }
                return Err(from_agent(status));
            }
            Ok(Ok(Some(Message::Hello(hello)))) => hello,
            Ok(Ok(_)) => {
                self.counters.refuse(Refusal::Malformed);
                return Err(Status::invalid_argument(
                    "the first message of a stream must be a Hello",
                ));
            }
        };
        if let Err(invalid) = validate::hello(&hello) {
            self.counters.refuse(match invalid {
                Invalid::Schema(_) => Refusal::Schema,
                _ => Refusal::Invalid,
            });
            tracing::warn!(error = %invalid, "refused stream");
            return Err(refuse(invalid));
        }
        let key = (hello.run_id.clone(), hello.rank);
        if let Some(sink) = self.sink.as_ref().filter(|_| !self.intake.knows(&key)) {
            match sink.durable(&key).await {
                Ok(Some(seq)) => self.intake.learn(&key, seq),
                Ok(None) => {}
                Err(error) => {
                    tracing::error!(%error, run_id = %key.0, rank = key.1, "cannot read the durable watermark");
                    return Err(Status::unavailable(format!(
                        "the collector cannot read the durable watermark of this rank from its output: {error}; retry later"
                    )));
                }
            }
        }
        let (generation, durable) = match self.intake.attach(&hello) {
            Ok(attached) => attached,
            Err(claimed) => {
                self.counters.refuse(Refusal::Claimed);
                tracing::warn!(error = %claimed, "refused stream");
                return Err(Status::failed_precondition(claimed.to_string()));
            }
        };
        self.counters.streams.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(16);
        let welcome = CollectorMessage {
            kind: Some(CollectorKind::Welcome(Welcome {
                durable_seq: *durable.borrow(),
                collector_version: env!("CARGO_PKG_VERSION").to_string(),
                schema_minor: rankscope_proto::SCHEMA_MINOR,
            })),
        };
        tx.send(Ok(welcome))
            .await
            .map_err(|_| Status::cancelled("stream closed"))?;
        tracing::debug!(run_id = %hello.run_id, rank = hello.rank, "stream opened");
        if let Some(live) = &self.live {
            live.hello(&hello);
        }
        let task = StreamTask {
            live: self.live.clone(),
            intake: self.intake.clone(),
            space: self.space.clone(),
            counters: self.counters.clone(),
            key: (hello.run_id.clone(), hello.rank),
            tx,
            durable,
            phase: self.phase.clone(),
            memory,
            generation,
            last_seq: 0,
            finished: false,
        };
        tokio::spawn(async move {
            let _slot = slot;
            task.run(inbound, hello).await;
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

struct StreamTask {
    live: Option<Arc<LiveView>>,
    intake: Arc<Intake>,
    space: Arc<SpaceGuard>,
    counters: Arc<StreamCounters>,
    key: RankKey,
    tx: mpsc::Sender<Result<CollectorMessage, Status>>,
    durable: watch::Receiver<u64>,
    phase: watch::Receiver<Phase>,
    memory: StreamMemory,
    /// The generation `Intake::attach` gave this stream (a newer stream of the same
    /// process takes the rank over).
    generation: u64,
    /// Highest seq this stream delivered (accepted or duplicate).
    last_seq: u64,
    finished: bool,
}

impl StreamTask {
    async fn run(mut self, mut inbound: Streaming<Undecoded>, hello: Hello) {
        let end = self.read(&mut inbound).await;
        // Deliver the acks this stream is owed, unless it failed or went away.
        let status = match end {
            Ok(()) => self.await_durable().await,
            Err(status) => Some(status),
        };
        if let Some(status) = status {
            tracing::debug!(run_id = %hello.run_id, rank = hello.rank, %status, "stream ended");
            let _ = self.tx.send(Err(status)).await;
        }
        self.intake.detach(&self.key, self.finished);
    }

    /// Reads batches until the agent closes its side, the collector drains, or an error.
    async fn read(&mut self, inbound: &mut Streaming<Undecoded>) -> Result<(), Status> {
        enum Next {
            Message(Result<Option<Undecoded>, Status>),
            Durable,
            Drain,
        }
        loop {
            let mut phase = self.phase.clone();
            let next = tokio::select! {
                message = inbound.message() => Next::Message(message),
                changed = self.durable.changed() => match changed {
                    Ok(()) => Next::Durable,
                    Err(_) => Next::Drain,
                },
                _ = until(&mut phase, |p| p != Phase::Serving) => Next::Drain,
            };
            match next {
                Next::Message(message) => match message.map_err(|s| self.refused(s))? {
                    None => return Ok(()),
                    Some(undecoded) => self.message(undecoded).await?,
                },
                Next::Durable => self.ack().await.map_err(|gone| self.refused(gone))?,
                Next::Drain => return Ok(()),
            }
        }
    }

    /// Decodes and takes in one message, once there is room for its rows.
    async fn message(&mut self, undecoded: Undecoded) -> Result<(), Status> {
        self.memory.message(undecoded.encoded_len());
        let room = tokio::time::timeout(
            FULL_WAIT,
            self.intake.decode_room(undecoded.decoded_bytes()),
        )
        .await
        .map_err(|_| self.buffer_full())?;
        let message = undecoded.decode().map_err(|s| self.refused(s))?;
        let result = match message {
            Message::Batch(batch) => self.batch(batch).await,
            _ => {
                self.counters.refuse(Refusal::Malformed);
                Err(Status::invalid_argument(
                    "expected a Batch: a stream carries one Hello, first",
                ))
            }
        };
        // The rows are in the buffer now (or refused): the room goes back.
        drop(room);
        result
    }

    /// The status for a batch that found no room for [`FULL_WAIT`].
    fn buffer_full(&self) -> Status {
        self.counters.refuse(Refusal::BufferFull);
        Status::unavailable(
            "collector buffer is full because commits are failing or slow (see its log); resend later",
        )
    }

    /// Counts a failure to read what the agent sent (a disconnect too, unless the
    /// agent had sent its final batch: then going away is how it ends), and words
    /// it for the agent ([`from_agent`]).
    fn refused(&self, status: Status) -> Status {
        match read_refusal(&status) {
            Some(Refusal::Disconnected) if self.finished => {}
            Some(reason) => self.counters.refuse(reason),
            None => {}
        }
        from_agent(status)
    }

    async fn batch(&mut self, batch: DecodedBatch) -> Result<(), Status> {
        if let Some(invalid) = batch.invalid() {
            self.counters.refuse(Refusal::Invalid);
            return Err(refuse(invalid.clone()));
        }
        self.space.check().map_err(|low| {
            self.counters.refuse(Refusal::LowDisk);
            Status::resource_exhausted(low.to_string())
        })?;
        let (seq, is_final) = (batch.seq, batch.is_final);
        let rows = BatchRows::of(&batch);
        let mut waited = Duration::ZERO;
        let mut batch = batch.finish(&self.key.0, self.key.1);
        // The live view reads the same record batches (shared, not copied)
        // once the batch is accepted.
        let for_live = self.live.as_ref().map(|_| batch.tables.clone());
        loop {
            let stream = OnStream {
                generation: self.generation,
                last_seq: self.last_seq,
            };
            let admission = self
                .intake
                .admit(&self.key, stream, batch)
                .map_err(|e| match e {
                    SeqError::Superseded { .. } => {
                        self.counters.refuse(Refusal::Superseded);
                        Status::aborted(e.to_string())
                    }
                    _ => {
                        self.counters.refuse(Refusal::Invalid);
                        Status::invalid_argument(e.to_string())
                    }
                })?;
            match admission {
                Admission::Accepted => {
                    self.counters.batches.fetch_add(1, Ordering::Relaxed);
                    self.counters.rows.add(&self.key.0, rows);
                    if let (Some(live), Some(tables)) = (&self.live, &for_live) {
                        live.record(&self.key.0, self.key.1, tables);
                    }
                    break;
                }
                Admission::Duplicate => {
                    self.counters.duplicates.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Admission::Full(_) if waited >= FULL_WAIT => return Err(self.buffer_full()),
                Admission::Full(back) => {
                    batch = back;
                    let step = Duration::from_millis(200);
                    let _ = tokio::time::timeout(step, self.intake.committed.notified()).await;
                    waited += step;
                }
            }
        }
        self.last_seq = self.last_seq.max(seq);
        if is_final {
            self.finished = true;
            self.intake.commit_soon.notify_one();
        }
        if *self.durable.borrow() >= seq {
            // A resend of something already durable: answer at once.
            self.ack().await?;
        }
        Ok(())
    }

    async fn ack(&mut self) -> Result<(), Status> {
        let durable_seq = *self.durable.borrow_and_update();
        let ack = CollectorMessage {
            kind: Some(CollectorKind::Ack(Ack { durable_seq })),
        };
        self.tx.send(Ok(ack)).await.map_err(|_| {
            ReadEnd::Disconnected.status(
                tonic::Code::Cancelled,
                "the agent went away: its stream is closed".into(),
            )
        })
    }

    /// After the agent's last batch: forwards acks until all of it is durable or
    /// the collector has drained. Returns the status that ends the stream, if any.
    async fn await_durable(&mut self) -> Option<Status> {
        loop {
            if *self.durable.borrow() >= self.last_seq {
                let _ = self.ack().await;
                return None;
            }
            let mut phase = self.phase.clone();
            let drained = tokio::select! {
                changed = self.durable.changed() => changed.is_err(),
                _ = until(&mut phase, |p| p == Phase::Drained) => true,
            };
            if self.ack().await.is_err() {
                return None;
            }
            if drained {
                return Some(Status::unavailable(
                    "collector is shutting down; resend unacknowledged batches to its next start",
                ));
            }
        }
    }
}
