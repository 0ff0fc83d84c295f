//! Links libgpupool_c: from GPUPOOL_LIB_DIR, else from the CMake `dev` preset's build tree next
//! to this crate. The directory also goes into the rpath so that `cargo test` finds the library
//! without LD_LIBRARY_PATH.
use std::env;
use std::path::PathBuf;

const LIB_DIR_VARIABLE: &str = "GPUPOOL_LIB_DIR";

fn library_dir() -> PathBuf {
    if let Some(dir) = env::var_os(LIB_DIR_VARIABLE) {
        return PathBuf::from(dir);
    }
    let manifest_dir = env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    PathBuf::from(manifest_dir).join("../build/dev/interop")
}

fn main() {
    let dir = library_dir();
    // An absolute path: the rpath must not depend on the directory a test binary runs from.
    let dir = dir.canonicalize().unwrap_or(dir);
    println!("cargo:rerun-if-env-changed={LIB_DIR_VARIABLE}");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-link-search=native={}", dir.display());
    println!("cargo:rustc-link-lib=dylib=gpupool_c");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
}
