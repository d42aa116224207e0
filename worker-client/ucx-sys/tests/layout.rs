//! The checked-in bindings against the installed headers: a C program compiled here with the
//! system's `cc` prints the size and field offsets of the structs the safe API fills, and they
//! must equal the Rust ones. A libucx-dev upgrade that changed them fails this test; rerun
//! `ucx-sys/regenerate.sh`.

use std::mem::{offset_of, size_of};
use std::process::Command;

use ucx_sys::*;

/// `(C expression, Rust value)` pairs for a struct's size and the offsets of `fields`.
macro_rules! layout {
    ($c_type:literal, $rust_type:ty, [$($field:ident),*]) => {
        [
            (format!("sizeof({})", $c_type), size_of::<$rust_type>()),
            $((format!("offsetof({}, {})", $c_type, stringify!($field)),
               offset_of!($rust_type, $field)),)*
        ]
    };
}

#[test]
fn bindings_match_the_installed_headers() {
    let checks: Vec<(String, usize)> = [
        layout!(
            "ucp_params_t",
            ucp_params_t,
            [field_mask, features, mt_workers_shared, name]
        )
        .to_vec(),
        layout!(
            "ucp_worker_params_t",
            ucp_worker_params_t,
            [field_mask, thread_mode, events]
        )
        .to_vec(),
        layout!(
            "ucp_ep_params_t",
            ucp_ep_params_t,
            [field_mask, address, err_mode, err_handler, user_data]
        )
        .to_vec(),
        layout!(
            "ucp_mem_map_params_t",
            ucp_mem_map_params_t,
            [field_mask, address, length, flags]
        )
        .to_vec(),
        layout!(
            "ucp_mem_attr_t",
            ucp_mem_attr_t,
            [field_mask, address, length]
        )
        .to_vec(),
        layout!(
            "ucp_request_param_t",
            ucp_request_param_t,
            [op_attr_mask, flags, request, cb, user_data, memh]
        )
        .to_vec(),
        layout!(
            "ucp_worker_attr_t",
            ucp_worker_attr_t,
            [field_mask, thread_mode, address, address_length]
        )
        .to_vec(),
        vec![("sizeof(ucs_status_t)".to_owned(), size_of::<ucs_status_t>())],
    ]
    .concat();

    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("ucx-layout");
    std::fs::create_dir_all(&dir).unwrap();
    let mut program = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include <ucp/api/ucp.h>\nint main(void) {\n",
    );
    for (expr, _) in &checks {
        program.push_str(&format!("    printf(\"%zu\\n\", (size_t){expr});\n"));
    }
    program.push_str("    return 0;\n}\n");
    let source = dir.join("layout.c");
    let binary = dir.join("layout");
    std::fs::write(&source, program).unwrap();
    let cflags = Command::new("pkg-config")
        .args(["--cflags", "ucx"])
        .output()
        .unwrap();
    let cflags = String::from_utf8(cflags.stdout).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let compiled = Command::new(&cc)
        .args(cflags.split_whitespace())
        .arg(&source)
        .arg("-o")
        .arg(&binary)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cc} (apt-get install build-essential): {e}"));
    assert!(
        compiled.status.success(),
        "{}",
        String::from_utf8_lossy(&compiled.stderr)
    );

    let output = Command::new(&binary).output().unwrap();
    let c_values: Vec<usize> = String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(|line| line.parse().unwrap())
        .collect();
    assert_eq!(c_values.len(), checks.len());
    for ((expr, rust), c) in checks.iter().zip(c_values) {
        assert_eq!(
            *rust, c,
            "{expr}: Rust says {rust}, the installed headers say {c}"
        );
    }
}
