//! Reading NumPy `.npy` files, so that `rankscope spectrum FILE.npy` can measure a matrix
//! saved from anywhere (the tests write files to round-trip them).
//!
//! # Format (NumPy's `format.py`, versions 1.0, 2.0 and 3.0)
//!
//! | bytes | content |
//! |---|---|
//! | 6 | magic `\x93NUMPY` |
//! | 2 | major, minor version |
//! | 2 (v1) or 4 (v2, v3) | header length, little-endian |
//! | header length | a Python dict literal, e.g. `{'descr': '<f8', 'fortran_order': False, 'shape': (3, 4), }`, space-padded and ending in `\n`; Latin-1 (v1, v2) or UTF-8 (v3) |
//! | the rest | the elements, C order |
//!
//! # Contract
//!
//! - Read: any number of dimensions; element types `f4`, `f8`, `i1`, `i2`, `i4`, `i8`, `u1`,
//!   `u2`, `u4`, `u8` and `b1`, either byte order; the result is a float64 CPU tensor of the
//!   saved shape (64-bit integers beyond 2⁵³ lose precision). Fortran-order arrays, object
//!   and structured dtypes, and `f2` are refused with an error that says what to do.
//! - The header is parsed by hand and validated before any data is read: the data must be
//!   exactly shape × item size bytes long, so a hostile or truncated file gives an error and
//!   never a panic or an allocation larger than the file (times 8 for one-byte types).
//! - The tests' writer: any real tensor, converted to float64, as `'<f8'` version 1.0 (2.0
//!   only if the header would not fit), with the header padded to a multiple of 64 bytes as
//!   NumPy does.

use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use tch::{TchError, Tensor};

const MAGIC: &[u8; 6] = b"\x93NUMPY";
/// Far above any real header (NumPy itself refuses more than 10 000 bytes by default).
const MAX_HEADER_BYTES: u64 = 1 << 20;
/// NumPy's own limit on the number of dimensions.
const MAX_DIMS: usize = 64;

/// What can go wrong reading a `.npy` file; every message names the file.
#[derive(Debug, thiserror::Error)]
pub enum NpyError {
    #[error("cannot read {}: {source}", .path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("{} is not a .npy file (it does not start with \\x93NUMPY): save the array with numpy.save", .path.display())]
    BadMagic { path: PathBuf },
    #[error("{} uses .npy format version {major}.{minor}; versions 1.0, 2.0 and 3.0 are supported", .path.display())]
    Version { path: PathBuf, major: u8, minor: u8 },
    #[error("{} has a malformed .npy header: {reason}", .path.display())]
    Header { path: PathBuf, reason: String },
    #[error(
        "{} holds dtype {descr}, which is not supported: save a numeric array, e.g. a.astype(numpy.float64)",
        .path.display()
    )]
    Dtype { path: PathBuf, descr: String },
    #[error(
        "{} is stored in Fortran order: save it with numpy.save(path, numpy.ascontiguousarray(a))",
        .path.display()
    )]
    FortranOrder { path: PathBuf },
    #[error("{} declares shape {shape:?}, which is too large to be a real array", .path.display())]
    TooLarge { path: PathBuf, shape: Vec<u64> },
    #[error(
        "{} is truncated or corrupt: shape {shape:?} of {descr} needs {expected} data bytes but the file holds {actual}",
        .path.display()
    )]
    Length {
        path: PathBuf,
        shape: Vec<u64>,
        descr: String,
        expected: u64,
        actual: u64,
    },
    #[error("{}: libtorch failed on the tensor: {source}", .path.display())]
    Tensor { path: PathBuf, source: TchError },
}

