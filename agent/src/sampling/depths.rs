//! [`SketchDepths`]: how many depths of [`SKETCH_SCHEDULE`] each layer's device sketch
//! runs, learnt from the Krylov summaries of that layer's earlier samples.
//!
//! A device cannot stop its Krylov process at the first depth that vouches: knowing it
//! would mean waiting for the host. It runs to a depth chosen before it starts, and the
//! host's analysis reads the depths in order and stops at the first that vouches
//! ([`super::sketch::sketch_summarized`]). Most spectra vouch at the schedule's first
//! depth, and a process that stops there issues about half the device operations of one
//! that runs to the last (BENCHMARKS.md, "GPU"). The depths a summary holds are those of
//! the deepest's, from the same seed, so a layer's columns are the same (to round-off:
//! the products of a narrower space round apart) whenever its summary reaches the depth
//! that vouches.
//!
//! The rule, per layer:
//! - its first sample runs every depth;
//! - a later one runs as many as the last summary needed (up to the first that vouched),
//!   and at least the layer's floor;
//! - a summary that held fewer depths than the schedule's and did not vouch raises the
//!   floor to one depth more, for the rest of the run. That sample's unvouched columns
//!   are null, their `_err` holding the estimate, as where the deepest does not vouch;
//!   a layer loses columns this way once per depth but the last, but for its samples
//!   already taken (at the depth before) when that one was measured.

use std::collections::HashMap;
use std::sync::Mutex;

use super::sketch::{SKETCH_SCHEDULE, Sketch};

/// Every depth of the schedule.
const ALL: usize = SKETCH_SCHEDULE.len();

/// What one analysed summary says of its layer's depth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SummaryDepths {
    /// Depths of the schedule the summary held (1 to its length).
    pub held: usize,
    /// Depths read up to the first that vouched; `None` where none did.
    pub vouched_at: Option<usize>,
}

impl SummaryDepths {
    /// What the analysis `sketch` of a summary of `held` depths says; `None` for the zero
    /// spectrum, which says nothing of the depth a layer needs.
    pub fn of(held: usize, sketch: &Sketch) -> Option<SummaryDepths> {
        let read = SKETCH_SCHEDULE.iter().position(|&s| s == sketch.steps);
        if sketch.vouched && read.is_none() {
            return None;
        }
        Some(SummaryDepths {
            held,
            vouched_at: read.filter(|_| sketch.vouched).map(|i| i + 1),
        })
    }
}

/// A layer's depths so far.
#[derive(Debug, Clone, Copy)]
struct Learnt {
    /// What its last summary needed (every depth where it did not vouch).
    needed: usize,
    /// The fewest its samples run: raised when a summary of fewer did not vouch.
    floor: usize,
}

/// Per layer, the depths its next device sketch runs; shared by the metrics threads,
/// which learn them, and the adapters, which read them at each sample.
#[derive(Debug, Default)]
pub struct SketchDepths {
    layers: Mutex<HashMap<String, Learnt>>,
}

impl SketchDepths {
    /// How many depths of [`SKETCH_SCHEDULE`] the device's Krylov process for a sample of
    /// `layer` runs (its first: all of them).
    pub fn to_run(&self, layer: &str) -> usize {
        let layers = self.layers.lock().unwrap_or_else(|e| e.into_inner());
        layers
            .get(layer)
            .map_or(ALL, |l| l.needed.max(l.floor).clamp(1, ALL))
    }

    /// Learns from a summary of `layer` the metrics thread analysed.
    pub fn learn(&self, layer: &str, seen: SummaryDepths) {
        let mut layers = self.layers.lock().unwrap_or_else(|e| e.into_inner());
        let learnt = layers.entry(layer.to_string()).or_insert(Learnt {
            needed: ALL,
            floor: 1,
        });
        match seen.vouched_at {
            Some(depths) => learnt.needed = depths,
            None if seen.held < ALL => {
                learnt.floor = learnt.floor.max(seen.held + 1);
                learnt.needed = learnt.floor;
            }
            None => learnt.needed = ALL,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(held: usize, vouched_at: Option<usize>) -> SummaryDepths {
        SummaryDepths { held, vouched_at }
    }

    #[test]
    fn a_layer_runs_what_its_last_summary_needed_and_never_less_than_a_depth_that_failed() {
        let depths = SketchDepths::default();
        assert_eq!(depths.to_run("a"), 3);
        depths.learn("a", seen(3, Some(1)));
        assert_eq!(depths.to_run("a"), 1);
        assert_eq!(depths.to_run("b"), 3, "layers learn apart");
        // The first depth did not vouch: two from now on, whatever later ones need.
        depths.learn("a", seen(1, None));
        assert_eq!(depths.to_run("a"), 2);
        depths.learn("a", seen(2, Some(1)));
        assert_eq!(depths.to_run("a"), 2);
        depths.learn("a", seen(2, None));
        assert_eq!(depths.to_run("a"), 3);
        // Where every depth held did not vouch, the next runs them all again.
        depths.learn("a", seen(3, None));
        assert_eq!(depths.to_run("a"), 3);
        depths.learn("b", seen(3, None));
        assert_eq!(depths.to_run("b"), 3);
        depths.learn("b", seen(3, Some(2)));
        assert_eq!(depths.to_run("b"), 2);
    }

    #[test]
    fn what_a_sketch_says_of_its_depth() {
        let sketch = |steps, vouched| Sketch {
            spectral: Default::default(),
            errors: Default::default(),
            vouched,
            steps,
        };
        let at = |depths: usize| SKETCH_SCHEDULE[depths - 1];
        assert_eq!(
            SummaryDepths::of(3, &sketch(at(2), true)),
            Some(seen(3, Some(2)))
        );
        assert_eq!(
            SummaryDepths::of(1, &sketch(at(1), false)),
            Some(seen(1, None))
        );
        // A summary it could not read did not vouch either.
        assert_eq!(SummaryDepths::of(2, &sketch(0, false)), Some(seen(2, None)));
        // The zero spectrum says nothing.
        assert_eq!(SummaryDepths::of(3, &sketch(0, true)), None);
    }
}
