//! The configuration's tests.

use super::*;
use std::collections::HashMap;

fn build(vars: &[(&str, &str)]) -> Result<AgentConfig, ConfigError> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    AgentConfig::builder().build_with(|k| map.get(k).cloned())
}

#[test]
fn torchrun_slurm_and_none() {
    // (vars, rank, local_rank, world_size, node_rank, run_id)
    type Case<'a> = (&'a [(&'a str, &'a str)], u32, u32, u32, u32, &'a str);
    let cases: &[Case] = &[
        (
            &[
                (RANK, "5"),
                (LOCAL_RANK, "1"),
                (WORLD_SIZE, "8"),
                (LOCAL_WORLD_SIZE, "4"),
                (GROUP_RANK, "1"),
                (TORCHELASTIC_RUN_ID, "exp42"),
            ],
            5,
            1,
            8,
            1,
            "exp42",
        ),
        (
            &[
                (SLURM_PROCID, "3"),
                (SLURM_LOCALID, "3"),
                (SLURM_NTASKS, "16"),
                (SLURM_NODEID, "0"),
                (SLURM_JOB_ID, "991"),
            ],
            3,
            3,
            16,
            0,
            "slurm-991",
        ),
        // torchrun inside a SLURM allocation: torchrun's variables win.
        (
            &[
                (RANK, "2"),
                (WORLD_SIZE, "4"),
                (LOCAL_RANK, "2"),
                (LOCAL_WORLD_SIZE, "4"),
                (SLURM_PROCID, "0"),
                (SLURM_NTASKS, "1"),
                (SLURM_JOB_ID, "7"),
            ],
            2,
            2,
            4,
            0,
            "slurm-7",
        ),
        (
            &[
                (RANK, "1"),
                (WORLD_SIZE, "2"),
                (TORCHELASTIC_RUN_ID, "none"),
                (MASTER_ADDR, "10.0.0.1"),
                (MASTER_PORT, "29500"),
            ],
            1,
            1,
            2,
            0,
            "job-10.0.0.1-29500",
        ),
        (&[(RANKSCOPE_RUN_ID, "mine")], 0, 0, 1, 0, "mine"),
    ];
    for (vars, rank, local_rank, world_size, node_rank, run_id) in cases {
        let c = build(vars).unwrap_or_else(|e| panic!("{vars:?}: {e}"));
        assert_eq!(
            (
                c.rank,
                c.local_rank,
                c.world_size,
                c.node_rank,
                c.run_id.as_str()
            ),
            (*rank, *local_rank, *world_size, *node_rank, *run_id),
            "{vars:?}"
        );
    }
    let single = build(&[]).unwrap();
    assert_eq!((single.rank, single.world_size), (0, 1));
    assert!(single.run_id.starts_with("local-"));
    assert_eq!(single.mode, Mode::Full);
    assert_eq!(single.sample_every, DEFAULT_SAMPLE_EVERY);
    assert_eq!(single.overhead_budget, OverheadBudget::DEFAULT);
    let half = build(&[(RANKSCOPE_OVERHEAD_BUDGET, "0.5%")]).unwrap();
    assert_eq!(half.overhead_budget.percent(), 0.5);
}

