//! How rows are drawn: the seed of a (run, rank, step, layer) ([`sample_seed`]) and the
//! rows it picks ([`choose_rows`]). [`super::host`] reads the chosen rows; the Python
//! package's device side asks for the same rows, so a sample is the same on every device.
//!
//! # Row sampling
//!
//! Beyond `max_rows` rows, rows are drawn uniformly without replacement (a partial
//! Fisher–Yates shuffle driven by splitmix64) with a seed from [`sample_seed`], a FNV-1a hash
//! of (run, rank, step, layer). The same run therefore gives the same numbers on every
//! machine and in every process, which Rust's randomly keyed `std` hasher would not (the
//! hash map of displaced rows, which only stores, uses the cheaper Fx hash).

use rustc_hash::FxHashMap;

use super::spectral::SplitMix64;

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

/// `k` distinct indices of `0..n`, sorted, uniformly: a partial Fisher–Yates shuffle of the
/// virtual array `0..n`. Where n is at most [`DENSE_ROWS_FACTOR`]·k the array itself is
/// shuffled (a sequence of 8,192 tokens capped at 4,096 rows: the training thread's
/// common case); beyond, only the displaced entries are stored, so it costs O(k) however
/// large n is. Both draw the same rows.
pub fn choose_rows(n: u64, k: u64, seed: u64) -> Vec<i64> {
    let k = k.min(n);
    let mut rng = SplitMix64(seed);
    let mut chosen = Vec::with_capacity(k as usize);
    match u32::try_from(n) {
        Ok(dense) if n <= DENSE_ROWS_FACTOR * k => {
            let mut at: Vec<u32> = (0..dense).collect();
            let mut taken = vec![false; n as usize];
            for i in 0..k as usize {
                let j = i + rng.below(n - i as u64) as usize;
                taken[at[j] as usize] = true;
                // Position i is never read again; position j now holds what was at i.
                at[j] = at[i];
            }
            // In order without a sort: one pass over the marks.
            chosen.extend((0..n as i64).filter(|&row| taken[row as usize]));
            return chosen;
        }
        _ => {
            let mut displaced: FxHashMap<u64, u64> =
                FxHashMap::with_capacity_and_hasher(k as usize, Default::default());
            for i in 0..k {
                let j = i + rng.below(n - i);
                let at_i = displaced.get(&i).copied().unwrap_or(i);
                let at_j = displaced.get(&j).copied().unwrap_or(j);
                chosen.push(at_j as i64);
                displaced.insert(j, at_i);
            }
        }
    }
    chosen.sort_unstable();
    chosen
}

/// [`choose_rows`] shuffles the whole array `0..n` up to this many times the rows it
/// draws (its set-up then costs at most this many writes per row drawn, less than the
/// hash map's lookups).
pub const DENSE_ROWS_FACTOR: u64 = 16;
