//! What an adapter hands the core, and the one reading of an activation on the host.
//!
//! An adapter (the Python package through DLPack, a tch program through its tensors)
//! hands over one of two things:
//! - an activation in host memory ([`HostActivation`]: a pointer, its element type,
//!   shape and strides), which [`read_sample`] turns into the sample matrix here:
//!   the matrix of the table below, its rows sampled down to the cap, as float32
//!   in a buffer of the agent's own (training may change its activation in place
//!   later);
//! - or what a device already reduced the sample to ([`Reduced`]: the health sums
//!   and the Gram matrix of the smaller side), for activations that live on a GPU.
//!
//! Either way the result is a [`HostSample`], which [`super::measure`](mod@super::measure) measures on
//! the metrics thread.
//!
//! # From an activation to a matrix A (n rows = samples, d columns = features)
//!
//! | activation | matrix |
//! |---|---|
//! | `()` (a scalar) | `(1, 1)` |
//! | `(D)` | `(1, D)` |
//! | `(B, D)` | as is |
//! | `(B, T, D)` | `(B·T, D)` |
//! | `(B, C, H, W)` | [`ConvLayout::Channelwise`]: `(B·H·W, C)`; [`ConvLayout::Flatten`]: `(B, C·H·W)` |
//! | anything else | `(B, product of the rest)` |
//!
//! [`MatrixPlan`] is that table, once, for both adapters: the Python package asks it
//! how to reshape on its device.

use std::fmt;
use std::marker::PhantomData;

use half::{bf16, f16};

use super::options::ConvLayout;
use super::prepare::choose_rows;

/// The element types an activation may have on the host. Anything else (integers,
/// booleans, complex, quantized) cannot be measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElementType {
    F32,
    F64,
    F16,
    BF16,
}

impl ElementType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ElementType::F32 => 4,
            ElementType::F64 => 8,
            ElementType::F16 | ElementType::BF16 => 2,
        }
    }
}

/// Why an activation could not be read. Its text goes into an `events` row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SampleError {
    /// An element type that is not a float of 16, 32 or 64 bits.
    ElementType(String),
    /// Not in host memory (an adapter that reduces on the device handles those).
    Device(String),
    /// Shape and strides that do not describe a dense strided array.
    Layout(String),
}

impl fmt::Display for SampleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SampleError::ElementType(what) => write!(
                f,
                "element type {what} cannot be measured (float16, bfloat16, float32 and float64 can)"
            ),
            SampleError::Device(what) => write!(f, "tensor on {what} cannot be read on the host"),
            SampleError::Layout(what) => write!(f, "unreadable layout: {what}"),
        }
    }
}

impl std::error::Error for SampleError {}

/// The matrix an activation of `shape` becomes (the module table), and how its
/// elements are addressed: a row index runs over `row_dims`, a column index over
/// `col_dims`, each a list of (size, stride) from outer to inner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatrixPlan {
    pub rows: usize,
    pub cols: usize,
    /// `"channelwise"` or `"flatten"` for a 4-D activation, `""` otherwise.
    pub conv_layout: &'static str,
    /// The activation's dimensions that make up a row index, outer first.
    pub row_axes: Vec<usize>,
    /// The activation's dimensions that make up a column index, outer first.
    pub col_axes: Vec<usize>,
}

