//! One gRPC message payload through everything the collector runs on it: the
//! `wire` reader (checked against prost), validation, the seq check, Parquet.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    rankscope_collector::fuzzing::agent_message(data);
});