/// Reads a `.npy` file into a float64 CPU tensor of the saved shape (see the module contract).
pub fn read_npy(path: &Path) -> Result<Tensor, NpyError> {
    let read_err = |source| NpyError::Read {
        path: path.to_path_buf(),
        source,
    };
    let header_err = |reason: &str| NpyError::Header {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    let mut file = File::open(path).map_err(read_err)?;
    let file_len = file.metadata().map_err(read_err)?.len();

    let mut preamble = [0u8; 8];
    let got = read_up_to(&mut file, &mut preamble).map_err(read_err)?;
    if got < MAGIC.len() || &preamble[..MAGIC.len()] != MAGIC {
        return Err(NpyError::BadMagic {
            path: path.to_path_buf(),
        });
    }
    if got < preamble.len() {
        return Err(header_err("the file ends inside the preamble"));
    }
    let (major, minor) = (preamble[6], preamble[7]);
    let len_bytes = match (major, minor) {
        (1, 0) => 2,
        (2, 0) | (3, 0) => 4,
        _ => {
            return Err(NpyError::Version {
                path: path.to_path_buf(),
                major,
                minor,
            });
        }
    };
    let mut len_field = [0u8; 4];
    if read_up_to(&mut file, &mut len_field[..len_bytes]).map_err(read_err)? < len_bytes {
        return Err(header_err("the file ends inside the header length"));
    }
    let header_len = u64::from(u32::from_le_bytes(len_field));
    let data_start = 8 + len_bytes as u64 + header_len;
    if header_len > MAX_HEADER_BYTES {
        return Err(header_err(&format!(
            "header length {header_len} is implausibly large"
        )));
    }
    if data_start > file_len {
        return Err(header_err(&format!(
            "the header says it is {header_len} bytes but the file ends before it does"
        )));
    }
    let mut raw = vec![0u8; header_len as usize];
    file.read_exact(&mut raw).map_err(read_err)?;
    let text = if major == 3 {
        String::from_utf8(raw).map_err(|_| header_err("a version 3.0 header must be UTF-8"))?
    } else {
        raw.iter().map(|&b| char::from(b)).collect()
    };
    let header = parse_header(&text).map_err(|reason| header_err(&reason))?;
    if header.fortran_order {
        return Err(NpyError::FortranOrder {
            path: path.to_path_buf(),
        });
    }
    let dtype = Dtype::parse(&header.descr).ok_or_else(|| NpyError::Dtype {
        path: path.to_path_buf(),
        descr: header.descr.clone(),
    })?;

    let too_large = || NpyError::TooLarge {
        path: path.to_path_buf(),
        shape: header.shape.clone(),
    };
    if header.shape.len() > MAX_DIMS {
        return Err(too_large());
    }
    let count = header
        .shape
        .iter()
        .try_fold(1u64, |acc, &dim| acc.checked_mul(dim))
        .filter(|&count| i64::try_from(count).is_ok())
        .ok_or_else(too_large)?;
    let expected = count.checked_mul(dtype.size as u64).ok_or_else(too_large)?;
    let actual = file_len - data_start;
    if expected != actual {
        return Err(NpyError::Length {
            path: path.to_path_buf(),
            shape: header.shape.clone(),
            descr: header.descr.clone(),
            expected,
            actual,
        });
    }
    // `expected` equals the bytes on disk, so this allocation is bounded by the file.
    let mut data = vec![0u8; expected as usize];
    file.read_exact(&mut data).map_err(read_err)?;
    let values = dtype.decode(&data);
    let shape: Vec<i64> = header.shape.iter().map(|&d| d as i64).collect();
    Tensor::f_from_slice(&values)
        .and_then(|t| t.f_reshape(shape.as_slice()))
        .map_err(|source| NpyError::Tensor {
            path: path.to_path_buf(),
            source,
        })
}

/// Reads until `buf` is full or the file ends; returns the bytes read.
fn read_up_to(reader: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// The three keys of a `.npy` header.
#[derive(Debug, PartialEq)]
struct Header {
    descr: String,
    fortran_order: bool,
    shape: Vec<u64>,
}

#[derive(Debug)]
enum Value {
    Str(String),
    Bool(bool),
    Tuple(Vec<u64>),
}

/// Parses the header dict: string keys, values that are strings, `True`/`False` or tuples of
/// non-negative integers (a trailing `L`, written by Python 2, is accepted); unknown keys are
/// ignored. Returns the reason on failure.
fn parse_header(text: &str) -> Result<Header, String> {
    let mut p = Parser {
        s: text.as_bytes(),
        pos: 0,
    };
    let (mut descr, mut fortran_order, mut shape) = (None, None, None);
    p.expect(b'{')?;
    loop {
        p.skip_ws();
        if p.eat(b'}') {
            break;
        }
        let key = p.string()?;
        p.skip_ws();
        p.expect(b':')?;
        p.skip_ws();
        let value = p.value()?;
        match (key.as_str(), value) {
            ("descr", Value::Str(s)) => descr = Some(s),
            ("fortran_order", Value::Bool(b)) => fortran_order = Some(b),
            ("shape", Value::Tuple(t)) => shape = Some(t),
            ("descr" | "fortran_order" | "shape", v) => {
                return Err(format!("unexpected value {v:?} for '{key}'"));
            }
            _ => {}
        }
        p.skip_ws();
        if !p.eat(b',') {
            p.skip_ws();
            p.expect(b'}')?;
            break;
        }
    }
    p.skip_ws();
    if p.pos != p.s.len() {
        return Err(format!("unexpected text after the dict at byte {}", p.pos));
    }
    Ok(Header {
        descr: descr.ok_or("the 'descr' key is missing")?,
        fortran_order: fortran_order.ok_or("the 'fortran_order' key is missing")?,
        shape: shape.ok_or("the 'shape' key is missing")?,
    })
}

struct Parser<'a> {
    s: &'a [u8],
    pos: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }

    fn skip_ws(&mut self) {
        while self.peek().is_some_and(|c| c.is_ascii_whitespace()) {
            self.pos += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        let hit = self.peek() == Some(c);
        if hit {
            self.pos += 1;
        }
        hit
    }

    fn expect(&mut self, c: u8) -> Result<(), String> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(format!("expected '{}' at byte {}", char::from(c), self.pos))
        }
    }

    /// A quoted string without escapes (dtype strings and keys never contain any).
    fn string(&mut self) -> Result<String, String> {
        let quote = match self.peek() {
            Some(q @ (b'\'' | b'"')) => q,
            _ => return Err(format!("expected a quoted string at byte {}", self.pos)),
        };
        self.pos += 1;
        let start = self.pos;
        while let Some(c) = self.peek() {
            if c == b'\\' {
                return Err(format!(
                    "escape sequences are not supported (byte {})",
                    self.pos
                ));
            }
            if c == quote {
                let s = String::from_utf8_lossy(&self.s[start..self.pos]).into_owned();
                self.pos += 1;
                return Ok(s);
            }
            self.pos += 1;
        }
        Err("unterminated string".to_string())
    }

    fn value(&mut self) -> Result<Value, String> {
        match self.peek() {
            Some(b'\'' | b'"') => self.string().map(Value::Str),
            Some(b'(') => self.tuple().map(Value::Tuple),
            Some(b'[') => Err("structured dtypes (a list as 'descr') are not supported: save a plain numeric array".into()),
            _ if self.s[self.pos..].starts_with(b"True") => {
                self.pos += 4;
                Ok(Value::Bool(true))
            }
            _ if self.s[self.pos..].starts_with(b"False") => {
                self.pos += 5;
                Ok(Value::Bool(false))
            }
            _ => Err(format!("unsupported value at byte {}", self.pos)),
        }
    }

    fn tuple(&mut self) -> Result<Vec<u64>, String> {
        self.expect(b'(')?;
        let mut items = Vec::new();
        loop {
            self.skip_ws();
            if self.eat(b')') {
                return Ok(items);
            }
            let start = self.pos;
            while self.peek().is_some_and(|c| c.is_ascii_digit()) {
                self.pos += 1;
            }
            let digits = std::str::from_utf8(&self.s[start..self.pos]).unwrap_or_default();
            let dim = digits
                .parse::<u64>()
                .map_err(|_| format!("expected a non-negative dimension at byte {start}"))?;
            items.push(dim);
            self.eat(b'L');
            self.skip_ws();
            if !self.eat(b',') {
                self.skip_ws();
                self.expect(b')')?;
                return Ok(items);
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Elem {
    F4,
    F8,
    I1,
    I2,
    I4,
    I8,
    U1,
    U2,
    U4,
    U8,
    B1,
}

/// An element type and its byte order.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Dtype {
    elem: Elem,
    size: usize,
    little: bool,
}

impl Dtype {
    /// `'<f8'`, `'>i4'`, `'|u1'`, `'=f4'` …; `None` for anything unsupported.
    fn parse(descr: &str) -> Option<Dtype> {
        let (order, code) = descr.split_at_checked(1)?;
        let (elem, size) = match code {
            "f4" => (Elem::F4, 4),
            "f8" => (Elem::F8, 8),
            "i1" => (Elem::I1, 1),
            "i2" => (Elem::I2, 2),
            "i4" => (Elem::I4, 4),
            "i8" => (Elem::I8, 8),
            "u1" => (Elem::U1, 1),
            "u2" => (Elem::U2, 2),
            "u4" => (Elem::U4, 4),
            "u8" => (Elem::U8, 8),
            "b1" => (Elem::B1, 1),
            _ => return None,
        };
        let little = match order {
            "<" => true,
            ">" => false,
            "=" => cfg!(target_endian = "little"),
            "|" if size == 1 => true,
            _ => return None,
        };
        Some(Dtype { elem, size, little })
    }

    /// Decodes `data` (a whole number of elements, checked by the caller) to float64.
    fn decode(self, data: &[u8]) -> Vec<f64> {
        fn conv<const N: usize>(data: &[u8], little: bool, f: impl Fn([u8; N]) -> f64) -> Vec<f64> {
            data.chunks_exact(N)
                .map(|chunk| {
                    let mut bytes = [0u8; N];
                    bytes.copy_from_slice(chunk);
                    if !little {
                        bytes.reverse();
                    }
                    f(bytes)
                })
                .collect()
        }
        let le = self.little;
        match self.elem {
            Elem::F4 => conv(data, le, |b| f64::from(f32::from_le_bytes(b))),
            Elem::F8 => conv(data, le, f64::from_le_bytes),
            Elem::I1 => conv(data, le, |b| f64::from(i8::from_le_bytes(b))),
            Elem::I2 => conv(data, le, |b| f64::from(i16::from_le_bytes(b))),
            Elem::I4 => conv(data, le, |b| f64::from(i32::from_le_bytes(b))),
            Elem::I8 => conv(data, le, |b| i64::from_le_bytes(b) as f64),
            Elem::U1 => conv(data, le, |b: [u8; 1]| f64::from(b[0])),
            Elem::U2 => conv(data, le, |b| f64::from(u16::from_le_bytes(b))),
            Elem::U4 => conv(data, le, |b| f64::from(u32::from_le_bytes(b))),
            Elem::U8 => conv(data, le, |b| u64::from_le_bytes(b) as f64),
            Elem::B1 => conv(data, le, |b: [u8; 1]| if b[0] != 0 { 1.0 } else { 0.0 }),
        }
    }
}

#[cfg(test)]
mod tests;
