//! The sketch's one heavy operation: a block of vectors times the Gram matrix G of the
//! smaller side of a sample, on host buffers ([`GramOperator`]).
//!
//! Given the sample A itself (n × d), G·V = a·(aᵀ·V) with a the r × c orientation of A
//! (r = min(n, d) ≤ c), never formed. Done as two whole products, A streams from memory
//! twice: at 2,048 × 4,096 float32 (32 MiB) it does not fit the caches. For a matrix of
//! 16 MiB or more the products go by slabs of about 1 MiB (columns of a: columns of a wide
//! A, rows of a tall one): a slab's first product brings it into the cache, its second
//! reads it there. The values are the same products summed in another order.
//!
//! Given G itself (r × r, as a device reduced it), G·V is one product.

use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef, Par};

/// Elements of a in one slab (1 MiB of float32): within a core's share of the cache.
const SLAB_ELEMENTS: usize = 1 << 18;
/// Below this many elements (16 MiB of float32) a stays in the cache between the two
/// whole products, and slabs only add calls.
const SLABS_FROM_ELEMENTS: usize = 1 << 22;

/// The Gram matrix G of the smaller side of a sample (r × r, r = min(n, d)), as the sketch
/// applies it.
#[derive(Debug, Clone, Copy)]
pub enum GramOperator<'a> {
    /// The sample A itself (n × d, float32, any strides — typically row-major), already
    /// centred if centring was asked: G = AᵀA when d ≤ n, else AAᵀ, applied as two
    /// products, never formed.
    Factored(MatRef<'a, f32>),
    /// G itself (r × r, symmetric, float32), as a device reduced it.
    Explicit(MatRef<'a, f32>),
}

/// G·V for a block V (r × b), and for [`GramOperator::Factored`] the half-way product
/// aᵀ·V (c × b), whose Gram matrix (aᵀV)ᵀ(aᵀV) = VᵀGV the sketch forms without G's
/// round-off.
#[derive(Debug)]
pub struct GramProduct {
    /// aᵀ·V·s, `None` for an explicit G.
    pub half: Option<Mat<f32>>,
    /// G·V·s².
    pub full: Mat<f32>,
}

impl GramOperator<'_> {
    /// r: the order of G (the smaller side of a factored sample).
    pub fn side(&self) -> usize {
        match self {
            GramOperator::Factored(x) => x.nrows().min(x.ncols()),
            GramOperator::Explicit(g) => g.nrows(),
        }
    }

    /// Whether the operator is well formed: an explicit G is square.
    pub(crate) fn is_valid(&self) -> bool {
        match self {
            GramOperator::Factored(_) => true,
            GramOperator::Explicit(g) => g.nrows() == g.ncols(),
        }
    }

    /// G·V scaled by `scale`² (and aᵀ·V by `scale`), in float32 on one thread. `scale` is
    /// applied between the two products (to V for an explicit G), so that float32 neither
    /// overflows for large activations nor underflows for tiny ones: with `scale` =
    /// 1/‖A‖_F every value is at most ‖V‖ in size.
    pub fn apply(&self, v: MatRef<'_, f32>, scale: f32) -> GramProduct {
        match *self {
            GramOperator::Factored(x) => {
                let a = if x.nrows() <= x.ncols() {
                    x
                } else {
                    x.transpose()
                };
                let (half, full) = factored_times(a, v, scale);
                GramProduct {
                    half: Some(half),
                    full,
                }
            }
            GramOperator::Explicit(g) => {
                // G·(V·s)·s: |G·V·s| ≤ ‖G‖·s ≤ tr G · s = √(tr G) when s = 1/√(tr G).
                let scaled = Mat::from_fn(v.nrows(), v.ncols(), |i, j| v[(i, j)] * scale);
                let mut full = Mat::zeros(g.nrows(), v.ncols());
                matmul(
                    full.as_mut(),
                    Accum::Replace,
                    g,
                    scaled.as_ref(),
                    scale,
                    Par::Seq,
                );
                GramProduct { half: None, full }
            }
        }
    }
}

