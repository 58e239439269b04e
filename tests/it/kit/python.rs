//! The Python the tests drive, in virtualenvs with pinned packages from
//! PyPI: `target/sdk-venv` (the official SDKs), `target/spec-venv`
//! (schemathesis, which checks the appliance against `docs/openapi.yaml`)
//! and `target/hosts-venv` (Hermes Agent, a real MCP host).
//! Each is made once: one thread per process makes (or checks) it while
//! the others wait (`OnceLock`), and one process at a time (an exclusive
//! `flock` on `target/<name>.lock`), so tests that need one at once, in one
//! test binary or several, never build it concurrently. `.ci/run` makes
//! them up front with the same pins.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use nix::fcntl::{Flock, FlockArg};

/// The official SDKs the tests drive, pinned.
const SDKS: &[(&str, &str)] = &[("cubesandbox", "0.7.3"), ("mcp", "2.3.0")];

/// The property-based API tester, pinned.
const SPEC_TOOLS: &[(&str, &str)] = &[("schemathesis", "4.32.5")];

/// A real MCP host, pinned: Hermes Agent with its MCP extra.
const HOSTS: &[(&str, &str)] = &[("hermes-agent[mcp]", "0.19.0")];

/// The SDK venv's python (created once, reused by later runs).
pub fn sdk_python() -> PathBuf {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    PY.get_or_init(|| venv("sdk-venv", SDKS)).clone()
}

/// The schemathesis venv's `bin` directory.
pub fn spec_tools() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        venv("spec-venv", SPEC_TOOLS)
            .parent()
            .unwrap()
            .to_path_buf()
    })
    .clone()
}

/// The `hermes` command of the hosts venv (`target/hosts-venv`).
pub fn hermes() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| venv("hosts-venv", HOSTS).with_file_name("hermes"))
        .clone()
}

/// `target/<name>` with `pins` installed; its python.
fn venv(name: &str, pins: &[(&str, &str)]) -> PathBuf {
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    std::fs::create_dir_all(&target).unwrap();
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(target.join(format!("{name}.lock")))
        .unwrap();
    // Held until the venv is ready; released when dropped (also on a panic).
    let _lock = Flock::lock(lock, FlockArg::LockExclusive)
        .map_err(|(_, e)| e)
        .unwrap_or_else(|e| panic!("flock target/{name}.lock: {e}"));
    make_venv(&target.join(name), pins)
}

/// Make the venv at `venv` unless it already has `pins`.
fn make_venv(venv: &Path, pins: &[(&str, &str)]) -> PathBuf {
    let py = venv.join("bin/python");
    let check = pins
        .iter()
        // A pin may name extras (`pkg[extra]`); the distribution is `pkg`.
        .map(|(p, v)| {
            let dist = p.split('[').next().unwrap_or(p);
            format!("assert m.version('{dist}') == '{v}'")
        })
        .collect::<Vec<_>>()
        .join("; ");
    let installed = py.exists()
        && Command::new(&py)
            .args(["-c", &format!("import importlib.metadata as m; {check}")])
            .status()
            .is_ok_and(|s| s.success());
    if !installed {
        let st = Command::new("python3")
            .args(["-m", "venv"])
            .arg(venv)
            .status()
            .expect(
                "python3 is needed for the Python-driven tests (install python3 and python3-venv)",
            );
        assert!(
            st.success(),
            "python3 -m venv failed (install python3-venv)"
        );
        let specs: Vec<String> = pins.iter().map(|(p, v)| format!("{p}=={v}")).collect();
        let st = Command::new(&py)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(&specs)
            .status()
            .unwrap();
        assert!(st.success(), "pip install {specs:?} failed");
    }
    py
}
