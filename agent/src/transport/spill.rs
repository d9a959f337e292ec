//! The spill: a rank's unacknowledged batches on local disk, so they outlive a
//! collector outage and a crash of the rank itself.
//!
//! # Layout
//!
//! One directory per (run, rank): `<spill root>/<run id>/rank-<rank>/`, holding
//! - `lock`: held (`flock`) by the one process that owns the directory;
//! - `hello.pb`: the rank's `Hello` (protobuf), so `rankscope replay` can send the
//!   batches of a rank that will never run again;
//! - segments `seg-<id: 16 hex digits>.rsq`, written in increasing `id` order.
//!
//! A segment is the 8 bytes [`MAGIC`] followed by records:
//!
//! ```text
//! length: u32 LE | crc32: u32 LE | kind: u8 | body (length − 1 bytes)
//! ```
//!
//! `crc32` (IEEE) covers `kind` and `body`. Kinds:
//! - [`KIND_BATCH`]: body = a protobuf `Batch`. `seq` 0 means *not numbered yet*:
//!   a batch gets its `seq` only once the collector has told the rank, in its
//!   `Welcome`, where its sequence stands (see [`super::outbox`]).
//! - [`KIND_NUMBERED`]: body = `last_seq: u64 LE | count: u64 LE`: the `count`
//!   latest not-yet-numbered batches written before this record are numbered
//!   `last_seq − count + 1 ..= last_seq`, in write order.
//!
//! # Invariants
//!
//! - Records are appended, never rewritten; a process writes only to a segment it
//!   created, so a torn write can only be the last record of a segment.
//! - In write order, numbered batches have increasing `seq`, and every numbered
//!   batch comes before every unnumbered one.
//! - A segment is deleted whole: when every batch in it is acknowledged (the
//!   collector holds them durably), or by the size bound (oldest first; see
//!   [`super::outbox`] for the policy and how the loss is reported).
//!
//! # After a crash
//!
//! [`SpillLog::open`] reads every segment in `id` order and stops reading a segment
//! at its first record that is cut short or fails its checksum; the bytes skipped
//! are counted ([`SpillLog::damaged_bytes`]) and reported as a `spill_damaged`
//! event. Writes are not fsynced: a killed process loses nothing (the kernel has
//! the bytes), a crashed machine may lose the tail of the newest segment. New
//! batches always go to a new segment. The replayed batches are resent in order;
//! the collector drops the ones it already holds, by `seq`.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use prost::Message;
use rankscope_proto::v1::{Batch, Hello};

/// The first bytes of every segment.
pub const MAGIC: &[u8; 8] = b"RSPILL01";
/// A batch record.
pub const KIND_BATCH: u8 = 1;
/// A numbering record.
pub const KIND_NUMBERED: u8 = 2;
/// A record body larger than this is damage, not data.
const MAX_RECORD_BYTES: u32 = 256 * 1024 * 1024;

/// Where a batch record lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub segment: u64,
    pub offset: u64,
    pub len: u32,
}

/// A batch found by [`SpillLog::open`]; `batch.seq` is 0 when it is not numbered.
#[derive(Debug)]
pub struct Replayed {
    pub batch: Batch,
    pub at: Location,
}

/// The spill directory of one rank, owned by this process.
#[derive(Debug)]
pub struct SpillLog {
    dir: PathBuf,
    _lock: File,
    /// Bytes of every segment, by id.
    segments: BTreeMap<u64, u64>,
    current: Option<(u64, File)>,
    segment_bytes: u64,
    damaged_bytes: u64,
}

impl SpillLog {
    /// The directory of `rank` of `run_id` under `root`.
    pub fn rank_dir(root: &Path, run_id: &str, rank: u32) -> PathBuf {
        root.join(run_id).join(format!("rank-{rank}"))
    }