/// (aᵀ·v·s, a·aᵀ·v·s²) for a (r × c) and v (r × b), by slabs of a's columns where a is
/// large.
fn factored_times(a: MatRef<'_, f32>, v: MatRef<'_, f32>, scale: f32) -> (Mat<f32>, Mat<f32>) {
    let (r, c) = a.shape();
    let b = v.ncols();
    let mut half = Mat::zeros(c, b);
    let mut full = Mat::zeros(r, b);
    if r * c < SLABS_FROM_ELEMENTS {
        matmul(
            half.as_mut(),
            Accum::Replace,
            a.transpose(),
            v,
            scale,
            Par::Seq,
        );
        matmul(
            full.as_mut(),
            Accum::Replace,
            a,
            half.as_ref(),
            scale,
            Par::Seq,
        );
        return (half, full);
    }
    let width = (SLAB_ELEMENTS / r.max(1)).max(16);
    let mut start = 0;
    while start < c {
        let w = width.min(c - start);
        let slab = a.subcols(start, w);
        let mut part = half.as_mut().subrows_mut(start, w);
        matmul(
            part.as_mut(),
            Accum::Replace,
            slab.transpose(),
            v,
            scale,
            Par::Seq,
        );
        matmul(
            full.as_mut(),
            Accum::Add,
            slab,
            part.as_ref(),
            scale,
            Par::Seq,
        );
        start += w;
    }
    (half, full)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::spectral::{SplitMix64, gaussian};
    use faer::Scale;

    fn random(rows: usize, cols: usize, seed: u64) -> Mat<f32> {
        let values = gaussian(&mut SplitMix64(seed), rows * cols);
        Mat::from_fn(rows, cols, |i, j| values[i * cols + j])
    }

    fn relative_error(got: MatRef<'_, f32>, want: &Mat<f64>) -> f64 {
        let diff = Mat::from_fn(want.nrows(), want.ncols(), |i, j| {
            f64::from(got[(i, j)]) - want[(i, j)]
        });
        diff.norm_l2() / want.norm_l2()
    }

    /// The slabs give the whole products' values, for wide and tall x, row- and
    /// column-major, with a last slab narrower than the rest; and an explicit G gives
    /// the same G·V.
    #[test]
    fn slabs_and_explicit_give_the_whole_products() {
        for (n, d) in [(1000, 4200), (4200, 1000), (300, 500)] {
            let x = random(n, d, 1);
            let row_major: Vec<f32> = (0..n * d).map(|e| x[(e / d, e % d)]).collect();
            let r = n.min(d);
            let v = random(r, 16, 2);
            let scale = 0.01f32;
            let x64 = Mat::from_fn(n, d, |i, j| f64::from(x[(i, j)]));
            let a64 = if n <= d {
                x64.clone()
            } else {
                x64.transpose().to_owned()
            };
            let v64 = Mat::from_fn(r, 16, |i, j| f64::from(v[(i, j)]));
            let s = f64::from(scale);
            let half_ref = a64.transpose() * &v64 * Scale(s);
            let full_ref = &a64 * &half_ref * Scale(s);
            for x in [x.as_ref(), MatRef::from_row_major_slice(&row_major, n, d)] {
                let product = GramOperator::Factored(x).apply(v.as_ref(), scale);
                let half = product.half.expect("a factored product has a half");
                assert!(
                    relative_error(half.as_ref(), &half_ref) < 1e-5,
                    "{n} x {d}: aᵀ·v"
                );
                assert!(
                    relative_error(product.full.as_ref(), &full_ref) < 1e-5,
                    "{n} x {d}"
                );
            }
            let g64 = &a64 * a64.transpose();
            let g = Mat::from_fn(r, r, |i, j| g64[(i, j)] as f32);
            let product = GramOperator::Explicit(g.as_ref()).apply(v.as_ref(), scale);
            assert!(product.half.is_none());
            assert!(
                relative_error(product.full.as_ref(), &full_ref) < 1e-5,
                "{n} x {d}: G"
            );
            assert_eq!(GramOperator::Explicit(g.as_ref()).side(), r);
            assert_eq!(GramOperator::Factored(x.as_ref()).side(), r);
        }
    }
}
