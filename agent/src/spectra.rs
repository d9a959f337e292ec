//! Seeded matrices with the kinds of spectra the sketch is measured on (its tests and
//! `rankscope bench --spectrum`): the same matrix for the same seed on every machine.

use tch::{Kind, TchError, Tensor};

use crate::metrics::{SplitMix64, gaussian};

/// A kind of singular-value spectrum.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SpectrumKind {
    /// Independent standard normal entries: a flat (Marchenko–Pastur) spectrum.
    Flat,
    /// Column j (from 1) scaled by j^(−α/2): eigenvalues decaying about as i^(−α).
    PowerLaw(f64),
    /// A rank-r signal (entries of variance 9) plus standard normal noise scaled by 0.3.
    LowRankPlusNoise(i64),
    /// Power law with α = 0.5 and three columns 50× larger: the outlier features of
    /// transformer activations.
    Outliers,
}

impl SpectrumKind {
    /// The kinds reported in `docs/metrics.md`.
    pub const ALL: [SpectrumKind; 7] = [
        SpectrumKind::Flat,
        SpectrumKind::PowerLaw(0.5),
        SpectrumKind::PowerLaw(1.0),
        SpectrumKind::PowerLaw(2.0),
        SpectrumKind::LowRankPlusNoise(16),
        SpectrumKind::LowRankPlusNoise(256),
        SpectrumKind::Outliers,
    ];

    /// A short name for tables.
    pub fn name(self) -> String {
        match self {
            SpectrumKind::Flat => "flat".into(),
            SpectrumKind::PowerLaw(a) => format!("power law α={a}"),
            SpectrumKind::LowRankPlusNoise(r) => format!("rank {r} + noise"),
            SpectrumKind::Outliers => "outlier features".into(),
        }
    }

    /// A float32 `rows` × `cols` matrix of this kind on the CPU, from `seed`.
    pub fn matrix(self, rows: i64, cols: i64, seed: u64) -> Result<Tensor, TchError> {
        let mut rng = SplitMix64(seed);
        let mut normal = |r: i64, c: i64| -> Result<Tensor, TchError> {
            Tensor::f_from_slice(&gaussian(&mut rng, (r * c) as usize))?.f_reshape([r, c])
        };
        let noise = normal(rows, cols)?;
        let column_scale = |alpha: f64| -> Result<Tensor, TchError> {
            Tensor::f_arange_start(1, cols + 1, (Kind::Float, tch::Device::Cpu))?
                .f_pow_tensor_scalar(-alpha / 2.0)
        };
        match self {
            SpectrumKind::Flat => Ok(noise),
            SpectrumKind::PowerLaw(alpha) => noise.f_mul(&column_scale(alpha)?),
            SpectrumKind::LowRankPlusNoise(rank) => {
                let left = normal(rows, rank)?;
                let right = normal(rank, cols)?;
                left.f_matmul(&right)?
                    .f_mul_scalar(3.0 / (rank as f64).sqrt())?
                    .f_add(&noise.f_mul_scalar(0.3)?)
            }
            SpectrumKind::Outliers => {
                let scale = column_scale(0.5)?;
                for column in [7, 100, 900].into_iter().filter(|&c| c < cols) {
                    let _ = scale.f_get(column)?.f_mul_scalar_(50.0)?;
                }
                noise.f_mul(&scale)
            }
        }
    }
}
