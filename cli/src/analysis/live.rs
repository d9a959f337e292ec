//! Live diagnoses: the diagnoses of `report` ([`super::diagnoses`]) run over
//! what the collectors' live view holds of a run (its last steps per rank, its
//! layers' short histories), again each time the view is read, each finding
//! kept with the step at which it first fired.
//!
//! Only the diagnoses that make sense mid-run and on a window of recent steps
//! run here: straggler (with its persistence test), non-finite onset, memory
//! creep, input-bound, dead layer and collapse. Their thresholds are report's;
//! on a window they see the recent run, so a memory creep fires once the window
//! itself rises, and a straggler once it was latest in enough of the window's
//! steps.
//!
//! The window is every step the collector keeps (`--live-steps`), not the
//! shorter one a viewer draws: the ranks' newest steps arrive up to a batch
//! apart (500 ms of steps), and the timing diagnoses compare only the steps
//! every rank has, which on 32 steps per rank were often fewer than 20.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use rankscope_collector::live::snapshot::RunSnapshot;
use serde::Serialize;

use super::diagnoses::{self, Diagnosis, LayerRecord, RankInfo, RunData, StepRecord, Thresholds};

/// A run's rows as the diagnoses read them, from a live snapshot.
pub fn run_data(snapshot: &RunSnapshot) -> RunData {
    let mut run = RunData::default();
    for r in &snapshot.ranks {
        run.ranks.push(RankInfo {
            rank: r.rank,
            node_rank: r.node_rank,
            hostname: r.hostname.clone(),
        });
        run.steps.extend(r.steps.iter().map(|s| StepRecord {
            rank: r.rank,
            step: s.step,
            step_ms: s.step_ms,
            data_ms: s.data_ms,
            forward_ms: s.forward_ms,
            backward_ms: s.backward_ms,
            optimizer_ms: s.optimizer_ms,
            comm_ms: s.comm_ms,
            overhead_ms: s.overhead_ms,
            overhead_device_ms: s.overhead_device_ms,
            overhead_observed_ms: s.overhead_observed_ms,
            loss: s.loss,
            grad_norm: s.grad_norm,
            rss_bytes: s.rss_bytes,
            device_allocated_bytes: s.device_allocated_bytes,
        }));
    }
    for l in &snapshot.layers {
        run.layers.extend(l.history.iter().map(|p| LayerRecord {
            rank: l.rank,
            step: p.step,
            layer: l.layer.clone(),
            stable_rank: p.stable_rank,
            effective_rank: p.effective_rank,
            zero_fraction: p.zero_fraction,
            nonfinite: p.nonfinite,
            compute_ms: None,
        }));
    }
    run
}

/// The diagnoses that run live, in the order `top` and the page show them.
pub fn diagnose_live(run: &RunData, t: &Thresholds) -> Vec<Diagnosis> {
    let mut all = Vec::new();
    all.extend(diagnoses::nonfinite_onset(run));
    all.extend(diagnoses::straggler(run, t));
    all.extend(diagnoses::input_bound(run, t));
    all.extend(diagnoses::memory_creep(run, t));
    all.extend(diagnoses::collapse(run, t));
    all.extend(diagnoses::dead_layers(run, t));
    all
}

/// A live finding: the diagnosis as it reads now, and when it first fired.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Finding {
    /// The run's newest step when the finding first appeared.
    pub fired_at_step: u64,
    #[serde(flatten)]
    pub diagnosis: Diagnosis,
}

/// The findings of one run across reads of the live view: a finding keeps the
/// step it fired at while it holds, and fires anew after it cleared.
#[derive(Debug, Default)]
pub struct LiveDiagnoses {
    thresholds: Thresholds,
    /// By (kind, subject: a rank or a layer), the step each fired at.
    fired: BTreeMap<(String, String), u64>,
}

impl LiveDiagnoses {
    pub fn new(thresholds: Thresholds) -> LiveDiagnoses {
        LiveDiagnoses {
            thresholds,
            fired: BTreeMap::new(),
        }
    }

    /// Runs the live diagnoses on `snapshot`; findings first fired earliest
    /// come first.
    pub fn update(&mut self, snapshot: &RunSnapshot) -> Vec<Finding> {
        let now = snapshot.summary.last_step.unwrap_or(0);
        let found = diagnose_live(&run_data(snapshot), &self.thresholds);
        let mut fired = BTreeMap::new();
        let mut findings: Vec<Finding> = found
            .into_iter()
            .map(|diagnosis| {
                let key = subject(&diagnosis);
                let at = self.fired.get(&key).copied().unwrap_or(now);
                fired.insert(key, at);
                Finding {
                    fired_at_step: at,
                    diagnosis,
                }
            })
            .collect();
        self.fired = fired;
        findings.sort_by_key(|f| f.fired_at_step);
        findings
    }
}

/// What a diagnosis is about: its kind and its rank or layer (from its
/// evidence's JSON, so every kind has one without a match to keep up).
fn subject(d: &Diagnosis) -> (String, String) {
    let kind = d.evidence.kind().to_string();
    let json = serde_json::to_value(&d.evidence).unwrap_or_default();
    let about = ["rank", "layer", "metric"]
        .iter()
        .filter_map(|k| json.get(*k).map(|v| v.to_string()))
        .collect::<Vec<_>>()
        .join("/");
    (kind, about)
}

/// Runs tracked at most by [`collector_findings`]; past it, the history starts
/// over (findings then show the step they are seen again at).
const MAX_TRACKED_RUNS: usize = 64;

