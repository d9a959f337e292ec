//! The exact spectrum ([`exact_spectral`], [`gram_spectral`]): the eigenvalues of the Gram
//! matrix of the smaller side, in float64 on the host (faer). One Gram product and one
//! symmetric eigen-solve serve all six columns; no SVD, which is two orders of magnitude
//! slower on CPU. It imports only [`super::spectral`].

use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef, Par, Side};

use super::spectral::{Spectral, spectral};

/// The six spectral columns of the `n × d` row-major matrix `values`, optionally centred:
/// the Gram matrix of the smaller side in float64, and its eigenvalues.
pub(super) fn exact_spectral(values: &[f32], n: usize, d: usize, centered: bool) -> Spectral {
    let a = MatRef::from_row_major_slice(values, n, d);
    // Column-major float64 copy, centred: the product reads columns.
    let mut x = Mat::<f64>::from_fn(n, d, |i, j| f64::from(a[(i, j)]));
    if centered {
        for j in 0..d {
            let mut col = x.col_mut(j);
            let mean = (0..n).map(|i| col[i]).sum::<f64>() / n as f64;
            for i in 0..n {
                col[i] -= mean;
            }
        }
    }
    // The Gram matrix of the smaller side has the same non-zero eigenvalues and
    // costs less.
    let r = n.min(d);
    let mut gram = Mat::<f64>::zeros(r, r);
    if d <= n {
        matmul(
            gram.as_mut(),
            Accum::Replace,
            x.transpose(),
            x.as_ref(),
            1.0,
            Par::Seq,
        );
    } else {
        matmul(
            gram.as_mut(),
            Accum::Replace,
            x.as_ref(),
            x.transpose(),
            1.0,
            Par::Seq,
        );
    }
    eigen_spectral(gram.as_ref())
}

/// The six spectral columns of a Gram matrix a device formed (`side × side`, float32,
/// row-major, symmetric): its eigenvalues in float64.
pub(super) fn gram_spectral(values: &[f32], side: usize) -> Spectral {
    let g = MatRef::from_row_major_slice(values, side, side);
    // Symmetrised: a device's float32 product need not be exactly symmetric.
    let gram = Mat::<f64>::from_fn(side, side, |i, j| {
        0.5 * (f64::from(g[(i, j)]) + f64::from(g[(j, i)]))
    });
    eigen_spectral(gram.as_ref())
}

fn eigen_spectral(gram: MatRef<'_, f64>) -> Spectral {
    match gram.self_adjoint_eigenvalues(Side::Lower) {
        Ok(eigenvalues) => spectral(&eigenvalues),
        Err(error) => {
            tracing::warn!(?error, "symmetric eigen-solve did not converge");
            Spectral::default()
        }
    }
}
