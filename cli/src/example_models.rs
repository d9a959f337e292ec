//! The example models and their synthetic data.
//!
//! - `mlp`: seed 000's 5-D regression MLP, 5→64→64→64→1 with SiLU (8,769
//!   parameters), on y = Σ sin(xᵢ) + noise;
//! - `cnn`: two 3×3 convolutions and a linear head, classifying 16×16 images whose
//!   class sets a blob's position;
//! - `transformer`: one pre-norm block (4-head self-attention and an MLP, d = 64)
//!   predicting the next token of noisy periodic sequences.

use rankscope_agent::Agent;
use rankscope_agent::{Phase, StepGuard};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    Mlp,
    Cnn,
    Transformer,
}

impl Workload {
    pub fn name(self) -> &'static str {
        match self {
            Workload::Mlp => "mlp",
            Workload::Cnn => "cnn",
            Workload::Transformer => "transformer",
        }
    }
}

const SEQ: i64 = 16;
const VOCAB: i64 = 32;
const D_MODEL: i64 = 64;
const HEADS: i64 = 4;

/// Builds the model with its layers tapped under the names of [`Workload::layers`].
pub fn build(workload: Workload, root: &nn::Path, agent: &Agent) -> nn::Sequential {
    let lin = |name: &str, i: i64, o: i64| nn::linear(root / name, i, o, Default::default());
    match workload {
        Workload::Mlp => nn::seq()
            .add(agent.tap("fc1", lin("fc1", 5, 64)))
            .add_fn(|x| x.silu())
            .add(agent.tap("fc2", lin("fc2", 64, 64)))
            .add_fn(|x| x.silu())
            .add(agent.tap("fc3", lin("fc3", 64, 64)))
            .add_fn(|x| x.silu())
            .add(agent.tap("head", lin("head", 64, 1))),
        Workload::Cnn => {
            let conv = |name: &str, i: i64, o: i64| {
                let config = nn::ConvConfig {
                    padding: 1,
                    ..Default::default()
                };
                nn::conv2d(root / name, i, o, 3, config)
            };
            nn::seq()
                .add(agent.tap("conv1", conv("conv1", 1, 8)))
                .add_fn(|x| x.relu().max_pool2d_default(2))
                .add(agent.tap("conv2", conv("conv2", 8, 16)))
                .add_fn(|x| x.relu().flatten(1, -1))
                .add(agent.tap("head", lin("head", 16 * 8 * 8, 4)))
        }
        Workload::Transformer => {
            let embed = nn::embedding(root / "embed", VOCAB, D_MODEL, Default::default());
            let pos = root.var(
                "pos",
                &[SEQ, D_MODEL],
                nn::Init::Randn {
                    mean: 0.0,
                    stdev: 0.02,
                },
            );
            let attn = Attention::new(&(root / "attn"));
            let ln1 = nn::layer_norm(root / "ln1", vec![D_MODEL], Default::default());
            let ln2 = nn::layer_norm(root / "ln2", vec![D_MODEL], Default::default());
            let mlp_path = root / "mlp";
            let mlp = nn::seq()
                .add(nn::linear(
                    &mlp_path / "fc",
                    D_MODEL,
                    4 * D_MODEL,
                    Default::default(),
                ))
                .add_fn(|x| x.gelu("none"))
                .add(nn::linear(
                    &mlp_path / "proj",
                    4 * D_MODEL,
                    D_MODEL,
                    Default::default(),
                ));
            let block = Block {
                attn: agent.tap_attention("attn", attn),
                mlp: agent.tap("mlp", mlp),
                ln1,
                ln2,
            };
            nn::seq()
                .add(agent.tap("embed", EmbedWithPos { embed, pos }))
                .add(block)
                .add(agent.tap("head", lin("head", D_MODEL, VOCAB)))
        }
    }
}

#[derive(Debug)]
struct EmbedWithPos {
    embed: nn::Embedding,
    pos: Tensor,
}

impl Module for EmbedWithPos {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.embed.forward(xs) + &self.pos
    }
}

/// Causal multi-head self-attention.
#[derive(Debug)]
struct Attention {
    q: nn::Linear,
    k: nn::Linear,
    v: nn::Linear,
    o: nn::Linear,
}

impl Attention {
    fn new(p: &nn::Path) -> Attention {
        let lin = |n: &str| nn::linear(p / n, D_MODEL, D_MODEL, Default::default());
        Attention {
            q: lin("q"),
            k: lin("k"),
            v: lin("v"),
            o: lin("o"),
        }
    }
}

impl Module for Attention {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let (b, t, d) = xs.size3().expect("(B, T, D) input");
        let split = |x: Tensor| x.view([b, t, HEADS, d / HEADS]).transpose(1, 2);
        let (q, k, v) = (
            split(self.q.forward(xs)),
            split(self.k.forward(xs)),
            split(self.v.forward(xs)),
        );
        let y = Tensor::scaled_dot_product_attention(
            &q,
            &k,
            &v,
            None::<Tensor>,
            0.0,
            true,
            None,
            false,
        );
        self.o
            .forward(&y.transpose(1, 2).contiguous().view([b, t, d]))
    }
}

