//! A `Batch` payload: the `wire` reader into Arrow (checked against prost and
//! `validate::batch`), the seq check and Parquet encoding in memory.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    rankscope_collector::fuzzing::batch(data);
});
