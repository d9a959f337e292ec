//! The `rankscope.v1.Collector` route, served with a decoder that counts a
//! batch's rows on the wire before anything is allocated for them.
//!
//! Why not tonic's generated `CollectorServer`: it decodes every row of a message
//! before validation can look at it, and an empty row costs 2 bytes on the wire but
//! about 240 in memory as a prost struct. One 16 MiB message of empty rows made
//! the collector allocate about 1.8 GB (measured) before validation refused it; a
//! few such streams at once exhaust memory. The codec first walks the message's
//! wire format (tags and lengths only, nothing allocated) and refuses a batch of
//! more than [`MAX_ROWS_PER_BATCH`] rows with the status validation would give; it
//! hands the stream an [`Undecoded`] message, which the stream decodes
//! ([`crate::wire`], straight into Arrow builders sized from the count) only once
//! it holds room for the rows (so 1,024 streams waiting for room hold encoded
//! bytes, not decoded batches). Bytes whose structure the walk cannot follow are
//! refused as malformed, never decoded. Everything else is what the generated
//! server does: one streaming method, the configured message size limit,
//! `UNIMPLEMENTED` for any other path.
//!
//! Before tonic reads a stream's bytes, [`Metered`] follows its gRPC frames as
//! they pass: a message takes its declared length of the decoding room
//! ([`Room`]) when its 5-byte prefix arrives, before any more of it is read, and
//! gives it back when its last byte is handed on (a message of at most
//! [`ROOMLESS_MESSAGE_BYTES`], or within the read buffer its stream's share
//! counts, takes none). Without room the stream is not
//! read, so HTTP/2 flow control holds the sender. A message still unfinished
//! `--message-timeout` after its first byte ends its stream (`DEADLINE_EXCEEDED`),
//! and a stream that the agent resets, or whose connection closes, ends as a
//! disconnect, not as malformed bytes ([`ReadEnd`]).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use hyper::body::Frame;
use rankscope_proto::MAX_ROWS_PER_BATCH;
use rankscope_proto::columns::LAYER_COLUMNS_FIELD;
use rankscope_proto::v1::CollectorMessage;
use rankscope_proto::v1::collector_server::SERVICE_NAME;
use tokio::time::{Instant, Sleep};
use tonic::codec::{Codec, DecodeBuf, Decoder};
use tonic::codegen::{Body, BoxFuture, Service, StdError, http};
use tonic::server::{Grpc, NamedService, StreamingService};
use tonic::{Request, Response, Status, Streaming};
use tonic_prost::ProstEncoder;

use crate::room::{Room, RoomPermit};
use crate::table::{MAX_ROW_BYTES, Table};
use crate::validate::Invalid;
use crate::wire::{self, Message, TableRows};

/// The gRPC path of the one method.
const STREAM_PATH: &str = "/rankscope.v1.Collector/Stream";
/// Deepest nesting of groups followed (prost's own recursion limit).
const MAX_DEPTH: u32 = 100;

/// Decodes one `AgentMessage` payload as the server does: rows counted first,
/// then [`wire`]. `INVALID_ARGUMENT` for too many rows, `INTERNAL` (tonic's code for
/// undecodable bytes, which the service rewords) for anything malformed.
pub fn decode_agent_message(bytes: &[u8]) -> Result<Message, Status> {
    Undecoded::check(Bytes::copy_from_slice(bytes))?.decode()
}

/// One `AgentMessage` as received: its rows counted on the wire and within
/// [`MAX_ROWS_PER_BATCH`], not yet decoded. The stream decodes it once it holds
/// room for the decoded rows (`service`), so a stream waiting for room holds only
/// the encoded bytes.
#[derive(Debug)]
pub struct Undecoded {
    bytes: Bytes,
    rows: TableRows,
}

impl Undecoded {
    /// Counts the rows of `bytes`; refuses what [`decode_agent_message`] refuses
    /// before decoding.
    pub fn check(bytes: Bytes) -> Result<Undecoded, Status> {
        let rows = table_rows_on_wire(&bytes)
            .map_err(|why| Status::internal(format!("failed to decode Protobuf message: {why}")))?;
        let total = rows.iter().sum();
        if total > MAX_ROWS_PER_BATCH {
            return Err(Status::invalid_argument(
                Invalid::TooManyRows(total).to_string(),
            ));
        }
        Ok(Undecoded { bytes, rows })
    }