#[derive(Debug)]
struct Block<A, M> {
    attn: A,
    mlp: M,
    ln1: nn::LayerNorm,
    ln2: nn::LayerNorm,
}

impl<A: Module, M: Module> Module for Block<A, M> {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let xs = xs + self.attn.forward(&self.ln1.forward(xs));
        &xs + self.mlp.forward(&self.ln2.forward(&xs))
    }
}

/// One training step, timed by phase on `s`, which also gets the loss and the
/// global gradient norm. Returns the loss.
pub fn train_step(
    workload: Workload,
    model: &nn::Sequential,
    vs: &nn::VarStore,
    opt: &mut nn::Optimizer,
    data: &mut Data,
    batch_size: i64,
    s: &StepGuard,
) -> f64 {
    let (x, y) = {
        let _p = s.phase(Phase::Data);
        data.batch(batch_size)
    };
    let loss = {
        let _p = s.phase(Phase::Forward);
        self::loss(workload, &model.forward(&x), &y)
    };
    {
        let _p = s.phase(Phase::Backward);
        opt.zero_grad();
        loss.backward();
    }
    s.grad_norm(global_grad_norm(vs));
    {
        let _p = s.phase(Phase::Optimizer);
        opt.step();
    }
    let value = loss.double_value(&[]);
    s.loss(value);
    value
}

/// The global L2 norm of all gradients.
fn global_grad_norm(vs: &nn::VarStore) -> f64 {
    let _guard = tch::no_grad_guard();
    let mut total = 0.0;
    for v in vs.trainable_variables() {
        let g = v.grad();
        if g.defined() {
            total += g.pow_tensor_scalar(2).sum(Kind::Double).double_value(&[]);
        }
    }
    total.sqrt()
}

/// The training loss of `workload` for predictions and targets.
pub fn loss(workload: Workload, prediction: &Tensor, target: &Tensor) -> Tensor {
    match workload {
        Workload::Mlp => prediction.mse_loss(target, tch::Reduction::Mean),
        Workload::Cnn => prediction.cross_entropy_for_logits(target),
        Workload::Transformer => prediction
            .reshape([-1, VOCAB])
            .cross_entropy_for_logits(&target.reshape([-1])),
    }
}

/// A rank's synthetic data shard.
pub struct Data {
    workload: Workload,
    device: Device,
    generator_seed: i64,
    step: i64,
}

impl Data {
    pub fn new(workload: Workload, seed: i64, device: Device) -> Data {
        Data {
            workload,
            device,
            generator_seed: seed,
            step: 0,
        }
    }

    /// The next (input, target) batch.
    pub fn batch(&mut self, n: i64) -> (Tensor, Tensor) {
        self.step += 1;
        tch::manual_seed(
            self.generator_seed
                .wrapping_mul(1_000_003)
                .wrapping_add(self.step),
        );
        let cpu = (Kind::Float, Device::Cpu);
        let (x, y) = match self.workload {
            Workload::Mlp => {
                let x = Tensor::randn([n, 5], cpu);
                let y = x.sin().sum_dim_intlist(1, true, Kind::Float)
                    + 0.05 * Tensor::randn([n, 1], cpu);
                (x, y)
            }
            Workload::Cnn => {
                let y = Tensor::randint(4, [n], (Kind::Int64, Device::Cpu));
                let x: Tensor = 0.3 * Tensor::randn([n, 1, 16, 16], cpu);
                for i in 0..n {
                    let class = y.int64_value(&[i]);
                    let (r, c) = ((class / 2) * 8 + 2, (class % 2) * 8 + 2);
                    let _ = x.get(i).narrow(1, r, 4).narrow(2, c, 4).fill_(1.0);
                }
                (x, y)
            }
            Workload::Transformer => {
                let period = Tensor::randint_low(2, 6, [n, 1], (Kind::Int64, Device::Cpu));
                let offset = Tensor::randint(VOCAB, [n, 1], (Kind::Int64, Device::Cpu));
                let t = Tensor::arange(SEQ + 1, (Kind::Int64, Device::Cpu)).view([1, SEQ + 1]);
                let seq = (offset + t.remainder_tensor(&period) * 3).remainder(VOCAB);
                (seq.narrow(1, 0, SEQ), seq.narrow(1, 1, SEQ))
            }
        };
        (x.to_device(self.device), y.to_device(self.device))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mlp_has_8769_parameters() {
        let vs = nn::VarStore::new(Device::Cpu);
        let _model = build(Workload::Mlp, &vs.root(), &Agent::disabled());
        let params: i64 = vs
            .trainable_variables()
            .iter()
            .map(|t| t.numel() as i64)
            .sum();
        assert_eq!(params, 8769);
    }

    #[test]
    fn every_workload_trains_one_step() {
        for w in [Workload::Mlp, Workload::Cnn, Workload::Transformer] {
            let vs = nn::VarStore::new(Device::Cpu);
            let model = build(w, &vs.root(), &Agent::disabled());
            let (x, y) = Data::new(w, 0, Device::Cpu).batch(4);
            let l = loss(w, &model.forward(&x), &y);
            l.backward();
            assert!(l.double_value(&[]).is_finite(), "{w:?}");
        }
    }
}
