//! The static model profile, recorded once per rank as `model` rows: per layer its
//! kind, parameters, parameter / gradient / optimizer-state bytes, and forward
//! FLOPs for one batch as docs/metrics.md counts them (a multiply-add is 2 FLOPs):
//!
//! - Linear: 2 · rows · in · out
//! - Conv2d: 2 · B · H_out · W_out · k_h · k_w · (C_in / groups) · C_out
//! - self-attention: 4 · 2 · B · T · d² (projections) + 2 · 2 · B · T² · d (scores
//!   and weighted sum)
//!
//! Shapes come from one forward pass run under [`crate::Agent::profile_parameters`]:
//! observed layers record their output shape, and parameters are grouped under the
//! layer whose name prefixes their path. Parameters come as shapes and sizes
//! ([`Parameter`]): each adapter reads them from its framework's tensors.
//!
//! A sharded parameter (FSDP) counts as a whole in `params` and in the FLOPs, and
//! as this rank's shard in the byte columns: what the layer is, and what this rank
//! holds ([`Parameter::whole_shape`]).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use rankscope_proto::v1::ModelRow;

use super::recorder::{ObservedShape, Recorder};
use rankscope_proto::Row;

/// The optimizer, for its state bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Optimizer {
    /// Adam and AdamW: two moments, 2× the parameters.
    Adam,
    /// SGD with momentum: 1× the parameters.
    SgdMomentum,
    /// Plain SGD: no state.
    Sgd,
}

impl Optimizer {
    fn state_factor(self) -> u64 {
        match self {
            Optimizer::Adam => 2,
            Optimizer::SgdMomentum => 1,
            Optimizer::Sgd => 0,
        }
    }
}

/// A parameter as the profile counts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parameter {
    /// Its path, `layer.weight`.
    pub path: String,
    /// The shape of this rank's tensor: the whole parameter, or its shard.
    pub shape: Vec<i64>,
    /// Bytes per element.
    pub element_bytes: u64,
    /// Whether it is trained (has a gradient and optimizer state).
    pub requires_grad: bool,
    /// The whole parameter's shape where this rank holds a shard of it.
    pub whole_shape: Option<Vec<i64>>,
}

impl Parameter {
    fn layer_shape(&self) -> Vec<i64> {
        self.whole_shape
            .clone()
            .unwrap_or_else(|| self.shape.clone())
    }

    fn numel(&self) -> u64 {
        numel(self.whole_shape.as_deref().unwrap_or(&self.shape))
    }

    /// This rank's bytes.
    fn bytes(&self) -> u64 {
        numel(&self.shape) * self.element_bytes
    }
}

fn numel(shape: &[i64]) -> u64 {
    shape.iter().map(|&d| d.max(0) as u64).product()
}

/// Runs `forward` once with shape recording on (the caller's forward turns off
/// gradients, as its framework does), groups `parameters` into layers, and sends
/// their `model` rows. Without a recorder (an inert agent) it
/// still returns the rows, from the parameters alone.
pub(crate) fn record(
    recorder: Option<&Recorder>,
    parameters: impl IntoIterator<Item = Parameter>,
    optimizer: Optimizer,
    forward: impl FnOnce(),
) -> Vec<ModelRow> {
    let shapes = match recorder {
        Some(recorder) => {
            recorder.profiling.store(true, Ordering::Relaxed);
            forward();
            recorder.profiling.store(false, Ordering::Relaxed);
            std::mem::take(&mut *recorder.shapes.lock().unwrap_or_else(|e| e.into_inner()))
        }
        None => Vec::new(),
    };
    let rows = model_rows(parameters, optimizer, &shapes);
    if let Some(recorder) = recorder {
        for row in &rows {
            recorder.transport.send(Row::Model(row.clone()));
        }
    }
    rows
}

/// Groups the VarStore's variables into layers and counts them.
pub(crate) fn model_rows(
    parameters: impl IntoIterator<Item = Parameter>,
    optimizer: Optimizer,
    shapes: &[ObservedShape],
) -> Vec<ModelRow> {
    let mut layers: BTreeMap<String, Vec<Parameter>> = BTreeMap::new();
    for parameter in parameters {
        let path = &parameter.path;
        let layer = shapes
            .iter()
            .filter(|s| path.starts_with(&format!("{}.", s.name)))
            .max_by_key(|s| s.name.len())
            .map(|s| s.name.clone())
            .unwrap_or_else(|| {
                path.rsplit_once('.')
                    .map_or(path.clone(), |(p, _)| p.to_string())
            });
        layers.entry(layer).or_default().push(parameter);
    }
    // Forward order for tapped layers, then the rest by name.
    let mut order: Vec<String> = shapes
        .iter()
        .map(|s| s.name.clone())
        .filter(|n| layers.contains_key(n))
        .collect();
    order.extend(
        layers
            .keys()
            .filter(|k| !order.contains(k))
            .cloned()
            .collect::<Vec<_>>(),
    );
    order
        .into_iter()
        .map(|layer| {
            let vars = &layers[&layer];
            let params: u64 = vars.iter().map(Parameter::numel).sum();
            let param_bytes: u64 = vars.iter().map(Parameter::bytes).sum();
            let grad_bytes: u64 = vars
                .iter()
                .filter(|p| p.requires_grad)
                .map(Parameter::bytes)
                .sum();
            let shape = shapes.iter().find(|s| s.name == layer);
            let mut weights: Vec<(String, Vec<i64>)> = vars
                .iter()
                .filter(|p| p.path.ends_with(".weight") || p.path.ends_with(".ws"))
                .map(|p| (p.path.clone(), p.layer_shape()))
                .collect();
            weights.sort();
            let weights: Vec<Vec<i64>> = weights.into_iter().map(|(_, w)| w).collect();
            let (kind, forward_flops) = classify(shape, &weights);
            ModelRow {
                layer,
                kind: kind.into(),
                params,
                param_bytes,
                grad_bytes,
                optimizer_bytes: optimizer.state_factor() * grad_bytes,
                forward_flops,
                output_shape: shape.map(|s| format!("{:?}", s.output)).unwrap_or_default(),
            }
        })
        .collect()
}

