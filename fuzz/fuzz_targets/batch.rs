//! A `Batch` payload: prost decode, `validate::batch`, the seq check, Arrow
//! record batches and Parquet encoding in memory.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    rankscope_collector::fuzzing::batch(data);
});