    /// Bytes of the encoded message.
    pub fn encoded_len(&self) -> usize {
        self.bytes.len()
    }

    /// An upper estimate of the memory the decoded message takes: every row at
    /// the Arrow size of the widest table's row ([`MAX_ROW_BYTES`]), plus the
    /// encoded bytes (which bound its strings).
    pub fn decoded_bytes(&self) -> usize {
        self.rows.iter().sum::<usize>() * MAX_ROW_BYTES + self.bytes.len()
    }

    /// Decodes the message, its batch into Arrow builders with room for the rows
    /// counted; `INTERNAL` (as tonic words it) for malformed bytes.
    pub fn decode(self) -> Result<Message, Status> {
        wire::decode_agent_message(&self.bytes, &self.rows)
            .map_err(|e| Status::internal(e.to_string()))
    }
}

/// Rows (entries of the `Batch` fields of the tables) in every `batch` (field 2)
/// of an `AgentMessage`'s bytes: occurrences of a message field are merged by
/// decoders, so they add up. A `layer_columns` entry counts as its longest column
/// (or its dictionary, if longer): what its decoding can allocate. `Err` when the
/// wire structure cannot be followed.
pub fn batch_rows_on_wire(bytes: &[u8]) -> Result<usize, &'static str> {
    table_rows_on_wire(bytes).map(|rows| rows.iter().sum())
}

/// [`batch_rows_on_wire`] per table.
fn table_rows_on_wire(bytes: &[u8]) -> Result<TableRows, &'static str> {
    let mut rows = [0; Table::ALL.len()];
    fields(bytes, 0, &mut |field, payload| {
        if field == 2 {
            fields(payload, 0, &mut |field, entry| {
                if field == u64::from(LAYER_COLUMNS_FIELD) {
                    rows[Table::Layers.index()] += wire::columns::rows_on_wire(entry)
                        .map_err(|_| "layer_columns cannot be followed")?;
                } else if let Some(table) =
                    u32::try_from(field).ok().and_then(Table::of_batch_field)
                {
                    rows[table.index()] += 1;
                }
                Ok(())
            })?;
        }
        Ok(())
    })?;
    Ok(rows)
}

type OnField<'a> = dyn FnMut(u64, &[u8]) -> Result<(), &'static str> + 'a;

/// Walks the fields of one message, calling `on_len` with each length-delimited
/// field's number and payload; skips the others (groups included).
fn fields(mut buf: &[u8], depth: u32, on_len: &mut OnField<'_>) -> Result<(), &'static str> {
    while !buf.is_empty() {
        let (field, wire) = tag(&mut buf)?;
        match wire {
            2 => {
                let len = usize::try_from(varint(&mut buf)?).map_err(|_| "length overflow")?;
                let payload = buf.get(..len).ok_or("length past the end")?;
                on_len(field, payload)?;
                buf = &buf[len..];
            }
            3 => skip_group(&mut buf, field, depth + 1)?,
            4 => return Err("unexpected end group"),
            _ => skip_scalar(&mut buf, wire)?,
        }
    }
    Ok(())
}

/// Skips a group's fields up to its end-group tag.
fn skip_group(buf: &mut &[u8], field: u64, depth: u32) -> Result<(), &'static str> {
    if depth > MAX_DEPTH {
        return Err("groups nested too deeply");
    }
    loop {
        let (inner, wire) = tag(buf)?;
        match wire {
            2 => {
                let len = usize::try_from(varint(buf)?).map_err(|_| "length overflow")?;
                *buf = buf.get(len..).ok_or("length past the end")?;
            }
            3 => skip_group(buf, inner, depth + 1)?,
            4 if inner == field => return Ok(()),
            4 => return Err("mismatched end group"),
            _ => skip_scalar(buf, wire)?,
        }
    }
}

fn skip_scalar(buf: &mut &[u8], wire: u64) -> Result<(), &'static str> {
    let width = match wire {
        0 => return varint(buf).map(drop),
        1 => 8,
        5 => 4,
        _ => return Err("invalid wire type"),
    };
    *buf = buf.get(width..).ok_or("value past the end")?;
    Ok(())
}

