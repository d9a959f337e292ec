//! The reader's tests, and the writer they round-trip through.

use super::*;
use std::io::{BufWriter, Write};
use tch::{Device, Kind};

/// Writes a tensor as a `'<f8'` `.npy` file that `numpy.load` reads back; any real kind
/// is converted to float64 and any device's data is copied to the host.
fn write_npy(path: &Path, tensor: &Tensor) -> io::Result<()> {
    let shape = tensor.size();
    let flat = tensor
        .f_to_device(Device::Cpu)
        .and_then(|t| t.f_to_kind(Kind::Double))
        .and_then(|t| t.f_reshape([-1]))
        .and_then(|t| Vec::<f64>::try_from(&t))
        .map_err(io::Error::other)?;
    let dims: Vec<String> = shape.iter().map(i64::to_string).collect();
    let tuple = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!("{{'descr': '<f8', 'fortran_order': False, 'shape': {tuple}, }}");
    let (version, len_bytes) = if header.len() + 11 <= usize::from(u16::MAX) {
        (1u8, 2)
    } else {
        (2u8, 4)
    };
    // Pad with spaces so that the data starts on a 64-byte boundary, then end with '\n'.
    let unpadded = MAGIC.len() + 2 + len_bytes + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let mut out = BufWriter::new(File::create(path)?);
    out.write_all(MAGIC)?;
    out.write_all(&[version, 0])?;
    if version == 1 {
        out.write_all(&(header.len() as u16).to_le_bytes())?;
    } else {
        out.write_all(&(header.len() as u32).to_le_bytes())?;
    }
    out.write_all(header.as_bytes())?;
    for value in &flat {
        out.write_all(&value.to_le_bytes())?;
    }
    out.flush()
}

/// A `.npy` file built byte by byte, independently of [`write_npy`].
fn npy_bytes(version: u8, header: &str, data: &[u8]) -> Vec<u8> {
    let len_bytes = if version == 1 { 2 } else { 4 };
    let mut header = header.to_string();
    while !(MAGIC.len() + 2 + len_bytes + header.len() + 1).is_multiple_of(64) {
        header.push(' ');
    }
    header.push('\n');
    let mut out = MAGIC.to_vec();
    out.extend([version, 0]);
    if version == 1 {
        out.extend((header.len() as u16).to_le_bytes());
    } else {
        out.extend((header.len() as u32).to_le_bytes());
    }
    out.extend(header.as_bytes());
    out.extend(data);
    out
}