/// The live diagnoses as the collector's `/live` runs them: one
/// [`LiveDiagnoses`] per run, shared by every viewer of the page.
pub fn collector_findings() -> rankscope_collector::live::Findings {
    let runs: Mutex<HashMap<String, LiveDiagnoses>> = Mutex::new(HashMap::new());
    rankscope_collector::live::Findings(Arc::new(move |snapshot: &RunSnapshot| {
        let mut runs = runs.lock().unwrap_or_else(|e| e.into_inner());
        if runs.len() >= MAX_TRACKED_RUNS && !runs.contains_key(&snapshot.summary.run_id) {
            runs.clear();
        }
        runs.entry(snapshot.summary.run_id.clone())
            .or_default()
            .update(snapshot)
            .iter()
            .filter_map(|f| serde_json::to_value(f).ok())
            .collect()
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rankscope_collector::live::snapshot::{RankLive, RunSummary, StepPoint};

    /// `ranks` ranks of `steps` steps ending at `last`; `slow` arrives 20 ms
    /// late to every all-reduce (it waits least in it).
    fn snapshot(ranks: u32, last: u64, steps: u64, slow: Option<u32>) -> RunSnapshot {
        let ranks = (0..ranks)
            .map(|rank| RankLive {
                rank,
                steps: (last + 1 - steps..=last)
                    .map(|step| {
                        let jitter = ((step * 7 + rank as u64 * 13) % 5) as f64 * 0.1;
                        let late = slow == Some(rank);
                        StepPoint {
                            step,
                            step_ms: 100.0 + jitter,
                            backward_ms: Some(40.0),
                            comm_ms: Some(if late { 2.0 } else { 22.0 } + jitter),
                            forward_ms: Some(if late { 50.0 } else { 30.0 }),
                            loss: Some(1.0),
                            ..Default::default()
                        }
                    })
                    .collect(),
                ..Default::default()
            })
            .collect();
        RunSnapshot {
            summary: RunSummary {
                run_id: "r".into(),
                last_step: Some(last),
                ..Default::default()
            },
            ranks,
            ..Default::default()
        }
    }

    #[test]
    fn a_straggler_fires_once_and_keeps_its_step_while_it_holds() {
        let mut live = LiveDiagnoses::default();
        assert!(live.update(&snapshot(4, 40, 32, None)).is_empty());
        let first = live.update(&snapshot(4, 50, 32, Some(2)));
        assert_eq!(first.len(), 1, "{first:#?}");
        assert_eq!(first[0].diagnosis.evidence.kind(), "straggler");
        assert!(first[0].diagnosis.message.contains("rank 2"));
        assert_eq!(first[0].fired_at_step, 50);
        let later = live.update(&snapshot(4, 60, 32, Some(2)));
        assert_eq!(later[0].fired_at_step, 50);
        // It clears, then fires again: a new step.
        assert!(live.update(&snapshot(4, 70, 32, None)).is_empty());
        let again = live.update(&snapshot(4, 80, 32, Some(2)));
        assert_eq!(again[0].fired_at_step, 80);
    }

    /// Three ranks as a collector holds them mid-run: each its last `kept`
    /// steps, their newest steps a batch apart (137, 126, 117: measured at step
    /// ~2,130 of a 3-rank CPU DDP run); rank 2 sleeps 8 ms in its forward and is
    /// the latest at 9 steps in 10.
    fn offset_windows(kept: u64) -> RunSnapshot {
        let ranks = [(0u32, 137u64), (1, 126), (2, 117)]
            .into_iter()
            .map(|(rank, last)| RankLive {
                rank,
                steps: (last + 1 - kept..=last)
                    .map(|step| {
                        let jitter = ((step * 7 + rank as u64 * 13) % 5) as f64 * 0.3;
                        let late = rank == 2 && step % 10 != 0;
                        StepPoint {
                            step,
                            step_ms: 20.0 + jitter,
                            backward_ms: Some(17.0),
                            comm_ms: Some(if late { 6.0 } else { 15.0 } + jitter),
                            forward_ms: Some(if rank == 2 { 9.0 } else { 0.8 }),
                            ..Default::default()
                        }
                    })
                    .collect(),
                ..Default::default()
            })
            .collect();
        RunSnapshot {
            summary: RunSummary {
                run_id: "r".into(),
                last_step: Some(137),
                ..Default::default()
            },
            ranks,
            ..Default::default()
        }
    }

    #[test]
    fn a_straggler_is_found_on_the_kept_window_of_ranks_a_batch_apart() {
        // On a viewer's 32 steps per rank only 12 steps are every rank's,
        // fewer than the 20 the timing diagnoses need: silent, as it was.
        let short = LiveDiagnoses::default().update(&offset_windows(32));
        assert!(short.is_empty(), "{short:#?}");
        // On the 64 the view keeps, 44 steps are every rank's: rank 2, as the
        // report of the whole run says.
        let kept = LiveDiagnoses::default().update(&offset_windows(64));
        assert_eq!(kept.len(), 1, "{kept:#?}");
        assert_eq!(kept[0].diagnosis.evidence.kind(), "straggler");
        assert!(
            kept[0]
                .diagnosis
                .message
                .starts_with("rank 2 is the straggler"),
            "{}",
            kept[0].diagnosis.message
        );
    }

    #[test]
    fn a_nonfinite_loss_fires_at_its_step() {
        let mut run = snapshot(2, 30, 25, None);
        run.ranks[1].steps[10].loss = Some(f64::NAN);
        let found = LiveDiagnoses::default().update(&run);
        let kinds: Vec<&str> = found.iter().map(|f| f.diagnosis.evidence.kind()).collect();
        assert_eq!(kinds, ["nonfinite_onset"]);
        assert!(found[0].diagnosis.message.contains("16"), "{found:#?}");
    }
}