fn tag(buf: &mut &[u8]) -> Result<(u64, u64), &'static str> {
    let key = varint(buf)?;
    if key > u64::from(u32::MAX) || key >> 3 == 0 {
        return Err("invalid tag");
    }
    Ok((key >> 3, key & 7))
}

fn varint(buf: &mut &[u8]) -> Result<u64, &'static str> {
    let mut value = 0u64;
    for i in 0..10 {
        let (&byte, rest) = buf.split_first().ok_or("varint past the end")?;
        *buf = rest;
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte < 0x80 {
            return Ok(value);
        }
    }
    Err("varint too long")
}

/// Counts a message's rows as a tonic codec ([`Undecoded`]); responses are encoded
/// by prost.
#[derive(Debug, Clone, Copy, Default)]
struct AgentCodec;

impl Codec for AgentCodec {
    type Encode = CollectorMessage;
    type Decode = Undecoded;
    type Encoder = ProstEncoder<CollectorMessage>;
    type Decoder = AgentDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        AgentDecoder
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct AgentDecoder;

impl Decoder for AgentDecoder {
    type Item = Undecoded;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Undecoded>, Status> {
        use bytes::Buf;
        // tonic hands over one whole message; taking it out of tonic's buffer
        // shares the allocation instead of copying.
        let len = src.remaining();
        Undecoded::check(src.copy_to_bytes(len)).map(Some)
    }
}

/// The one streaming method, as the collector serves it: the generated
/// `Collector` trait's, over [`Undecoded`] messages.
#[tonic::async_trait]
pub trait StreamService: Send + Sync + 'static {
    type Outbound: futures::Stream<Item = Result<CollectorMessage, Status>> + Send + 'static;

    async fn stream(
        &self,
        request: Request<Streaming<Undecoded>>,
    ) -> Result<Response<Self::Outbound>, Status>;
}

/// What a stream's messages may take while they arrive.
#[derive(Debug, Clone)]
pub struct MessageLimits {
    /// The largest message accepted, in bytes (`--max-message-bytes`).
    pub max_message_bytes: usize,
    /// The decoding room an unfinished message takes its length of.
    pub room: Arc<Room>,
    /// How long a message may take from its first byte to its last
    /// (`--message-timeout`).
    pub timeout: Duration,
}

/// The server for a [`StreamService`], in place of the generated one.
#[derive(Debug)]
pub struct CollectorServer<T> {
    inner: Arc<T>,
    limits: MessageLimits,
}

impl<T> CollectorServer<T> {
    /// Serves `inner`, accepting and sending messages within `limits`.
    pub fn new(inner: T, limits: MessageLimits) -> CollectorServer<T> {
        CollectorServer {
            inner: Arc::new(inner),
            limits,
        }
    }
}

impl<T> Clone for CollectorServer<T> {
    fn clone(&self) -> Self {
        CollectorServer {
            inner: self.inner.clone(),
            limits: self.limits.clone(),
        }
    }
}

impl<T> NamedService for CollectorServer<T> {
    const NAME: &'static str = SERVICE_NAME;
}

struct StreamMethod<T>(Arc<T>);

impl<T: StreamService> StreamingService<Undecoded> for StreamMethod<T> {
    type Response = CollectorMessage;
    type ResponseStream = T::Outbound;
    type Future = BoxFuture<Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: Request<Streaming<Undecoded>>) -> Self::Future {
        let inner = self.0.clone();
        Box::pin(async move { inner.stream(request).await })
    }
}

impl<T, B> Service<http::Request<B>> for CollectorServer<T>
where
    T: StreamService,
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() != STREAM_PATH {
            return Box::pin(async {
                Ok(
                    Status::unimplemented("rankscope.v1.Collector has one method, Stream")
                        .into_http(),
                )
            });
        }
        let (inner, limits) = (self.inner.clone(), self.limits.clone());
        let limit = limits.max_message_bytes;
        let request = request.map(|body| Metered::new(body, limits));
        Box::pin(async move {
            let mut grpc =
                Grpc::new(AgentCodec).apply_max_message_size_config(Some(limit), Some(limit));
            Ok(grpc.streaming(StreamMethod(inner), request).await)
        })
    }
}

