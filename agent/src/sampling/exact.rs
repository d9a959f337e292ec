//! The exact spectrum ([`exact_spectral`]): the eigenvalues of the Gram matrix of the
//! smaller side, in float64. One Gram product and one symmetric eigen-solve serve all six
//! columns; no SVD, which is two orders of magnitude slower on CPU. It imports only
//! [`super::spectral`].

use tch::{Kind, TchError, Tensor};

use super::spectral::{Spectral, spectral, to_host};

/// The six spectral columns of an `n × d` matrix, optionally centred.
pub(super) fn exact_spectral(matrix: &Tensor, centered: bool) -> Result<Spectral, TchError> {
    let (n, d) = (matrix.size()[0], matrix.size()[1]);
    let x = matrix.f_to_kind(Kind::Double)?;
    let x = if centered {
        x.f_sub(&x.f_mean_dim(0i64, true, Kind::Double)?)?
    } else {
        x
    };
    // The Gram matrix of the smaller side has the same non-zero eigenvalues and
    // costs less.
    let gram = if d <= n {
        x.f_tr()?.f_matmul(&x)?
    } else {
        x.f_matmul(&x.f_tr()?)?
    };
    Ok(spectral(&to_host(&gram.f_linalg_eigvalsh("L")?)?))
}