    /// Opens (creating) `dir`, takes its lock and reads back what an earlier
    /// process left behind. Segments grow to about `segment_bytes`.
    pub fn open(dir: &Path, segment_bytes: u64) -> io::Result<(SpillLog, Vec<Replayed>)> {
        std::fs::create_dir_all(dir)?;
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join("lock"))?;
        if lock.try_lock().is_err() {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                format!(
                    "spill directory {} is in use by another process of the same run and rank: give each process its own RANKSCOPE_RUN_ID or RANK",
                    dir.display()
                ),
            ));
        }
        let mut log = SpillLog {
            dir: dir.to_path_buf(),
            _lock: lock,
            segments: BTreeMap::new(),
            current: None,
            segment_bytes: segment_bytes.max(1),
            damaged_bytes: 0,
        };
        for entry in std::fs::read_dir(dir)? {
            let name = entry?.file_name();
            let id = name
                .to_str()
                .and_then(|n| n.strip_prefix("seg-"))
                .and_then(|n| n.strip_suffix(".rsq"))
                .and_then(|n| u64::from_str_radix(n, 16).ok());
            if let Some(id) = id {
                let bytes = std::fs::metadata(log.segment_path(id))?.len();
                log.segments.insert(id, bytes);
            }
        }
        let mut replayed = Vec::new();
        let ids: Vec<u64> = log.segments.keys().copied().collect();
        for id in ids {
            log.read_segment(id, &mut replayed)?;
        }
        Ok((log, replayed))
    }

    fn segment_path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("seg-{id:016x}.rsq"))
    }

    fn read_segment(&mut self, id: u64, replayed: &mut Vec<Replayed>) -> io::Result<()> {
        let mut data = Vec::new();
        File::open(self.segment_path(id))?.read_to_end(&mut data)?;
        if data.len() < MAGIC.len() || &data[..MAGIC.len()] != MAGIC {
            self.damaged_bytes += data.len() as u64;
            return Ok(());
        }
        let mut offset = MAGIC.len();
        while offset < data.len() {
            let Some((kind, body)) = parse_record(&data[offset..]) else {
                self.damaged_bytes += (data.len() - offset) as u64;
                break;
            };
            let at = Location {
                segment: id,
                offset: offset as u64,
                len: (8 + 1 + body.len()) as u32,
            };
            match (kind, Batch::decode(body)) {
                (KIND_BATCH, Ok(batch)) => replayed.push(Replayed { batch, at }),
                (KIND_NUMBERED, _) if body.len() == 16 => {
                    let last = u64::from_le_bytes(body[..8].try_into().expect("8 bytes"));
                    let count = u64::from_le_bytes(body[8..].try_into().expect("8 bytes"));
                    number_backwards(replayed, last, count);
                }
                _ => {
                    // A record that checks out but cannot be read is from a newer
                    // format; skip it and count it rather than guess.
                    self.damaged_bytes += u64::from(at.len);
                }
            }
            offset += at.len as usize;
        }
        Ok(())
    }

    /// Bytes skipped as damaged when the directory was opened.
    pub fn damaged_bytes(&self) -> u64 {
        self.damaged_bytes
    }

    /// Bytes of all segments.
    pub fn bytes(&self) -> u64 {
        self.segments.values().sum()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes `hello` to `hello.pb` (replacing it atomically).
    pub fn write_hello(&self, hello: &Hello) -> io::Result<()> {
        let tmp = self.dir.join("hello.pb.tmp");
        std::fs::write(&tmp, hello.encode_to_vec())?;
        std::fs::rename(tmp, self.dir.join("hello.pb"))
    }

    /// Reads the `Hello` a spill directory was written with.
    pub fn read_hello(dir: &Path) -> io::Result<Hello> {
        let bytes = std::fs::read(dir.join("hello.pb"))?;
        Hello::decode(bytes.as_slice()).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }

    /// Appends a batch record.
    pub fn append_batch(&mut self, batch: &Batch) -> io::Result<Location> {
        self.append(KIND_BATCH, &batch.encode_to_vec())
    }

    /// Appends a numbering record: the `count` latest unnumbered batches end at `last_seq`.
    pub fn append_numbered(&mut self, last_seq: u64, count: u64) -> io::Result<()> {
        let mut body = Vec::with_capacity(16);
        body.extend_from_slice(&last_seq.to_le_bytes());
        body.extend_from_slice(&count.to_le_bytes());
        self.append(KIND_NUMBERED, &body).map(|_| ())
    }

    fn append(&mut self, kind: u8, body: &[u8]) -> io::Result<Location> {
        let full = self
            .current
            .as_ref()
            .is_some_and(|(id, _)| self.segments[id] >= self.segment_bytes);
        if self.current.is_none() || full {
            let id = self.segments.keys().next_back().map_or(0, |last| last + 1);
            let mut file = OpenOptions::new()
                .create_new(true)
                .write(true)
                .open(self.segment_path(id))?;
            file.write_all(MAGIC)?;
            self.segments.insert(id, MAGIC.len() as u64);
            self.current = Some((id, file));
        }
        let (id, file) = self.current.as_mut().expect("a current segment");
        let offset = self.segments[id];
        let record = encode_record(kind, body);
        // One write per record: a killed process leaves whole records behind.
        file.write_all(&record)?;
        let id = *id;
        *self.segments.get_mut(&id).expect("known segment") += record.len() as u64;
        Ok(Location {
            segment: id,
            offset,
            len: record.len() as u32,
        })
    }

    /// Reads the batch at `at` back.
    pub fn read(&self, at: Location) -> io::Result<Batch> {
        let mut file = File::open(self.segment_path(at.segment))?;
        file.seek(SeekFrom::Start(at.offset))?;
        let mut record = vec![0; at.len as usize];
        file.read_exact(&mut record)?;
        match parse_record(&record) {
            Some((KIND_BATCH, body)) => {
                Batch::decode(body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
            }
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "damaged spill record in {}",
                    self.segment_path(at.segment).display()
                ),
            )),
        }
    }

    /// Closes the segment being written if the next record would start a new one
    /// anyway (it is full): what the bound deletes then, it can delete before that
    /// record is written. Whether it did.
    pub fn close_if_full(&mut self) -> bool {
        let full = self
            .current
            .as_ref()
            .is_some_and(|(id, _)| self.segments[id] >= self.segment_bytes);
        if full {
            self.current = None;
        }
        full
    }

    /// The oldest segment, if it is not the one being written.
    pub fn oldest_closed(&self) -> Option<u64> {
        let oldest = *self.segments.keys().next()?;
        let current = self.current.as_ref().map(|(id, _)| *id);
        (Some(oldest) != current).then_some(oldest)
    }

    /// Deletes every closed segment older than `segment`.
    pub fn remove_before(&mut self, segment: u64) -> io::Result<()> {
        while let Some(oldest) = self.oldest_closed().filter(|&id| id < segment) {
            self.remove(oldest)?;
        }
        Ok(())
    }

    /// Deletes one closed segment.
    pub fn remove(&mut self, segment: u64) -> io::Result<()> {
        self.segments.remove(&segment);
        match std::fs::remove_file(self.segment_path(segment)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Removes the whole directory (nothing is left to send).
    pub fn remove_dir(self) -> io::Result<()> {
        let dir = self.dir.clone();
        drop(self);
        std::fs::remove_dir_all(&dir)?;
        // The run directory goes too once its last rank is done.
        if let Some(parent) = dir.parent() {
            let _ = std::fs::remove_dir(parent);
        }
        Ok(())
    }
}

/// Numbers the `count` latest unnumbered batches of `replayed` to end at `last`.
fn number_backwards(replayed: &mut [Replayed], last: u64, count: u64) {
    let mut seq = last;
    let mut left = count;
    for r in replayed.iter_mut().rev() {
        if left == 0 {
            break;
        }
        if r.batch.seq == 0 {
            r.batch.seq = seq;
            seq = seq.saturating_sub(1);
            left -= 1;
        }
    }
}

fn encode_record(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&[kind]);
    hasher.update(body);
    let mut record = Vec::with_capacity(9 + body.len());
    record.extend_from_slice(&(body.len() as u32 + 1).to_le_bytes());
    record.extend_from_slice(&hasher.finalize().to_le_bytes());
    record.push(kind);
    record.extend_from_slice(body);
    record
}