#[test]
fn inconsistent_values_name_the_variable_and_the_fix() {
    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[(RANK, "7"), (WORLD_SIZE, "4")], "RANK=7 but WORLD_SIZE=4"),
        (
            &[(RANK, "two"), (WORLD_SIZE, "4")],
            "RANK=\"two\" is not a whole number",
        ),
        (&[(RANK, "0")], "RANK is set but WORLD_SIZE is not"),
        (&[(WORLD_SIZE, "0"), (RANK, "0")], "WORLD_SIZE=0"),
        (
            &[(SLURM_PROCID, "4"), (SLURM_NTASKS, "4")],
            "SLURM_PROCID=4 but SLURM_NTASKS=4",
        ),
        (
            &[
                (RANK, "1"),
                (WORLD_SIZE, "4"),
                (LOCAL_RANK, "3"),
                (LOCAL_WORLD_SIZE, "2"),
            ],
            "LOCAL_RANK=3 but LOCAL_WORLD_SIZE=2",
        ),
        (
            &[(RANKSCOPE_MODE, "everything")],
            "use full, rank0, steps or off",
        ),
        (&[(RANKSCOPE_SAMPLE_EVERY, "0")], "RANKSCOPE_SAMPLE_EVERY=0"),
        (
            &[(RANKSCOPE_SAMPLE_EVERY, "1e3")],
            "RANKSCOPE_SAMPLE_EVERY=\"1e3\"",
        ),
        (
            &[(RANKSCOPE_RUN_ID, "../../etc")],
            "run id \"../../etc\" is not allowed",
        ),
        (&[(RANKSCOPE_CENTER, "maybe")], "RANKSCOPE_CENTER=\"maybe\""),
        (
            &[(RANKSCOPE_CONV_LAYOUT, "nchw")],
            "use channelwise or flatten",
        ),
        (
            &[(RANKSCOPE_ON_CONFIG_ERROR, "ignore")],
            "use fail or disable",
        ),
        (
            &[(RANKSCOPE_SPECTRUM, "fast")],
            "RANKSCOPE_SPECTRUM=\"fast\" is not a spectrum method: use auto, exact or sketch",
        ),
        (
            &[(RANKSCOPE_SKETCH_THRESHOLD, "4k")],
            "RANKSCOPE_SKETCH_THRESHOLD=\"4k\" is not a whole number",
        ),
        (
            &[(RANKSCOPE_METRICS_THREADS, "0")],
            "RANKSCOPE_METRICS_THREADS=0: give between 1 and 64 metrics threads (default 1)",
        ),
        (
            &[(RANKSCOPE_METRICS_THREADS, "two")],
            "RANKSCOPE_METRICS_THREADS=\"two\" is not a whole number",
        ),
        (
            &[(RANKSCOPE_TLS_CA, "no-such-ca.pem")],
            "cannot read RANKSCOPE_TLS_CA=\"no-such-ca.pem\"",
        ),
        (
            &[(RANKSCOPE_TLS_CERT, "Cargo.toml")],
            "RANKSCOPE_TLS_CERT is set but RANKSCOPE_TLS_KEY is not",
        ),
        (
            &[
                (RANKSCOPE_TLS_CERT, "Cargo.toml"),
                (RANKSCOPE_TLS_KEY, "Cargo.toml"),
            ],
            "RANKSCOPE_TLS_CA is not",
        ),
        (
            &[(RANKSCOPE_COLLECTOR, "https://collector:50051")],
            "asks for TLS",
        ),
        (
            &[(RANKSCOPE_WORKER_PRIORITY, "normal")],
            "RANKSCOPE_WORKER_PRIORITY=\"normal\" is no longer read",
        ),
        (
            &[(RANKSCOPE_OVERHEAD_BUDGET, "2")],
            "RANKSCOPE_OVERHEAD_BUDGET=\"2\" is not a budget",
        ),
        (
            &[(RANKSCOPE_OVERHEAD_BUDGET, "150%")],
            "at most 100, with the % sign, e.g. 2% or 0.5%",
        ),
        (
            &[(RANKSCOPE_SPILL_MAX_BYTES, "lots")],
            "RANKSCOPE_SPILL_MAX_BYTES=\"lots\" is not a size",
        ),
        (
            &[(RANKSCOPE_COLLECTOR, "a:1,,b:2")],
            "RANKSCOPE_COLLECTOR=\"a:1,,b:2\": entry 2 is empty",
        ),
        (
            &[(RANKSCOPE_COLLECTOR, "a:1,")],
            "RANKSCOPE_COLLECTOR=\"a:1,\": entry 2 is empty",
        ),
        (
            &[(RANKSCOPE_COLLECTOR, "a:1,collector-b")],
            "\"collector-b\" is not a collector address (no port)",
        ),
        (
            &[(RANKSCOPE_COLLECTOR, "a:1,b:http")],
            "\"b:http\" is not a collector address (the port must be",
        ),
        (
            &[(RANKSCOPE_COLLECTOR, "grpc://a:1")],
            "the scheme must be http or https",
        ),
        // Addresses the transport could never connect to.
        (
            &[(RANKSCOPE_COLLECTOR, "h^t:1")],
            "\"h^t:1\" is not a collector address (the host has characters",
        ),
        (
            &[(RANKSCOPE_COLLECTOR, "[zz]:1")],
            "(the brackets hold no IPv6 address)",
        ),
        (
            &[(RANKSCOPE_TOKEN, "a\nb")],
            "RANKSCOPE_TOKEN holds a line break",
        ),
        (
            &[(RANKSCOPE_COLLECTOR, "https://a:1,b:2")],
            "mixes TLS (\"https://a:1\") and plaintext (\"b:2\") collectors: write https:// on every address or on none",
        ),
    ];
    for (vars, expected) in cases {
        let err = build(vars).expect_err("inconsistent").to_string();
        assert!(err.contains(expected), "{vars:?}: {err}");
    }
}