impl MatrixPlan {
    /// The plan for an activation of `shape` (negative sizes count as 0).
    pub fn new(shape: &[i64], layout: ConvLayout) -> MatrixPlan {
        let size = |axes: &[usize]| -> usize {
            axes.iter()
                .map(|&a| usize::try_from(shape[a]).unwrap_or(0))
                .product()
        };
        let (row_axes, col_axes, conv_layout): (Vec<usize>, Vec<usize>, &'static str) =
            match shape.len() {
                0 => (vec![], vec![], ""),
                1 => (vec![], vec![0], ""),
                3 => (vec![0, 1], vec![2], ""),
                4 => match layout {
                    ConvLayout::Channelwise => (vec![0, 2, 3], vec![1], layout.label()),
                    ConvLayout::Flatten => (vec![0], vec![1, 2, 3], layout.label()),
                },
                n => (vec![0], (1..n).collect(), ""),
            };
        MatrixPlan {
            rows: size(&row_axes),
            cols: size(&col_axes),
            conv_layout,
            row_axes,
            col_axes,
        }
    }
}

/// An activation in host memory, as an adapter sees it: valid for `'a`.
#[derive(Debug, Clone, Copy)]
pub struct HostActivation<'a> {
    data: *const u8,
    element: ElementType,
    shape: &'a [i64],
    /// In elements, one per dimension.
    strides: &'a [i64],
    _borrow: PhantomData<&'a [u8]>,
}

impl<'a> HostActivation<'a> {
    /// An activation of `shape` whose element at index `i` is at `data + Σ iₖ·strides[k]`
    /// elements. Checks that the shape and strides describe a dense strided array
    /// (sizes and strides not negative, one stride per dimension, offsets within `isize`).
    ///
    /// # Safety
    /// Every element the shape and strides address must be readable for `'a` and not
    /// written to while this value or a sample read from it is being made.
    pub unsafe fn new(
        data: *const u8,
        element: ElementType,
        shape: &'a [i64],
        strides: &'a [i64],
    ) -> Result<HostActivation<'a>, SampleError> {
        if shape.len() != strides.len() {
            return Err(SampleError::Layout(format!(
                "{} sizes but {} strides",
                shape.len(),
                strides.len()
            )));
        }
        if let Some(bad) = shape.iter().chain(strides).find(|&&v| v < 0) {
            return Err(SampleError::Layout(format!(
                "negative size or stride {bad} in shape {shape:?}, strides {strides:?}"
            )));
        }
        let empty = shape.contains(&0);
        if data.is_null() && !empty {
            return Err(SampleError::Layout("no data".into()));
        }
        // The largest offset must fit in an isize of bytes.
        let last = shape.iter().zip(strides).try_fold(0i128, |acc, (&n, &s)| {
            let add = i128::from((n - 1).max(0)) * i128::from(s);
            Some(acc + add)
        });
        let fits = last.is_some_and(|l| l * element.size() as i128 <= isize::MAX as i128);
        if !fits {
            return Err(SampleError::Layout(format!(
                "shape {shape:?} with strides {strides:?} is too large"
            )));
        }
        Ok(HostActivation {
            data,
            element,
            shape,
            strides,
            _borrow: PhantomData,
        })
    }

    pub fn shape(&self) -> &'a [i64] {
        self.shape
    }
}

/// An element type read as float32.
trait Element: Copy {
    fn to_f32(self) -> f32;
}