fn write_file(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn values(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(&t.reshape([-1])).unwrap()
}

#[test]
fn round_trip() {
    let dir = tempfile::tempdir().unwrap();
    for shape in [vec![3i64, 4], vec![2, 3, 4], vec![5], vec![], vec![0, 3]] {
        let numel: i64 = shape.iter().product();
        let t = (Tensor::arange(numel, (Kind::Double, Device::Cpu)) * 0.5 - 1.25)
            .reshape(shape.as_slice());
        let path = dir.path().join("m.npy");
        write_npy(&path, &t).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(
            (bytes.len() - 8 * numel as usize) % 64,
            0,
            "data aligned to 64 bytes"
        );
        let back = read_npy(&path).unwrap();
        assert_eq!(back.kind(), Kind::Double);
        assert_eq!(back.size(), shape);
        assert_eq!(values(&back), values(&t));
    }
    // Other kinds are written as float64.
    let path = dir.path().join("f.npy");
    write_npy(&path, &Tensor::from_slice(&[1.5f32, -2.0])).unwrap();
    assert_eq!(values(&read_npy(&path).unwrap()), [1.5, -2.0]);
}

#[test]
fn reads_a_hand_built_f4_file() {
    let dir = tempfile::tempdir().unwrap();
    let floats = [1.0f32, -2.5, 3.25, 0.0, 1e-3, 7.0];
    let data: Vec<u8> = floats.iter().flat_map(|v| v.to_le_bytes()).collect();
    let path = write_file(
        &dir,
        "f4.npy",
        &npy_bytes(
            1,
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
            &data,
        ),
    );
    let t = read_npy(&path).unwrap();
    assert_eq!(t.size(), [2, 3]);
    assert_eq!(values(&t), floats.map(f64::from));
}

#[test]
fn reads_other_dtypes_versions_and_byte_orders() {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(u8, &str, Vec<u8>, Vec<f64>)> = vec![
        (
            2,
            "{'descr': '<i8', 'fortran_order': False, 'shape': (3,)}",
            [-1i64, 0, 1 << 40]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            vec![-1.0, 0.0, (1u64 << 40) as f64],
        ),
        (
            3,
            "{\"descr\": \"<i4\", \"fortran_order\": False, \"shape\": (2L, 1L), }",
            [-7i32, 9].iter().flat_map(|v| v.to_le_bytes()).collect(),
            vec![-7.0, 9.0],
        ),
        (
            1,
            "{'descr': '|u1', 'fortran_order': False, 'shape': (2,), }",
            vec![0, 255],
            vec![0.0, 255.0],
        ),
        (
            1,
            "{'descr': '|b1', 'fortran_order': False, 'shape': (2,), }",
            vec![1, 0],
            vec![1.0, 0.0],
        ),
        (
            1,
            "{'descr': '>f8', 'fortran_order': False, 'shape': (2,), }",
            [0.5f64, -3.0]
                .iter()
                .flat_map(|v| v.to_be_bytes())
                .collect(),
            vec![0.5, -3.0],
        ),
        (
            1,
            "{'shape': (), 'fortran_order': False, 'descr': '<f8'}",
            4.0f64.to_le_bytes().to_vec(),
            vec![4.0],
        ),
    ];
    for (version, header, data, expected) in cases {
        let path = write_file(&dir, "x.npy", &npy_bytes(version, header, &data));
        let t = read_npy(&path).unwrap_or_else(|e| panic!("{header}: {e}"));
        assert_eq!(values(&t), expected, "{header}");
    }
}

#[test]
fn truncated_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let data = vec![0u8; 8 * 12];
    let full = npy_bytes(
        1,
        "{'descr': '<f8', 'fortran_order': False, 'shape': (3, 4), }",
        &data,
    );
    let path = write_file(&dir, "short.npy", &full[..full.len() - 5]);
    let err = read_npy(&path).unwrap_err();
    assert!(
        matches!(
            err,
            NpyError::Length {
                expected: 96,
                actual: 91,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("short.npy"), "{err}");
    // Cut inside the header.
    let path = write_file(&dir, "header.npy", &full[..20]);
    assert!(matches!(read_npy(&path), Err(NpyError::Header { .. })));
    // Cut inside the preamble.
    let path = write_file(&dir, "preamble.npy", &full[..7]);
    assert!(matches!(read_npy(&path), Err(NpyError::Header { .. })));
    // Trailing bytes are as wrong as missing ones.
    let mut long = full.clone();
    long.push(0);
    let path = write_file(&dir, "long.npy", &long);
    assert!(matches!(read_npy(&path), Err(NpyError::Length { .. })));
}

#[test]
fn fortran_order_is_refused_with_advice() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = npy_bytes(
        1,
        "{'descr': '<f8', 'fortran_order': True, 'shape': (2, 2), }",
        &[0u8; 32],
    );
    let err = read_npy(&write_file(&dir, "f.npy", &bytes)).unwrap_err();
    assert!(matches!(err, NpyError::FortranOrder { .. }));
    assert!(err.to_string().contains("ascontiguousarray"), "{err}");
}

#[test]
fn bad_magic_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    for (name, bytes) in [
        ("csv.npy", b"1,2,3\n4,5,6\n".as_slice()),
        ("empty.npy", b"".as_slice()),
    ] {
        let err = read_npy(&write_file(&dir, name, bytes)).unwrap_err();
        assert!(matches!(err, NpyError::BadMagic { .. }), "{err}");
        assert!(err.to_string().contains(name), "{err}");
    }
    let err = read_npy(&dir.path().join("missing.npy")).unwrap_err();
    assert!(matches!(err, NpyError::Read { .. }), "{err}");
}

#[test]
fn hostile_headers_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        // Overflowing element count.
        "{'descr': '<f8', 'fortran_order': False, 'shape': (4294967296, 4294967296, 4294967296), }",
        // Huge but representable: refused by the length check, before any allocation.
        "{'descr': '<f8', 'fortran_order': False, 'shape': (1099511627776,), }",
        "{'descr': '<f2', 'fortran_order': False, 'shape': (2,), }",
        "{'descr': '|O', 'fortran_order': False, 'shape': (2,), }",
        "{'descr': [('a', '<f8')], 'fortran_order': False, 'shape': (2,), }",
        "{'descr': '<f8', 'shape': (2,), }",
        "{'descr': '<f8', 'fortran_order': False, 'shape': (-2,), }",
        "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), } trailing",
        "{'descr': '<f8', 'fortran_order': maybe, 'shape': (2,), }",
        "not a dict",
    ];
    for header in cases {
        let path = write_file(&dir, "h.npy", &npy_bytes(1, header, &[0u8; 16]));
        let err = read_npy(&path).expect_err(header);
        assert!(
            matches!(
                err,
                NpyError::TooLarge { .. }
                    | NpyError::Length { .. }
                    | NpyError::Dtype { .. }
                    | NpyError::Header { .. }
            ),
            "{header}: {err}"
        );
    }
    let mut bytes = npy_bytes(
        1,
        "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }",
        &[0u8; 16],
    );
    bytes[6] = 4;
    let err = read_npy(&write_file(&dir, "v.npy", &bytes)).unwrap_err();
    assert!(
        matches!(
            err,
            NpyError::Version {
                major: 4,
                minor: 0,
                ..
            }
        ),
        "{err}"
    );
}
