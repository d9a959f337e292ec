//! Records which torch the extension links (`torch/version.py` next to the libtorch
//! that torch-sys builds against), so `import rankscope` can refuse a different one
//! instead of crashing inside libtorch; and points the extension's run path at the
//! installed torch package (`site-packages/torch/lib` beside `site-packages/rankscope`),
//! never at a folder of the build tree.

use std::path::PathBuf;

fn main() {
    // `import torch` (which `import rankscope` does first) has loaded these
    // libraries already; the run path makes the dependency on that torch
    // package explicit, for `ldd` and for a loader that comes first.
    println!("cargo:rustc-link-arg-cdylib=-Wl,-rpath,$ORIGIN/../torch/lib");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    let version = std::env::var_os("LIBTORCH")
        .map(|root| PathBuf::from(root).join("version.py"))
        .and_then(|file| {
            println!("cargo:rerun-if-changed={}", file.display());
            std::fs::read_to_string(file).ok()
        })
        .and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("__version__ = "))
                .map(|v| v.trim().trim_matches(['\'', '"']).to_string())
        })
        .unwrap_or_else(|| {
            panic!("LIBTORCH must point at the torch package (its version.py); run `make setup`")
        });
    println!("cargo:rustc-env=RANKSCOPE_BUILT_TORCH={version}");
    // The package reads this before it loads the extension: a libtorch other than
    // the one linked would fail or crash inside the loader.
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let file = manifest.join("rankscope/_built_with.py");
    let text = format!(
        "# Written by build.rs: the torch whose libtorch the extension links.\nTORCH_VERSION = {version:?}\n"
    );
    if std::fs::read_to_string(&file).ok().as_deref() != Some(text.as_str()) {
        std::fs::write(&file, text).expect("write rankscope/_built_with.py");
    }
}