impl Element for f32 {
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Element for f64 {
    #[inline]
    fn to_f32(self) -> f32 {
        self as f32
    }
}

impl Element for f16 {
    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl Element for bf16 {
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// The offsets (in elements) of every index of the dimensions `axes`, in row-major
/// order of those dimensions.
fn offsets(shape: &[i64], strides: &[i64], axes: &[usize]) -> Vec<usize> {
    let mut out = vec![0usize];
    for &axis in axes {
        let n = usize::try_from(shape[axis]).unwrap_or(0);
        let s = usize::try_from(strides[axis]).unwrap_or(0);
        out = out
            .iter()
            .flat_map(|&base| (0..n).map(move |i| base + i * s))
            .collect();
    }
    out
}

/// The offset of row index `row` over the dimensions `axes` (row-major order).
fn row_offset(shape: &[i64], strides: &[i64], axes: &[usize], mut row: usize) -> usize {
    let mut offset = 0;
    for &axis in axes.iter().rev() {
        let n = usize::try_from(shape[axis]).unwrap_or(1).max(1);
        offset += (row % n) * usize::try_from(strides[axis]).unwrap_or(0);
        row /= n;
    }
    offset
}

/// Which elements a sample reads: the chosen rows of the plan's matrix, and its
/// column offsets (one stride where they are a dense run).
struct Gather<'a> {
    shape: &'a [i64],
    strides: &'a [i64],
    plan: &'a MatrixPlan,
    rows: &'a [usize],
    cols: &'a [usize],
    step: Option<usize>,
}

impl Gather<'_> {
    /// Appends the chosen rows to `buffer`, as float32.
    fn append_to<T: Element>(&self, data: *const T, buffer: &mut Vec<f32>) {
        let n = self.plan.cols;
        // SAFETY (every read): base + j·s and base + cols[j] are offsets the shape and
        // strides address (row < plan.rows, j < plan.cols), which `HostActivation::new`'s
        // contract makes readable; unaligned reads cost nothing here.
        for &row in self.rows {
            let base = row_offset(self.shape, self.strides, &self.plan.row_axes, row);
            match self.step {
                Some(s) => buffer.extend(
                    (0..n).map(|j| unsafe { data.add(base + j * s).read_unaligned() }.to_f32()),
                ),
                None => buffer.extend(
                    self.cols
                        .iter()
                        .map(|&c| unsafe { data.add(base + c).read_unaligned() }.to_f32()),
                ),
            }
        }
    }
}

/// A sample matrix of the agent's own: `rows × cols` float32 values, row-major.
#[derive(Debug, Default)]
pub struct SampleMatrix {
    pub values: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

/// Reads the sample matrix of `activation` into `buffer` (reused: its allocation is
/// kept): the matrix of the module table, its rows drawn down to `max_rows` (0: no
/// cap) with `seed` ([`choose_rows`]), as float32. Returns the matrix and the
/// `conv_layout` label.
pub fn read_sample(
    activation: &HostActivation<'_>,
    layout: ConvLayout,
    max_rows: usize,
    seed: u64,
    mut buffer: Vec<f32>,
) -> (SampleMatrix, &'static str) {
    let plan = MatrixPlan::new(activation.shape, layout);
    let (shape, strides) = (activation.shape, activation.strides);
    let rows: Vec<usize> = if max_rows > 0 && plan.rows > max_rows {
        choose_rows(plan.rows as u64, max_rows as u64, seed)
            .into_iter()
            .map(|r| r as usize)
            .collect()
    } else {
        (0..plan.rows).collect()
    };
    buffer.clear();
    buffer.reserve(rows.len() * plan.cols);
    // One column stride when the column dimensions are one dense run (every case of
    // the table but `flatten` over a permuted tensor): a tight loop per row.
    let cols = offsets(shape, strides, &plan.col_axes);
    let step = match cols.as_slice() {
        [] | [_] => Some(1),
        [a, b, ..] => b
            .checked_sub(*a)
            .filter(|&s| cols.windows(2).all(|w| w[1].checked_sub(w[0]) == Some(s))),
    };
    let read = Gather {
        shape,
        strides,
        plan: &plan,
        rows: &rows,
        cols: &cols,
        step,
    };
    let data = activation.data;
    match activation.element {
        ElementType::F32 => read.append_to(data.cast::<f32>(), &mut buffer),
        ElementType::F64 => read.append_to(data.cast::<f64>(), &mut buffer),
        ElementType::F16 => read.append_to(data.cast::<f16>(), &mut buffer),
        ElementType::BF16 => read.append_to(data.cast::<bf16>(), &mut buffer),
    }
    (
        SampleMatrix {
            values: buffer,
            rows: rows.len(),
            cols: plan.cols,
        },
        plan.conv_layout,
    )
}

/// A host buffer of float32 values that an adapter owns (a pinned tensor of the
/// device's reduction, held through DLPack), kept until the sample is measured.
pub trait F32Buffer: Send {
    fn values(&self) -> &[f32];
}

impl F32Buffer for Vec<f32> {
    fn values(&self) -> &[f32] {
        self
    }
}

/// The same for float64 values (a device's packed sketch summary).
pub trait F64Buffer: Send {
    fn values(&self) -> &[f64];
}

impl F64Buffer for Vec<f64> {
    fn values(&self) -> &[f64] {
        self
    }
}

/// The sums the health columns follow from, over the finite elements of a sample.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HealthSums {
    /// Finite elements.
    pub finite: u64,
    /// NaN and ±Inf elements.
    pub nonfinite: u64,
    /// Σx over the finite elements.
    pub sum: f64,
    /// Σx² over the finite elements.
    pub sum_sq: f64,
    /// Exact zeros.
    pub zeros: u64,
}

/// A sample a device reduced to what the host needs: its health sums and the Gram
/// matrix of its smaller side (`side × side`, row-major, centred when centring is
/// on), or none when some element is not finite (no spectrum is measured then).
pub struct Reduced {
    pub health: HealthSums,
    pub gram: Option<Box<dyn F32Buffer>>,
    pub side: usize,
}

impl fmt::Debug for Reduced {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reduced")
            .field("health", &self.health)
            .field("side", &self.side)
            .field("gram", &self.gram.as_ref().map(|g| g.values().len()))
            .finish()
    }
}

