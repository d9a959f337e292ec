//! One telemetry row of any table, as the training side hands it to the transport.

use rankscope_proto::v1::{Batch, EventRow, LayerRow, ModelRow, RankRow, RunRow, StepRow};

/// A row of one of the collector's tables.
#[derive(Debug, Clone, PartialEq)]
pub enum Row {
    Step(StepRow),
    Layer(LayerRow),
    Run(RunRow),
    Rank(RankRow),
    Model(ModelRow),
    Event(EventRow),
}

impl Row {
    /// Adds the row to the matching repeated field of `batch`.
    pub fn append_to(self, batch: &mut Batch) {
        match self {
            Row::Step(r) => batch.steps.push(r),
            Row::Layer(r) => batch.layers.push(r),
            Row::Run(r) => batch.runs.push(r),
            Row::Rank(r) => batch.ranks.push(r),
            Row::Model(r) => batch.model.push(r),
            Row::Event(r) => batch.events.push(r),
        }
    }
}
