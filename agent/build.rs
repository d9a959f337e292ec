//! With the `torch` feature: compiles the small C++ shim that reads libtorch's
//! accelerator allocator statistics (tch has no binding for it), and makes binaries
//! that link this crate find libtorch at run time.

fn main() {
    println!("cargo:rerun-if-changed=src/torch/device_stats.cpp");
    #[cfg(feature = "torch")]
    torch::build();
}

#[cfg(feature = "torch")]
mod torch {
    use std::path::PathBuf;

    pub fn build() {
        let lib =
            std::env::var("DEP_TCH_LIBTORCH_LIB").expect("torch-sys exports its libtorch lib dir");
        let root = PathBuf::from(&lib)
            .parent()
            .expect("libtorch root")
            .to_path_buf();
        cc::Build::new()
            .cpp(true)
            .file("src/torch/device_stats.cpp")
            .include(root.join("include"))
            .include(root.join("include/torch/csrc/api/include"))
            .flag("-std=c++17")
            .flag_if_supported("-Wno-unused-parameter")
            .flag_if_supported("-Wno-deprecated-declarations")
            .compile("rankscope_shim");
        // Binaries and tests of every package that links the agent find libtorch,
        // and keep libtorch_cuda so CUDA is seen on GPU hosts.
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-search=native={lib}");
        println!("cargo:rustc-link-arg=-ltorch");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
        println!("cargo:lib={lib}");
    }
}
