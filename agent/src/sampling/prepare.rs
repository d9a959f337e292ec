//! The first step of the metrics ([`prepare`]): activation → matrix ([`to_matrix`]) → row
//! sample ([`sample_rows`]), giving a [`Sample`]. In the agent it runs once, on the
//! training thread, which hands the sample to the metrics thread.
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
//! # Row sampling
//!
//! Beyond `max_rows` rows, rows are drawn uniformly without replacement (a partial
//! Fisher–Yates shuffle driven by splitmix64) with a seed from [`sample_seed`], a FNV-1a hash
//! of (run, rank, step, layer). The same run therefore gives the same numbers on every
//! machine and in every process, which Rust's randomly keyed `std` hasher would not.

use std::collections::HashMap;

use tch::{Device, Kind, TchError, Tensor};

use super::options::{ConvLayout, MatrixOptions};
use super::spectral::SplitMix64;

/// Reshapes an activation into the matrix the metrics are defined on (see the module table)
/// and returns it with the `conv_layout` label used (`""` unless the input is 4-D). An
/// undefined tensor gives an empty (0, 0) matrix. A libtorch failure (out of memory while
/// copying a permuted tensor) is returned, never a panic.
pub fn to_matrix(
    activation: &Tensor,
    layout: ConvLayout,
) -> Result<(Tensor, &'static str), TchError> {
    if !activation.defined() {
        return Ok((Tensor::f_zeros([0, 0], (Kind::Float, Device::Cpu))?, ""));
    }
    // Explicit sizes rather than -1: reshape cannot infer -1 for an empty tensor.
    let matrix = match activation.size().as_slice() {
        [] => activation.f_reshape([1, 1])?,
        &[d] => activation.f_reshape([1, d])?,
        [_, _] => activation.shallow_clone(),
        &[b, t, d] => activation.f_reshape([b * t, d])?,
        &[b, c, h, w] => {
            return Ok(match layout {
                ConvLayout::Channelwise => (
                    activation
                        .f_permute([0, 2, 3, 1])?
                        .f_reshape([b * h * w, c])?,
                    layout.label(),
                ),
                ConvLayout::Flatten => (activation.f_reshape([b, c * h * w])?, layout.label()),
            });
        }
        [b, rest @ ..] => activation.f_reshape([*b, rest.iter().product()])?,
    };
    Ok((matrix, ""))
}

/// The sampling seed of one (run, rank, step, layer): FNV-1a 64 over length-prefixed fields,
/// so it is the same in every process and on every platform, and `("ab", "c")` differs from
/// `("a", "bc")`. Changing this function changes every sampled metric: don't.
pub fn sample_seed(run_id: &str, rank: u32, step: u64, layer: &str) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET;
    let mut feed = |bytes: &[u8]| {
        for &byte in bytes {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(PRIME);
        }
    };
    feed(&(run_id.len() as u64).to_le_bytes());
    feed(run_id.as_bytes());
    feed(&rank.to_le_bytes());
    feed(&step.to_le_bytes());
    feed(&(layer.len() as u64).to_le_bytes());
    feed(layer.as_bytes());
    hash
}

/// Keeps `max_rows` rows drawn uniformly without replacement (in their original order) when
/// the matrix has more; otherwise returns it unchanged. `max_rows == 0` means no cap. The
/// selection runs on the tensor's own device; a libtorch failure (out of memory) is returned.
pub fn sample_rows(matrix: &Tensor, max_rows: usize, seed: u64) -> Result<Tensor, TchError> {
    if !matrix.defined() || matrix.dim() == 0 {
        return Ok(matrix.shallow_clone());
    }
    let n = matrix.size()[0].max(0) as u64;
    if max_rows == 0 || n <= max_rows as u64 {
        return Ok(matrix.shallow_clone());
    }
    let indices = choose_rows(n, max_rows as u64, seed);
    let index = Tensor::f_from_slice(&indices)?.f_to_device(matrix.device())?;
    matrix.f_index_select(0, &index)
}

/// `k` distinct indices of `0..n`, sorted, uniformly: a partial Fisher–Yates shuffle of the
/// virtual array `0..n` that stores only the displaced entries, so it costs O(k) however
/// large n is.
pub(super) fn choose_rows(n: u64, k: u64, seed: u64) -> Vec<i64> {
    let k = k.min(n);
    let mut rng = SplitMix64(seed);
    let mut displaced: HashMap<u64, u64> = HashMap::with_capacity(k as usize);
    let mut chosen = Vec::with_capacity(k as usize);
    for i in 0..k {
        let j = i + rng.below(n - i);
        let at_i = displaced.get(&i).copied().unwrap_or(i);
        let at_j = displaced.get(&j).copied().unwrap_or(j);
        chosen.push(at_j as i64);
        // Position i is never read again; position j now holds what was at i.
        displaced.insert(j, at_i);
    }
    chosen.sort_unstable();
    chosen
}

/// An activation made ready for [`super::measure`]: the matrix of the module table, its rows
/// sampled down to the cap.
#[derive(Debug)]
pub struct Sample {
    /// At most `max_rows` rows.
    pub matrix: Tensor,
    /// `"channelwise"` or `"flatten"` for a 4-D activation, `""` otherwise.
    pub conv_layout: &'static str,
    /// The sampling seed; the sketch draws its random vectors from it too.
    pub seed: u64,
}

impl Sample {
    /// A detached copy of the sample's own, so later in-place changes to the
    /// activation (by training) cannot reach it.
    pub fn to_owned_copy(&self) -> Result<Sample, TchError> {
        Ok(Sample {
            matrix: self.matrix.f_detach_copy()?,
            conv_layout: self.conv_layout,
            seed: self.seed,
        })
    }
}

/// The first step: activation → matrix → row sample, on the activation's own device.
pub fn prepare(
    activation: &Tensor,
    options: &MatrixOptions,
    seed: u64,
) -> Result<Sample, TchError> {
    let (matrix, conv_layout) = to_matrix(activation, options.conv_layout)?;
    let matrix = sample_rows(&matrix, options.max_rows, seed)?;
    Ok(Sample {
        matrix,
        conv_layout,
        seed,
    })
}