/// (kind, body) of the record at the start of `data`, if whole and intact.
fn parse_record(data: &[u8]) -> Option<(u8, &[u8])> {
    let len = u32::from_le_bytes(data.get(..4)?.try_into().ok()?);
    let crc = u32::from_le_bytes(data.get(4..8)?.try_into().ok()?);
    if len == 0 || len > MAX_RECORD_BYTES {
        return None;
    }
    let payload = data.get(8..8 + len as usize)?;
    (crc32fast::hash(payload) == crc).then(|| (payload[0], &payload[1..]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rankscope_proto::v1::StepRow;

    fn batch(seq: u64, steps: usize) -> Batch {
        Batch {
            seq,
            steps: vec![StepRow::default(); steps],
            ..Default::default()
        }
    }

    fn seqs(replayed: &[Replayed]) -> Vec<u64> {
        replayed.iter().map(|r| r.batch.seq).collect()
    }

    #[test]
    fn batches_come_back_in_order_across_segments() {
        let dir = tempfile::tempdir().unwrap();
        let at;
        {
            let (mut log, replayed) = SpillLog::open(dir.path(), 64).unwrap();
            assert!(replayed.is_empty());
            for seq in 1..=5 {
                log.append_batch(&batch(seq, 3)).unwrap();
            }
            at = log.append_batch(&batch(6, 7)).unwrap();
            assert!(log.segments.len() > 1, "small segments rotate");
            assert_eq!(log.read(at).unwrap().steps.len(), 7);
        }
        let (log, replayed) = SpillLog::open(dir.path(), 64).unwrap();
        assert_eq!(seqs(&replayed), [1, 2, 3, 4, 5, 6]);
        assert_eq!(replayed[5].at, at);
        assert_eq!(log.damaged_bytes(), 0);
    }

    #[test]
    fn numbering_records_number_the_latest_unnumbered_batches() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (mut log, _) = SpillLog::open(dir.path(), 1 << 20).unwrap();
            log.append_batch(&batch(7, 1)).unwrap();
            for _ in 0..3 {
                log.append_batch(&batch(0, 1)).unwrap();
            }
            log.append_numbered(42, 3).unwrap();
            log.append_batch(&batch(43, 1)).unwrap();
            log.append_batch(&batch(0, 1)).unwrap();
        }
        let (_, replayed) = SpillLog::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(seqs(&replayed), [7, 40, 41, 42, 43, 0]);
    }

    #[test]
    fn a_torn_or_corrupt_tail_is_skipped_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let path;
        {
            let (mut log, _) = SpillLog::open(dir.path(), 1 << 20).unwrap();
            log.append_batch(&batch(1, 2)).unwrap();
            let at = log.append_batch(&batch(2, 2)).unwrap();
            path = log.segment_path(at.segment);
        }
        let mut data = std::fs::read(&path).unwrap();
        let whole = data.len();
        data.truncate(whole - 3);
        std::fs::write(&path, &data).unwrap();
        let (log, replayed) = SpillLog::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(seqs(&replayed), [1]);
        assert!(log.damaged_bytes() > 0);
        drop(log);

        // A flipped bit fails the checksum.
        let mut data = MAGIC.to_vec();
        data.extend_from_slice(&encode_record(KIND_BATCH, &batch(1, 2).encode_to_vec()));
        let n = data.len();
        data[n - 1] ^= 0x40;
        std::fs::write(&path, &data).unwrap();
        let (log, replayed) = SpillLog::open(dir.path(), 1 << 20).unwrap();
        assert!(replayed.is_empty());
        assert!(log.damaged_bytes() > 0);
    }

    #[test]
    fn new_batches_go_to_a_new_segment_after_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let first = {
            let (mut log, _) = SpillLog::open(dir.path(), 1 << 20).unwrap();
            log.append_batch(&batch(1, 1)).unwrap().segment
        };
        let (mut log, _) = SpillLog::open(dir.path(), 1 << 20).unwrap();
        let second = log.append_batch(&batch(2, 1)).unwrap().segment;
        assert!(second > first);
        log.remove_before(second).unwrap();
        assert_eq!(log.segments.keys().copied().collect::<Vec<_>>(), [second]);
    }

    #[test]
    fn one_process_owns_a_directory() {
        let dir = tempfile::tempdir().unwrap();
        let (_log, _) = SpillLog::open(dir.path(), 1 << 20).unwrap();
        let err = SpillLog::open(dir.path(), 1 << 20).unwrap_err();
        assert!(err.to_string().contains("in use"), "{err}");
    }

    #[test]
    fn hello_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let (log, _) = SpillLog::open(dir.path(), 1 << 20).unwrap();
        let hello = Hello {
            run_id: "r".into(),
            rank: 3,
            world_size: 4,
            ..Default::default()
        };
        log.write_hello(&hello).unwrap();
        assert_eq!(SpillLog::read_hello(dir.path()).unwrap(), hello);
    }
}
