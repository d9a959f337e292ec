//! [`Tap`]: wraps any `nn::Module` so its output is observed, since tch has no
//! forward hooks. It fits into `nn::seq()` like the module it wraps.

use tch::Tensor;
use tch::nn::Module;

use crate::Agent;

/// A module whose output is observed under `name`.
#[derive(Debug)]
pub struct Tap<M> {
    agent: Agent,
    name: String,
    inner: M,
    /// A hint for the model profile (`attention`), else `None`.
    kind: Option<&'static str>,
}

impl<M: Module> Tap<M> {
    pub(crate) fn new(agent: Agent, name: &str, inner: M, kind: Option<&'static str>) -> Tap<M> {
        if agent.is_active() && !rankscope_proto::is_valid_label(name) {
            tracing::warn!(
                name = %name.escape_debug(),
                max_bytes = rankscope_proto::MAX_LABEL_BYTES,
                "layer name has control characters or is over max_bytes: this tap records nothing"
            );
        }
        // The layer filter is applied on sampled steps (Recorder::wants_layer); shapes
        // for the model profile are recorded for every tapped layer.
        Tap {
            agent,
            name: name.to_string(),
            inner,
            kind,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn inner(&self) -> &M {
        &self.inner
    }
}

impl<M: Module> Module for Tap<M> {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let ys = self.inner.forward(xs);
        self.agent.observe_kind(&self.name, self.kind, &ys);
        ys
    }
}
