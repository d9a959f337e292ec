//! The seven tables of the protocol and of the collector's output, in one place: the
//! [`Table`] names, a row of any table ([`Row`]), how many rows a [`Batch`] holds,
//! and the `ranks` row that a stream's [`Hello`] describes.
//!
//! A new table is added here, to `Batch` in the `.proto` file, and to the
//! collector's `table` module (its Arrow columns).

use crate::v1::{Batch, CommRow, EventRow, Hello, LayerRow, ModelRow, RankRow, RunRow, StepRow};

/// A table of the collector's output directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Table {
    Runs,
    Ranks,
    Steps,
    Layers,
    Model,
    Events,
    Comm,
}

impl Table {
    pub const ALL: [Table; 7] = [
        Table::Runs,
        Table::Ranks,
        Table::Steps,
        Table::Layers,
        Table::Model,
        Table::Events,
        Table::Comm,
    ];

    /// The folder name under the output directory, and the name of the `Batch`
    /// field that carries the table's rows.
    pub fn name(self) -> &'static str {
        match self {
            Table::Runs => "runs",
            Table::Ranks => "ranks",
            Table::Steps => "steps",
            Table::Layers => "layers",
            Table::Model => "model",
            Table::Events => "events",
            Table::Comm => "comm",
        }
    }

    /// The number of the `Batch` field that carries the table's rows.
    pub fn batch_field(self) -> u32 {
        match self {
            Table::Steps => 3,
            Table::Layers => 4,
            Table::Runs => 5,
            Table::Ranks => 6,
            Table::Model => 7,
            Table::Events => 8,
            Table::Comm => 10,
        }
    }

    /// The table whose rows `Batch` field number `field` carries, if any.
    pub fn of_batch_field(field: u32) -> Option<Table> {
        Table::ALL.into_iter().find(|t| t.batch_field() == field)
    }

    /// The table's position in [`Table::ALL`] (for per-table arrays).
    pub fn index(self) -> usize {
        self as usize
    }

    /// The protobuf message of one row of the table.
    pub fn row_message(self) -> &'static str {
        match self {
            Table::Runs => "RunRow",
            Table::Ranks => "RankRow",
            Table::Steps => "StepRow",
            Table::Layers => "LayerRow",
            Table::Model => "ModelRow",
            Table::Events => "EventRow",
            Table::Comm => "CommRow",
        }
    }
}

/// One row of any table, as a producer hands it over before it goes into a batch.
#[derive(Debug, Clone, PartialEq)]
pub enum Row {
    Run(RunRow),
    Rank(RankRow),
    Step(StepRow),
    Layer(LayerRow),
    Model(ModelRow),
    Event(EventRow),
    Comm(CommRow),
}

impl Row {
    /// The table the row belongs to.
    pub fn table(&self) -> Table {
        match self {
            Row::Run(_) => Table::Runs,
            Row::Rank(_) => Table::Ranks,
            Row::Step(_) => Table::Steps,
            Row::Layer(_) => Table::Layers,
            Row::Model(_) => Table::Model,
            Row::Event(_) => Table::Events,
            Row::Comm(_) => Table::Comm,
        }
    }

    /// Adds the row to its table's field of `batch`.
    pub fn append_to(self, batch: &mut Batch) {
        match self {
            Row::Run(r) => batch.runs.push(r),
            Row::Rank(r) => batch.ranks.push(r),
            Row::Step(r) => batch.steps.push(r),
            Row::Layer(r) => batch.layers.push(r),
            Row::Model(r) => batch.model.push(r),
            Row::Event(r) => batch.events.push(r),
            Row::Comm(r) => batch.comm.push(r),
        }
    }
}

impl Batch {
    /// Rows of `table` in the batch.
    pub fn table_rows(&self, table: Table) -> usize {
        match table {
            Table::Runs => self.runs.len(),
            Table::Ranks => self.ranks.len(),
            Table::Steps => self.steps.len(),
            Table::Layers => {
                self.layers.len()
                    + self
                        .layer_columns
                        .iter()
                        .map(|c| c.row_count())
                        .sum::<usize>()
            }
            Table::Model => self.model.len(),
            Table::Events => self.events.len(),
            Table::Comm => self.comm.len(),
        }
    }

    /// Rows of all tables in the batch.
    pub fn rows(&self) -> usize {
        Table::ALL.iter().map(|&t| self.table_rows(t)).sum()
    }
}

impl RankRow {
    /// The `ranks` row of the rank a stream's `Hello` describes; `finished_at` is
    /// `None` for a rank that vanished.
    pub fn from_hello(hello: &Hello, finished_at: Option<i64>) -> RankRow {
        RankRow {
            local_rank: hello.local_rank,
            node_rank: hello.node_rank,
            world_size: hello.world_size,
            hostname: hello.hostname.clone(),
            pid: hello.pid,
            mode: hello.mode,
            started_at: hello.started_at,
            finished_at,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_land_in_their_table_and_are_counted() {
        let rows = [
            Row::Run(RunRow::default()),
            Row::Rank(RankRow::default()),
            Row::Step(StepRow::default()),
            Row::Step(StepRow::default()),
            Row::Layer(LayerRow::default()),
            Row::Model(ModelRow::default()),
            Row::Event(EventRow::default()),
            Row::Comm(CommRow::default()),
        ];
        let mut batch = Batch::default();
        for row in rows {
            let table = row.table();
            let before = batch.table_rows(table);
            row.append_to(&mut batch);
            assert_eq!(batch.table_rows(table), before + 1, "{}", table.name());
        }
        assert_eq!(batch.rows(), 8);
        assert_eq!(batch.table_rows(Table::Steps), 2);
    }

    #[test]
    fn batch_fields_and_indexes_match_the_proto() {
        // Batch: steps = 3, layers = 4, runs = 5, ranks = 6, model = 7, events = 8,
        // comm = 10.
        let mut batch = Batch::default();
        batch.layers.push(LayerRow::default());
        let bytes = prost::Message::encode_to_vec(&batch);
        assert_eq!(bytes[0] >> 3, 4);
        assert_eq!(Table::of_batch_field(4), Some(Table::Layers));
        for (i, table) in Table::ALL.into_iter().enumerate() {
            assert_eq!(table.index(), i);
            assert_eq!(Table::of_batch_field(table.batch_field()), Some(table));
        }
        assert_eq!(Table::of_batch_field(2), None);
    }

    #[test]
    fn a_hello_describes_its_rank() {
        let hello = Hello {
            run_id: "r".into(),
            rank: 3,
            local_rank: 1,
            node_rank: 1,
            world_size: 4,
            hostname: "node-1".into(),
            pid: 42,
            mode: crate::v1::RecordingMode::Full as i32,
            started_at: 7,
            ..Default::default()
        };
        let row = RankRow::from_hello(&hello, Some(9));
        assert_eq!(
            (row.local_rank, row.node_rank, row.world_size, row.pid),
            (1, 1, 4, 42)
        );
        assert_eq!((row.hostname.as_str(), row.mode), ("node-1", hello.mode));
        assert_eq!((row.started_at, row.finished_at), (7, Some(9)));
    }
}
