//! The sketch's small dense algebra in float64, on this thread: products, symmetric
//! eigen-solves and solves on the Krylov space (faer), and the bookkeeping of a space that
//! grows a block at a time.

use faer::linalg::matmul::matmul;
use faer::linalg::solvers::Solve;
use faer::{Accum, Mat, MatMut, MatRef, Par, Side};

/// lhs · rhs in float64, on this thread.
pub(super) fn mul(lhs: MatRef<'_, f64>, rhs: MatRef<'_, f64>) -> Mat<f64> {
    let mut out = Mat::zeros(lhs.nrows(), rhs.ncols());
    matmul(out.as_mut(), Accum::Replace, lhs, rhs, 1.0, Par::Seq);
    out
}

/// The eigenvalues (ascending) and eigenvectors (columns) of a symmetric matrix, from its
/// lower triangle; `None` where the solver fails (it does not on finite input).
pub(super) fn eigh(m: MatRef<'_, f64>) -> Option<(Vec<f64>, Mat<f64>)> {
    let decomposition = m.self_adjoint_eigen(Side::Lower).ok()?;
    let values = decomposition.S().column_vector().iter().copied().collect();
    Some((values, decomposition.U().to_owned()))
}

/// The eigenvalues (ascending) of a small symmetric matrix, from its lower triangle.
pub(super) fn eigvalsh(m: MatRef<'_, f64>) -> Option<Vec<f64>> {
    m.self_adjoint_eigenvalues(Side::Lower).ok()
}

/// `l⁻¹`-free solve of the symmetric positive definite system `a·x = rhs`.
pub(super) fn solve_spd(a: MatRef<'_, f64>, rhs: MatRef<'_, f64>) -> Option<Mat<f64>> {
    Some(a.llt(Side::Lower).ok()?.solve(rhs))
}

/// The sum of the diagonal.
pub(super) fn trace_of(m: MatRef<'_, f64>) -> f64 {
    (0..m.nrows().min(m.ncols())).map(|i| m[(i, i)]).sum()
}

/// Each entry squared, row-major (rows × cols).
pub(super) fn squared_rows(m: MatRef<'_, f64>) -> Vec<f64> {
    (0..m.nrows())
        .flat_map(|i| (0..m.ncols()).map(move |j| m[(i, j)] * m[(i, j)]))
        .collect()
}

/// `m` with `columns` appended on its right.
pub(super) fn append(m: &mut Mat<f64>, columns: MatRef<'_, f64>) {
    let k = m.ncols();
    m.resize_with(columns.nrows(), k + columns.ncols(), |_, _| 0.0);
    m.as_mut()
        .subcols_mut(k, columns.ncols())
        .copy_from(columns);
}

/// A symmetric matrix (k × k) grown by b rows and columns, given its new columns
/// ((k + b) × b): the old part stays, the new part is mirrored.
pub(super) fn grown(old: &Mat<f64>, block: MatRef<'_, f64>) -> Mat<f64> {
    let total = block.nrows();
    let k = old.nrows();
    Mat::from_fn(total, total, |i, j| match (i < k, j < k) {
        (true, true) => old[(i, j)],
        (_, false) => block[(i, j - k)],
        (false, true) => block[(j, i - k)],
    })
}

/// A square block made exactly symmetric (the mean of it and its transpose).
pub(super) fn symmetrize(mut m: MatMut<'_, f64>) {
    for i in 0..m.nrows() {
        for j in 0..i {
            let v = 0.5 * (m[(i, j)] + m[(j, i)]);
            m[(i, j)] = v;
            m[(j, i)] = v;
        }
    }
}

/// `y` with its components along the orthonormal columns of `basis` removed (classical
/// Gram–Schmidt, twice: once is not enough in floating point).
pub(super) fn orthogonal_to(y: MatRef<'_, f64>, basis: MatRef<'_, f64>) -> Mat<f64> {
    let mut out = y.to_owned();
    for _ in 0..2 {
        let coefficients = mul(basis.transpose(), out.as_ref());
        matmul(
            out.as_mut(),
            Accum::Add,
            basis,
            coefficients.as_ref(),
            -1.0,
            Par::Seq,
        );
    }
    out
}