/// Every `model.kind` value (docs/columns.md explains each).
pub const MODEL_KINDS: [&str; 6] = ["linear", "mlp", "conv2d", "embedding", "attention", "other"];

/// The layer kind and its forward FLOPs for the observed batch (0 when unknown).
/// A tap around several linear layers (an MLP block) sums them, all applied to
/// the same rows; an embedding (weight `(vocab, d)`, output last dim `d`) is a
/// lookup with no FLOPs.
fn classify(shape: Option<&ObservedShape>, weights: &[Vec<i64>]) -> (&'static str, u64) {
    let out = shape.map(|s| s.output.as_slice()).unwrap_or(&[]);
    let numel = |dims: &[i64]| dims.iter().product::<i64>().max(0) as u64;
    if shape.and_then(|s| s.kind) == Some("attention") {
        if let [b, t, d] = *out {
            let (b, t, d) = (b as u64, t as u64, d as u64);
            return ("attention", 4 * 2 * b * t * d * d + 2 * 2 * b * t * t * d);
        }
        return ("attention", 0);
    }
    let last = out.last().copied().unwrap_or(0);
    match weights {
        [w] if w.len() == 2 && last == w[1] && last != w[0] => ("embedding", 0),
        [w] if w.len() == 4 => {
            let (c_in_per_group, kh, kw) = (w[1], w[2], w[3]);
            ("conv2d", 2 * numel(out) * (c_in_per_group * kh * kw) as u64)
        }
        ws if !ws.is_empty() && ws.iter().all(|w| w.len() == 2) => {
            let rows = if last > 0 {
                numel(out) / last as u64
            } else {
                0
            };
            let flops = ws.iter().map(|w| 2 * rows * (w[0] * w[1]) as u64).sum();
            (if ws.len() == 1 { "linear" } else { "mlp" }, flops)
        }
        _ => ("other", 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parameter(path: &str, shape: &[i64]) -> Parameter {
        Parameter {
            path: path.into(),
            shape: shape.to_vec(),
            element_bytes: 4,
            requires_grad: true,
            whole_shape: None,
        }
    }

    #[test]
    fn flops_and_bytes_follow_metrics_md() {
        let parameters = [
            parameter("fc.weight", &[64, 5]),
            parameter("fc.bias", &[64]),
            parameter("conv.weight", &[8, 3, 3, 3]),
            parameter("conv.bias", &[8]),
        ];
        let shapes = vec![
            ObservedShape {
                name: "fc".into(),
                kind: None,
                output: vec![32, 64],
            },
            ObservedShape {
                name: "conv".into(),
                kind: None,
                output: vec![4, 8, 30, 30],
            },
        ];
        let rows = model_rows(parameters, Optimizer::Adam, &shapes);
        let fc = &rows[0];
        assert_eq!((fc.layer.as_str(), fc.kind.as_str()), ("fc", "linear"));
        assert_eq!(fc.params, 5 * 64 + 64);
        assert_eq!(fc.param_bytes, 4 * fc.params);
        assert_eq!(fc.optimizer_bytes, 2 * fc.param_bytes);
        assert_eq!(fc.forward_flops, 2 * 32 * 5 * 64);
        let conv = &rows[1];
        assert_eq!(conv.kind, "conv2d");
        assert_eq!(conv.forward_flops, 2 * 4 * 30 * 30 * 3 * 3 * 3 * 8);
        let attn = ObservedShape {
            name: "a".into(),
            kind: Some("attention"),
            output: vec![2, 16, 32],
        };
        assert_eq!(
            classify(Some(&attn), &[]).1,
            4 * 2 * 2 * 16 * 32 * 32 + 2 * 2 * 2 * 16 * 16 * 32
        );
        let block = ObservedShape {
            name: "mlp".into(),
            kind: None,
            output: vec![2, 16, 32],
        };
        let (kind, flops) = classify(Some(&block), &[vec![128, 32], vec![32, 128]]);
        assert_eq!((kind, flops), ("mlp", 2 * 2 * (2 * 16 * 128 * 32)));
        let embed = ObservedShape {
            name: "e".into(),
            kind: None,
            output: vec![2, 16, 32],
        };
        assert_eq!(classify(Some(&embed), &[vec![1000, 32]]), ("embedding", 0));
        assert_eq!(classify(None, &[]), ("other", 0));
        assert_eq!(classify(None, &[vec![3]]), ("other", 0));
    }
}
