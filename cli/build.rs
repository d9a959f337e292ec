//! With the `torch` feature, the `rankscope` binary finds libtorch at run time
//! (torch-sys's own rpath covers only its C++), and keeps libtorch_cuda linked so
//! CUDA is seen on GPU hosts.

fn main() {
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-search=native={lib}");
        println!("cargo:rustc-link-arg=-ltorch");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}