/// A sample a device reduced for the sketch ([`crate::sampling::sketch`]): its health
/// sums, Σλ (the trace of its Gram matrix, centred when centring is on) and the Krylov
/// process it ran, packed in [`super::sketch::KrylovSummary::from_packed`]'s order and read on the
/// metrics thread, or none when some element is not finite (no spectrum then).
pub struct Sketched {
    pub health: HealthSums,
    pub trace: f64,
    pub packed: Option<Box<dyn F64Buffer>>,
}

impl fmt::Debug for Sketched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sketched")
            .field("health", &self.health)
            .field("trace", &self.trace)
            .field("packed", &self.packed.as_ref().map(|p| p.values().len()))
            .finish()
    }
}

/// What a sample holds: the matrix itself, or a device's reduction of it (its Gram
/// matrix, or the sketch's Krylov process).
#[derive(Debug)]
pub enum SampleData {
    Matrix(Vec<f32>),
    Reduced(Reduced),
    Sketched(Sketched),
}

/// A sample as the metrics thread measures it.
#[derive(Debug)]
pub struct HostSample {
    /// Rows of the matrix measured (after row sampling).
    pub rows: usize,
    pub cols: usize,
    /// `"channelwise"` or `"flatten"` for a 4-D activation, `""` otherwise.
    pub conv_layout: &'static str,
    /// The sampling seed; the sketch draws its random vectors from it too.
    pub seed: u64,
    pub data: SampleData,
}

impl HostSample {
    /// A sample of the matrix `matrix`.
    pub fn matrix(matrix: SampleMatrix, conv_layout: &'static str, seed: u64) -> HostSample {
        HostSample {
            rows: matrix.rows,
            cols: matrix.cols,
            conv_layout,
            seed,
            data: SampleData::Matrix(matrix.values),
        }
    }

    /// The host memory its data holds.
    pub fn bytes(&self) -> u64 {
        let bytes = match &self.data {
            SampleData::Matrix(values) => size_of_val(values.as_slice()),
            SampleData::Reduced(r) => r.gram.as_ref().map_or(0, |g| size_of_val(g.values())),
            SampleData::Sketched(s) => s.packed.as_ref().map_or(0, |p| size_of_val(p.values())),
        };
        bytes as u64
    }