/// Why reading a stream ended, where its status code alone does not say: the
/// source of the status [`Metered`] ends a stream with ([`ReadEnd::of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReadEnd {
    /// The agent went away: it reset or cancelled the stream, its connection
    /// closed or was reset, or it stopped answering keepalive pings.
    #[error("the agent went away")]
    Disconnected,
    /// A message did not arrive whole within `--message-timeout` of its first byte.
    #[error("a message did not arrive in time")]
    MessageTimeout,
}

impl ReadEnd {
    /// How the reading that ended with `status` ended, if [`Metered`] ended it.
    pub fn of(status: &Status) -> Option<ReadEnd> {
        std::error::Error::source(status)?
            .downcast_ref::<ReadEnd>()
            .copied()
    }

    /// A status with this as its source.
    pub fn status(self, code: tonic::Code, message: String) -> Status {
        let mut status = Status::new(code, message);
        status.set_source(Arc::new(self));
        status
    }
}

/// Bytes of a gRPC message's prefix: the compressed flag and a 4-byte length.
const PREFIX_BYTES: usize = 5;

/// The largest message that takes no room: one that fits, prefix included, in
/// the read buffer tonic gives every stream when it opens (8 KiB), which the
/// stream's own share counts (`intake::STREAM_BASE_BYTES`). A Hello, or a batch
/// of a few rows, so never waits behind a large message for room. Nor does a
/// message that fits in the read buffer the stream's share counts beside the
/// largest message it sent whole, that message's size rounded up to a power of
/// two (`intake::stream_bytes`).
pub const ROOMLESS_MESSAGE_BYTES: usize = (8 << 10) - PREFIX_BYTES;

/// The message whose bytes are passing through [`Metered`].
struct Unfinished {
    prefix: [u8; PREFIX_BYTES],
    /// Bytes of the prefix seen so far.
    prefix_seen: usize,
    /// The declared length, once the prefix is whole.
    len: usize,
    /// Bytes of the message (after its prefix) still to come.
    left: usize,
    /// Its room, once it has it; dropped (given back) with the message.
    room: Option<RoomPermit>,
    /// Waiting for its room.
    waiting: Option<Pin<Box<dyn Future<Output = RoomPermit> + Send>>>,
}

/// A request body with its gRPC messages metered as their bytes pass (see the
/// module's header): room for each unfinished message, a deadline on it, and
/// disconnects told from malformed bytes.
pub struct Metered<B> {
    inner: Pin<Box<B>>,
    limits: MessageLimits,
    /// Bytes taken from `inner` and not yet handed on; the first `parsed` of
    /// them were followed already.
    held: Bytes,
    parsed: usize,
    /// `held` is a copy of its own, not a slice of the frame it came in.
    held_owned: bool,
    /// The largest message handed on whole: the stream's share counts a read
    /// buffer of this size (`intake::stream_bytes`).
    largest: usize,
    message: Option<Unfinished>,
    /// The deadline of the message in `message`, set at its first byte.
    deadline: Option<Pin<Box<Sleep>>>,
    /// Nothing more is handed on.
    done: bool,
}

impl<B> Metered<B> {
    pub fn new(inner: B, limits: MessageLimits) -> Metered<B> {
        Metered {
            inner: Box::pin(inner),
            limits,
            held: Bytes::new(),
            parsed: 0,
            held_owned: false,
            largest: 0,
            message: None,
            deadline: None,
            done: false,
        }
    }

