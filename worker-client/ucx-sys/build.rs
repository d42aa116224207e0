//! Finds the system's UCX with pkg-config and links libucp, libuct and libucs (and libucm).
//! The bindings are checked in (src/bindings.rs, see regenerate.sh), so no libclang is needed.

/// The oldest UCX whose UCP API the checked-in bindings describe.
const MIN_VERSION: &str = "1.13";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    match pkg_config::Config::new()
        .atleast_version(MIN_VERSION)
        .probe("ucx")
    {
        Ok(ucx) => println!("cargo:version={}", ucx.version),
        Err(err) => {
            eprintln!(
                "error: ucx-sys needs the UCX development files, version {MIN_VERSION} or newer \
                 (pkg-config module `ucx`).\n\
                 On Debian/Ubuntu: apt-get install libucx-dev pkg-config\n\
                 Elsewhere: install UCX and put its lib/pkgconfig folder on PKG_CONFIG_PATH.\n\
                 pkg-config said: {err}"
            );
            std::process::exit(1);
        }
    }
}
