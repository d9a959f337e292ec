//! The sketch's one heavy operation: a block of vectors times the Gram matrix of a
//! large matrix x, without forming the Gram matrix, read from memory once.
//!
//! G·V = a·(aᵀ·V), with a the r × c orientation of x (r ≤ c). Done as two whole
//! products, x streams from memory twice: at 2,048 × 4,096 float32 (32 MiB) it does
//! not fit the caches. On the CPU the products go by slabs of x of about 1 MiB (whole
//! rows of a tall x, columns of a wide one): a slab's first product brings it into the
//! cache, its second reads it there. One thread, a block of 16 vectors: 1.2–1.5× less
//! CPU at 2,048 × 4,096 and 1.5–1.7× at 4,096 × 2,048, none below 16 MiB
//! (BENCHMARKS.md). On a GPU the whole products stay: each slab would be two more
//! kernel launches.

use tch::{Device, Kind, TchError, Tensor};

/// Elements of x in one slab (1 MiB of float32): within a core's share of the cache.
const SLAB_ELEMENTS: i64 = 1 << 18;
/// Below this many elements (16 MiB of float32) x stays in the cache between the two
/// whole products, and slabs only add calls.
const SLABS_FROM_ELEMENTS: i64 = 1 << 22;

/// (aᵀ·v · scale, G·v · scale²) for x (n × d, float32) and v (r × b), with a = x if
/// n ≤ d, else xᵀ. x is taken as it is stored, never copied: each product reads it in
/// the layout the BLAS reads fastest (a transposed x as the left factor cost about
/// 16 % more CPU per product, one thread, 2,048 × 4,096). `scale` is applied to aᵀ·v
/// before the second product, so float32 neither overflows for large activations nor
/// underflows for tiny ones.
pub(super) fn gram_times(x: &Tensor, v: &Tensor, scale: f64) -> Result<(Tensor, Tensor), TchError> {
    let (n, d) = (x.size()[0], x.size()[1]);
    let slabs = x.device() == Device::Cpu && n * d >= SLABS_FROM_ELEMENTS;
    if n <= d {
        // a = x: aᵀ·v = (vᵀ·x)ᵀ and G·v = (vᵀ·x·xᵀ)ᵀ; slabs of x's columns.
        let vt = v.f_tr()?;
        if !slabs {
            let half = vt.f_matmul(x)?.f_mul_scalar(scale)?;
            let full = half.f_matmul(&x.f_tr()?)?.f_mul_scalar(scale)?;
            return Ok((half.f_tr()?, full.f_tr()?));
        }
        let width = (SLAB_ELEMENTS / n).max(16);
        let mut full = Tensor::f_zeros([v.size()[1], n], (Kind::Float, x.device()))?;
        let mut halves = Vec::with_capacity((d / width + 1) as usize);
        for start in (0..d).step_by(width as usize) {
            let slab = x.f_narrow(1, start, width.min(d - start))?;
            let half = vt.f_matmul(&slab)?.f_mul_scalar(scale)?;
            let _ = full.f_addmm_(&half, &slab.f_tr()?)?;
            halves.push(half);
        }
        let half = Tensor::f_cat(&halves, 1)?;
        Ok((half.f_tr()?, full.f_mul_scalar(scale)?.f_tr()?))
    } else {
        // a = xᵀ: aᵀ·v = x·v and G·v = ((x·v)ᵀ·x)ᵀ; slabs of x's rows.
        if !slabs {
            let half = x.f_matmul(v)?.f_mul_scalar(scale)?;
            let full = half.f_tr()?.f_matmul(x)?.f_mul_scalar(scale)?;
            return Ok((half, full.f_tr()?));
        }
        let height = (SLAB_ELEMENTS / d).max(16);
        let mut full = Tensor::f_zeros([v.size()[1], d], (Kind::Float, x.device()))?;
        let mut halves = Vec::with_capacity((n / height + 1) as usize);
        for start in (0..n).step_by(height as usize) {
            let slab = x.f_narrow(0, start, height.min(n - start))?;
            let half = slab.f_matmul(v)?.f_mul_scalar(scale)?;
            let _ = full.f_addmm_(&half.f_tr()?, &slab)?;
            halves.push(half);
        }
        Ok((
            Tensor::f_cat(&halves, 0)?,
            full.f_mul_scalar(scale)?.f_tr()?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slabs give the whole products' values, for wide and tall x, with a last
    /// slab narrower than the rest.
    #[test]
    fn slabs_give_the_whole_products() {
        for (n, d) in [(1000, 4200), (4200, 1000)] {
            let x = Tensor::randn([n, d], (Kind::Float, Device::Cpu));
            let r = n.min(d);
            let v = Tensor::randn([r, 16], (Kind::Float, Device::Cpu));
            let scale = 0.01;
            let (half, full) = gram_times(&x, &v, scale).unwrap();
            let x64 = x.to_kind(Kind::Double);
            let a = if n <= d {
                x64.shallow_clone()
            } else {
                x64.tr()
            };
            let v64 = v.to_kind(Kind::Double);
            let half_ref = a.tr().matmul(&v64) * scale;
            let full_ref = a.matmul(&half_ref) * scale;
            assert_eq!(half.size(), half_ref.size());
            assert_eq!(full.size(), full_ref.size());
            let err = |got: &Tensor, want: &Tensor| {
                let diff = (got.to_kind(Kind::Double) - want).norm().double_value(&[]);
                diff / want.norm().double_value(&[])
            };
            assert!(err(&half, &half_ref) < 1e-5, "{n} x {d}: aᵀ·v");
            assert!(err(&full, &full_ref) < 1e-5, "{n} x {d}: G·v");
        }
    }
}