    /// Follows the frames in `held`; returns the bytes to hand on, or `None`
    /// while the message there waits for room. Stops at the end of a message, so
    /// that the next one asks for room only once this one is decoded and given
    /// its own.
    fn advance(&mut self, cx: &mut Context<'_>) -> Option<Bytes> {
        let mut n = self.parsed;
        while n < self.held.len() {
            if self.message.is_none() {
                if n > 0 {
                    break; // a message ended in these bytes: hand it on alone
                }
                self.start();
            }
            let limits = &self.limits;
            // The read buffer the stream's share counts holds a message this large.
            let counted = ROOMLESS_MESSAGE_BYTES.max(self.largest.next_power_of_two());
            let Some(message) = self.message.as_mut() else {
                break;
            };
            if message.prefix_seen < PREFIX_BYTES {
                let k = (PREFIX_BYTES - message.prefix_seen).min(self.held.len() - n);
                message.prefix[message.prefix_seen..][..k].copy_from_slice(&self.held[n..][..k]);
                message.prefix_seen += k;
                n += k;
                if message.prefix_seen < PREFIX_BYTES {
                    break;
                }
                let [flag, len @ ..] = message.prefix;
                message.len = u32::from_be_bytes(len) as usize;
                message.left = message.len;
                // A compressed flag, an unknown one or a length over the limit is
                // refused by tonic at the prefix, before it allocates: pass it on.
                if flag == 0 && message.len > counted && message.len <= limits.max_message_bytes {
                    let room = limits.room.clone();
                    message.waiting = Some(Box::pin(room.unfinished(message.len)));
                }
            }
            if let Some(waiting) = message.waiting.as_mut() {
                match waiting.as_mut().poll(cx) {
                    Poll::Ready(room) => {
                        message.room = Some(room);
                        message.waiting = None;
                    }
                    Poll::Pending => {
                        // Hold the prefix back, so nothing sizes a buffer for the
                        // message before it has room.
                        self.parsed = n;
                        self.own_held();
                        return None;
                    }
                }
            }
            let k = message.left.min(self.held.len() - n);
            message.left -= k;
            n += k;
            if message.left == 0 {
                // The last byte is handed on: its room goes back, and the message
                // now counts in its stream's share (`service`).
                self.largest = self.largest.max(message.len);
                self.message = None;
            }
        }
        self.parsed = 0;
        let bytes = self.held.split_to(n);
        self.own_held();
        Some(bytes)
    }

    /// Copies bytes kept past this poll out of the frame they came in: a frame
    /// is a slice of h2's read buffer, which it would keep whole (up to 16 KiB
    /// and more) while the stream waits for room or decodes the message before.
    fn own_held(&mut self) {
        if !self.held_owned && !self.held.is_empty() {
            self.held = Bytes::copy_from_slice(&self.held);
            self.held_owned = true;
        }
    }

    /// A message starts: its deadline runs from now.
    fn start(&mut self) {
        let at = Instant::now() + self.limits.timeout;
        match self.deadline.as_mut() {
            Some(deadline) => deadline.as_mut().reset(at),
            None => self.deadline = Some(Box::pin(tokio::time::sleep_until(at))),
        }
        self.message = Some(Unfinished {
            prefix: [0; PREFIX_BYTES],
            prefix_seen: 0,
            len: 0,
            left: 0,
            room: None,
            waiting: None,
        });
    }

    /// Nothing to hand on now: `Pending`, unless the message begun is past its
    /// deadline.
    fn stalled(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let Some(message) = &self.message else {
            return Poll::Pending;
        };
        let Some(deadline) = self.deadline.as_mut() else {
            return Poll::Pending;
        };
        if deadline.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        let timeout = self.limits.timeout;
        let why = if message.prefix_seen < PREFIX_BYTES {
            format!(
                "a message's 5-byte gRPC prefix did not arrive whole within {timeout:?} of its \
                 first byte"
            )
        } else if message.waiting.is_some() {
            format!(
                "a message of {} bytes found no room to be read within {timeout:?} of its first \
                 byte: the collector's room for decoding (an eighth of --max-memory-bytes) is \
                 held by other messages",
                message.len
            )
        } else {
            format!(
                "a message of {} bytes did not arrive whole within {timeout:?} of its first byte \
                 ({} bytes came)",
                message.len,
                message.len - message.left
            )
        };
        let status = ReadEnd::MessageTimeout.status(
            tonic::Code::DeadlineExceeded,
            format!(
                "{why} (--message-timeout): the stream ends and frees what it held; resend \
                 unacknowledged batches on a new stream"
            ),
        );
        self.end();
        Poll::Ready(Some(Err(status)))
    }

    /// Ends the reading: gives back the room held and hands on nothing more.
    fn end(&mut self) {
        self.done = true;
        self.message = None;
        self.held = Bytes::new();
        self.parsed = 0;
    }
}