#[test]
fn code_overrides_env() {
    let map: HashMap<&str, &str> =
        HashMap::from([(RANKSCOPE_MODE, "steps"), (RANK, "1"), (WORLD_SIZE, "2")]);
    let c = AgentConfig::builder()
        .mode(Mode::Rank0)
        .sample_every(3u64)
        .build_with(|k| map.get(k).map(|v| v.to_string()))
        .unwrap();
    assert_eq!(c.mode, Mode::Rank0);
    assert_eq!(c.sample_every, 3);
    assert_eq!(c.rank, 1);
    assert!(!c.active(), "rank0 mode leaves rank 1 inert");
}

#[test]
fn a_collector_list_gives_each_rank_one_collector() {
    let list = "10.0.0.1:50051, http://10.0.0.2:50051 ,[::1]:7";
    for (rank, expected) in [
        ("0", "10.0.0.1:50051"),
        ("1", "http://10.0.0.2:50051"),
        ("2", "[::1]:7"),
        ("3", "10.0.0.1:50051"),
        ("7", "http://10.0.0.2:50051"),
    ] {
        let c = build(&[(RANKSCOPE_COLLECTOR, list), (RANK, rank), (WORLD_SIZE, "8")]).unwrap();
        assert_eq!(c.collector, expected, "rank {rank}");
    }
    let parsed = CollectorList::parse("--collector", list).unwrap();
    assert_eq!(parsed.len(), 3);
    assert!(!parsed.tls());
    assert_eq!(build(&[]).unwrap().collector, DEFAULT_COLLECTOR);
    // Code wins over the environment, and is checked the same way.
    let err = AgentConfig::builder()
        .collector("a:1,,b:2")
        .build_with(|_| None)
        .unwrap_err();
    assert!(err.to_string().contains("entry 2 is empty"), "{err}");
    assert!(
        err.to_string().starts_with("collector=\"a:1,,b:2\""),
        "{err}"
    );
}

#[test]
fn spectrum_settings() {
    let c = build(&[]).unwrap();
    assert_eq!(
        (c.spectrum, c.sketch_threshold, c.device_sketch_threshold),
        (
            SpectrumMode::Auto,
            DEFAULT_SKETCH_THRESHOLD,
            DEFAULT_DEVICE_SKETCH_THRESHOLD
        )
    );
    // A threshold set is the device's too.
    let c = build(&[
        (RANKSCOPE_SPECTRUM, " Sketch "),
        (RANKSCOPE_SKETCH_THRESHOLD, "2048"),
    ])
    .unwrap();
    assert_eq!(
        (c.spectrum, c.sketch_threshold, c.device_sketch_threshold),
        (SpectrumMode::Sketch, 2048, 2048)
    );
    assert_eq!(SpectrumMode::parse("exact"), Some(SpectrumMode::Exact));
    assert_eq!(c.metrics_threads, DEFAULT_METRICS_THREADS);
    let c = build(&[(RANKSCOPE_METRICS_THREADS, " 3 ")]).unwrap();
    assert_eq!(c.metrics_threads, 3);
}

#[test]
fn spill_settings() {
    let c = build(&[]).unwrap();
    assert_eq!(c.spill_dir, Some(default_spill_dir()));
    assert_eq!(c.spill_max_bytes, DEFAULT_SPILL_MAX_BYTES);
    let c = build(&[
        (RANKSCOPE_SPILL_DIR, "off"),
        (RANKSCOPE_SPILL_MAX_BYTES, "512M"),
    ])
    .unwrap();
    assert_eq!(c.spill_dir, None);
    assert_eq!(c.spill_max_bytes, 512 << 20);
    let c = build(&[(RANKSCOPE_SPILL_DIR, "spill-here")]).unwrap();
    assert_eq!(c.spill_dir, Some(PathBuf::from("spill-here")));
    assert_eq!(parse_size("3k"), Some(3072));
    assert_eq!(parse_size("17"), Some(17));
    assert_eq!(parse_size("99999999999G"), None);
}