    /// Takes back the matrix buffer, for reuse, once measured.
    pub fn into_buffer(self) -> Option<Vec<f32>> {
        match self.data {
            SampleData::Matrix(values) => Some(values),
            SampleData::Reduced(_) | SampleData::Sketched(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<'a>(values: &'a [f32], shape: &'a [i64], strides: &'a [i64]) -> HostActivation<'a> {
        // SAFETY: the tests' shapes and strides address `values` only.
        unsafe { HostActivation::new(values.as_ptr().cast(), ElementType::F32, shape, strides) }
            .unwrap()
    }

    #[test]
    fn the_table() {
        let plan = |s: &[i64], l| {
            let p = MatrixPlan::new(s, l);
            (p.rows, p.cols, p.conv_layout)
        };
        let c = ConvLayout::Channelwise;
        assert_eq!(plan(&[], c), (1, 1, ""));
        assert_eq!(plan(&[5], c), (1, 5, ""));
        assert_eq!(plan(&[4, 5], c), (4, 5, ""));
        assert_eq!(plan(&[2, 3, 5], c), (6, 5, ""));
        assert_eq!(plan(&[2, 3, 4, 5], c), (40, 3, "channelwise"));
        assert_eq!(plan(&[2, 3, 4, 5], ConvLayout::Flatten), (2, 60, "flatten"));
        assert_eq!(plan(&[2, 3, 4, 5, 6], c), (2, 360, ""));
        assert_eq!(plan(&[0, 7], c), (0, 7, ""));
    }

    #[test]
    fn channelwise_reads_every_position_as_a_row_of_channels() {
        // (B=1, C=2, H=1, W=3), contiguous: channel 0 = 0,1,2; channel 1 = 10,11,12.
        let values = [0.0, 1.0, 2.0, 10.0, 11.0, 12.0];
        let a = view(&values, &[1, 2, 1, 3], &[6, 3, 3, 1]);
        let (m, label) = read_sample(&a, ConvLayout::Channelwise, 0, 0, Vec::new());
        assert_eq!(label, "channelwise");
        assert_eq!((m.rows, m.cols), (3, 2));
        assert_eq!(m.values, vec![0.0, 10.0, 1.0, 11.0, 2.0, 12.0]);
    }

    #[test]
    fn strided_views_read_as_their_logical_matrix() {
        // The transpose of a 2 × 3 row-major matrix.
        let values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let a = view(&values, &[3, 2], &[1, 3]);
        let (m, _) = read_sample(&a, ConvLayout::Channelwise, 0, 0, Vec::new());
        assert_eq!(m.values, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        // Flatten over a permuted (B, C, H, W): columns are not one dense run.
        let values: Vec<f32> = (0..8).map(|v| v as f32).collect();
        let a = view(&values, &[1, 2, 2, 2], &[8, 1, 4, 2]);
        let (m, _) = read_sample(&a, ConvLayout::Flatten, 0, 0, Vec::new());
        assert_eq!(m.values, vec![0.0, 2.0, 4.0, 6.0, 1.0, 3.0, 5.0, 7.0]);
    }

    #[test]
    fn rows_beyond_the_cap_are_drawn_from_the_seed() {
        let values: Vec<f32> = (0..100).map(|v| v as f32).collect();
        let a = view(&values, &[50, 2], &[2, 1]);
        let (m, _) = read_sample(&a, ConvLayout::Channelwise, 10, 7, Vec::new());
        let rows = choose_rows(50, 10, 7);
        assert_eq!(m.rows, 10);
        for (i, r) in rows.iter().enumerate() {
            assert_eq!(m.values[2 * i], (2 * r) as f32);
        }
    }

    #[test]
    fn half_precision_is_read_as_float32() {
        let values = [bf16::from_f32(1.5), bf16::from_f32(-2.0)];
        // SAFETY: two elements, both addressed.
        let a =
            unsafe { HostActivation::new(values.as_ptr().cast(), ElementType::BF16, &[2], &[1]) }
                .unwrap();
        let (m, _) = read_sample(&a, ConvLayout::Channelwise, 0, 0, Vec::new());
        assert_eq!(m.values, vec![1.5, -2.0]);
    }

    #[test]
    fn bad_layouts_are_refused() {
        let values = [0.0f32; 4];
        // SAFETY: refused before any read.
        let bad =
            unsafe { HostActivation::new(values.as_ptr().cast(), ElementType::F32, &[2, 2], &[1]) };
        assert!(matches!(bad, Err(SampleError::Layout(_))));
        let bad = unsafe {
            HostActivation::new(values.as_ptr().cast(), ElementType::F32, &[2, -1], &[1, 1])
        };
        assert!(matches!(bad, Err(SampleError::Layout(_))));
    }
}