/// Whether a request body's error is the agent going away (a reset or cancelled
/// stream, a closed or reset connection, an unanswered keepalive), as opposed to
/// bytes that break HTTP/2, which h2 itself refuses.
fn is_disconnect(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(error);
    while let Some(e) = source {
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            return h2.is_io() || h2.is_remote();
        }
        if let Some(hyper) = e.downcast_ref::<hyper::Error>()
            && (hyper.is_timeout()
                || hyper.is_canceled()
                || hyper.is_closed()
                || hyper.is_incomplete_message())
        {
            return true;
        }
        if e.is::<std::io::Error>() {
            return true;
        }
        source = e.source();
    }
    false
}

impl<B> Body for Metered<B>
where
    B: Body,
    B::Error: Into<StdError>,
{
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            if !this.held.is_empty() {
                return match this.advance(cx) {
                    Some(bytes) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
                    None => this.stalled(cx),
                };
            }
            match this.inner.as_mut().poll_frame(cx) {
                Poll::Pending => return this.stalled(cx),
                Poll::Ready(None) => {
                    // tonic refuses a message cut short by the end of the stream.
                    this.done = true;
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(mut data) => {
                        this.held = data.copy_to_bytes(data.remaining());
                        this.held_owned = false;
                    }
                    Err(frame) => {
                        let frame = frame.map_data(|mut d| d.copy_to_bytes(d.remaining()));
                        return Poll::Ready(Some(Ok(frame)));
                    }
                },
                Poll::Ready(Some(Err(error))) => {
                    let error: StdError = error.into();
                    let status = if is_disconnect(&*error) {
                        ReadEnd::Disconnected.status(
                            tonic::Code::Unavailable,
                            format!("the agent went away: {error}"),
                        )
                    } else {
                        Status::from_error(error)
                    };
                    this.end();
                    return Poll::Ready(Some(Err(status)));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || (self.held.is_empty() && self.message.is_none() && self.inner.is_end_stream())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;
    use rankscope_proto::v1::agent_message::Kind;
    use rankscope_proto::v1::{AgentMessage, Batch, EventRow, Hello, StepRow};

    fn batch_bytes(b: Batch) -> Vec<u8> {
        AgentMessage {
            kind: Some(Kind::Batch(b)),
        }
        .encode_to_vec()
    }

    #[test]
    fn counts_rows_of_every_table_without_decoding() {
        let b = Batch {
            seq: 3,
            steps: vec![StepRow::default(); 7],
            events: vec![
                EventRow {
                    message: "x".into(),
                    ..Default::default()
                };
                2
            ],
            ..Default::default()
        };
        let bytes = batch_bytes(b);
        assert_eq!(batch_rows_on_wire(&bytes), Ok(9));
        assert_eq!(table_rows_on_wire(&bytes), Ok([0, 0, 7, 0, 0, 2, 0]));
        let Ok(Message::Batch(decoded)) = decode_agent_message(&bytes) else {
            panic!("a batch decodes");
        };
        assert_eq!(decoded.seq, 3);
        assert_eq!(decoded.rows(Table::Steps), 7);
        assert_eq!(decoded.rows(Table::Events), 2);
        let hello = AgentMessage {
            kind: Some(Kind::Hello(Hello::default())),
        };
        assert_eq!(batch_rows_on_wire(&hello.encode_to_vec()), Ok(0));
    }

    #[test]
    fn refuses_too_many_rows_before_allocating_them() {
        // 8 million empty rows in 16 MB: refused from the count alone.
        let rows = 8_000_000;
        let mut inner = vec![0x08, 0x01];
        inner.extend(std::iter::repeat_n([0x1a, 0x00], rows).flatten());
        let mut bytes = vec![0x12];
        let mut len = inner.len();
        while len >= 0x80 {
            bytes.push(len as u8 | 0x80);
            len >>= 7;
        }
        bytes.push(len as u8);
        bytes.extend_from_slice(&inner);
        let status = decode_agent_message(&bytes).unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(
            status
                .message()
                .contains("batch of 8000000 rows is too large"),
            "{status:?}"
        );
    }

    #[test]
    fn repeated_batch_fields_add_up_and_groups_are_followed() {
        let half = batch_bytes(Batch {
            steps: vec![StepRow::default(); MAX_ROWS_PER_BATCH / 2 + 1],
            ..Default::default()
        });
        // Two occurrences merge into one batch of 100,002 rows.
        let twice = [half.clone(), half.clone()].concat();
        assert_eq!(batch_rows_on_wire(&twice), Ok(MAX_ROWS_PER_BATCH + 2));
        assert_eq!(
            decode_agent_message(&twice).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        // An unknown group (field 9) in front hides nothing.
        let grouped = [vec![0x4b, 0x08, 0x01, 0x4c], twice].concat();
        assert_eq!(batch_rows_on_wire(&grouped), Ok(MAX_ROWS_PER_BATCH + 2));
        // Structures the walk cannot follow are malformed, never decoded.
        for bad in [
            &[0x4b, 0x08][..],       // unterminated group
            &[0x4b, 0x54][..],       // mismatched end group
            &[0x12, 0x05, 0x1a][..], // length past the end
            &[0x07][..],             // wire type 7
            &[0x00, 0x00][..],       // field 0
            &[0x08, 0xff, 0xff][..], // unterminated varint
        ] {
            let status = decode_agent_message(bad).unwrap_err();
            assert_eq!(status.code(), tonic::Code::Internal, "{bad:?}");
        }
        let deep = [vec![0x4b; 200], vec![0x4c; 200]].concat();
        assert_eq!(batch_rows_on_wire(&deep), Err("groups nested too deeply"));
    }

    mod metered {
        use super::super::*;
        use http_body_util::{BodyExt, StreamBody};
        use tokio::sync::mpsc;
        use tokio_stream::wrappers::UnboundedReceiverStream;

        type Sent = Result<Frame<Bytes>, std::io::Error>;
        type TestBody = Metered<StreamBody<UnboundedReceiverStream<Sent>>>;

        fn body(room: &Arc<Room>) -> (mpsc::UnboundedSender<Sent>, TestBody) {
            let (tx, rx) = mpsc::unbounded_channel();
            let limits = MessageLimits {
                max_message_bytes: 1 << 20,
                room: room.clone(),
                timeout: Duration::from_secs(30),
            };
            let body = Metered::new(StreamBody::new(UnboundedReceiverStream::new(rx)), limits);
            (tx, body)
        }

        fn framed(payload: &[u8]) -> Vec<u8> {
            let mut f = vec![0];
            f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
            f.extend_from_slice(payload);
            f
        }

        fn send(tx: &mpsc::UnboundedSender<Sent>, bytes: &[u8]) {
            tx.send(Ok(Frame::data(Bytes::copy_from_slice(bytes))))
                .unwrap();
        }

        /// The next data frame, or `None` if none is ready within 50 ms.
        async fn next(body: &mut TestBody) -> Option<Result<Bytes, Status>> {
            let frame = tokio::time::timeout(Duration::from_millis(50), body.frame())
                .await
                .ok()??;
            Some(frame.map(|f| f.into_data().expect("a data frame")))
        }

        #[tokio::test(start_paused = true)]
        async fn messages_pass_whole_and_hold_their_length_of_room_while_unfinished() {
            let room = Room::new(1 << 20);
            let (tx, mut body) = body(&room);
            let large = framed(&[7; 20_000]);
            let small = framed(b"hello");
            // A small message and the start of a large one in one frame: the
            // small one is handed on alone, and takes no room.
            let mut first = small.clone();
            first.extend_from_slice(&large[..3]);
            send(&tx, &first);
            assert_eq!(next(&mut body).await.unwrap().unwrap(), &small[..]);
            assert_eq!(room.unfinished_bytes(), 0);
            // The large one's prefix, split over frames, then its bytes in pieces.
            assert_eq!(next(&mut body).await.unwrap().unwrap(), &large[..3]);
            send(&tx, &large[3..1000]);
            assert_eq!(next(&mut body).await.unwrap().unwrap(), &large[3..1000]);
            assert_eq!(room.unfinished_bytes(), 20_000);
            send(&tx, &large[1000..]);
            assert_eq!(next(&mut body).await.unwrap().unwrap(), &large[1000..]);
            // Its last byte handed on: the room is back.
            assert_eq!(room.unfinished_bytes(), 0);
            assert_eq!(room.used_bytes(), 0);
            // One within the read buffer its stream's share counts (20,000
            // rounded up to 32 KiB) takes no room; a larger one takes room again.
            let same = framed(&[8; 32_768]);
            send(&tx, &same[..100]);
            assert_eq!(next(&mut body).await.unwrap().unwrap(), &same[..100]);
            assert_eq!(room.unfinished_bytes(), 0);
            send(&tx, &same[100..]);
            assert_eq!(next(&mut body).await.unwrap().unwrap(), &same[100..]);
            let larger = framed(&[9; 32_769]);
            send(&tx, &larger[..100]);
            assert_eq!(next(&mut body).await.unwrap().unwrap(), &larger[..100]);
            assert_eq!(room.unfinished_bytes(), 32_769);
            send(&tx, &larger[100..]);
            assert_eq!(next(&mut body).await.unwrap().unwrap(), &larger[100..]);
            assert_eq!(room.unfinished_bytes(), 0);
            drop(tx);
            assert!(body.frame().await.is_none());
        }

        #[tokio::test(start_paused = true)]
        async fn without_room_nothing_past_the_prefix_is_read() {
            let room = Room::new(64 << 10);
            let held = room.clone().unfinished(60 << 10).await;
            let (tx, mut body) = body(&room);
            let message = framed(&[1; 30_000]);
            send(&tx, &message[..10_000]);
            assert!(next(&mut body).await.is_none(), "waits for room");
            // Nothing more is taken from the connection meanwhile.
            send(&tx, &message[10_000..]);
            assert!(next(&mut body).await.is_none());
            drop(held);
            let mut got = Vec::new();
            while got.len() < message.len() {
                got.extend_from_slice(&next(&mut body).await.unwrap().unwrap());
            }
            assert_eq!(got, message);
            assert_eq!(room.used_bytes(), 0);
        }

        #[tokio::test(start_paused = true)]
        async fn a_message_unfinished_past_the_timeout_ends_the_stream() {
            let room = Room::new(1 << 20);
            let (tx, mut body) = body(&room);
            // Idle between messages: no deadline runs.
            tokio::time::sleep(Duration::from_secs(120)).await;
            let message = framed(&[1; 50_000]);
            send(&tx, &message[..20_000]);
            assert!(next(&mut body).await.unwrap().is_ok());
            assert_eq!(room.unfinished_bytes(), 50_000);
            tokio::time::sleep(Duration::from_secs(29)).await;
            send(&tx, &message[20_000..30_000]);
            assert!(next(&mut body).await.unwrap().is_ok());
            let status = body.frame().await.unwrap().unwrap_err();
            assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
            assert_eq!(ReadEnd::of(&status), Some(ReadEnd::MessageTimeout));
            assert!(
                status
                    .message()
                    .contains("50000 bytes did not arrive whole within 30s of its first byte (29995 bytes came) (--message-timeout)"),
                "{status:?}"
            );
            assert_eq!(room.used_bytes(), 0, "the room is given back at once");
            assert!(body.frame().await.is_none());
        }

        #[tokio::test(start_paused = true)]
        async fn waiting_for_room_counts_against_the_timeout() {
            let room = Room::new(64 << 10);
            let _held = room.clone().unfinished(60 << 10).await;
            let (tx, mut body) = body(&room);
            send(&tx, &framed(&[1; 30_000])[..100]);
            let status = body.frame().await.unwrap().unwrap_err();
            assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
            assert!(status.message().contains("found no room"), "{status:?}");
        }

        #[tokio::test]
        async fn a_closed_connection_is_a_disconnect_not_malformed_bytes() {
            let room = Room::new(1 << 20);
            let (tx, mut body) = body(&room);
            send(&tx, &framed(&[1; 20_000])[..100]);
            assert!(next(&mut body).await.unwrap().is_ok());
            let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
            tx.send(Err(reset)).unwrap();
            let status = body.frame().await.unwrap().unwrap_err();
            assert_eq!(ReadEnd::of(&status), Some(ReadEnd::Disconnected));
            assert_eq!(status.code(), tonic::Code::Unavailable);
            assert_eq!(room.used_bytes(), 0);
        }

        #[test]
        fn what_counts_as_a_disconnect() {
            let io = std::io::Error::from(std::io::ErrorKind::BrokenPipe);
            assert!(is_disconnect(&io));
            // h2's own protocol errors, and errors of no transport, are not.
            assert!(!is_disconnect(&h2::Error::from(h2::Reason::PROTOCOL_ERROR)));
            assert!(!is_disconnect(&Status::internal("x")));
        }
    }
}
