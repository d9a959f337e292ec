//! A `Hello` payload: prost decode and `validate::hello`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    rankscope_collector::fuzzing::hello(data);
});
