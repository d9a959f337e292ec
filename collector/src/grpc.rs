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

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use rankscope_proto::MAX_ROWS_PER_BATCH;
use rankscope_proto::v1::CollectorMessage;
use rankscope_proto::v1::collector_server::SERVICE_NAME;
use tonic::codec::{Codec, DecodeBuf, Decoder};
use tonic::codegen::{Body, BoxFuture, Service, StdError, http};
use tonic::server::{Grpc, NamedService, StreamingService};
use tonic::{Request, Response, Status, Streaming};
use tonic_prost::ProstEncoder;

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

/// Rows (entries of `Batch` fields 3 to 8) in every `batch` (field 2) of an
/// `AgentMessage`'s bytes: occurrences of a message field are merged by decoders,
/// so they add up. `Err` when the wire structure cannot be followed.
pub fn batch_rows_on_wire(bytes: &[u8]) -> Result<usize, &'static str> {
    table_rows_on_wire(bytes).map(|rows| rows.iter().sum())
}

/// [`batch_rows_on_wire`] per table.
fn table_rows_on_wire(bytes: &[u8]) -> Result<TableRows, &'static str> {
    let mut rows = [0; Table::ALL.len()];
    fields(bytes, 0, &mut |field, payload| {
        if field == 2 {
            fields(payload, 0, &mut |field, _| {
                if let Some(table) = u32::try_from(field).ok().and_then(Table::of_batch_field) {
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

/// The server for a [`StreamService`], in place of the generated one.
#[derive(Debug)]
pub struct CollectorServer<T> {
    inner: Arc<T>,
    max_message_bytes: usize,
}

impl<T> CollectorServer<T> {
    /// Serves `inner`, accepting and sending messages of at most `max_message_bytes`.
    pub fn new(inner: T, max_message_bytes: usize) -> CollectorServer<T> {
        CollectorServer {
            inner: Arc::new(inner),
            max_message_bytes,
        }
    }
}

impl<T> Clone for CollectorServer<T> {
    fn clone(&self) -> Self {
        CollectorServer {
            inner: self.inner.clone(),
            max_message_bytes: self.max_message_bytes,
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
        let (inner, limit) = (self.inner.clone(), self.max_message_bytes);
        Box::pin(async move {
            let mut grpc =
                Grpc::new(AgentCodec).apply_max_message_size_config(Some(limit), Some(limit));
            Ok(grpc.streaming(StreamMethod(inner), request).await)
        })
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
        assert_eq!(table_rows_on_wire(&bytes), Ok([0, 0, 7, 0, 0, 2]));
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
}
