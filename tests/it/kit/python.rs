//! The Python the SDK tests drive: a virtualenv `target/sdk-venv` with the
//! official SDKs, pinned. Made once: one thread per process makes (or
//! checks) it while the others wait (`OnceLock`), and one process at a time
//! (an exclusive `flock` on `target/sdk-venv.lock`), so tests that call
//! `sdk_python` at once, in one test binary or several, never build it
//! concurrently.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use nix::fcntl::{Flock, FlockArg};

/// The official SDKs the tests drive, pinned.
const SDKS: &[&str] = &["cubesandbox==0.7.3", "mcp==2.3.0"];

/// The venv's python, with the SDKs (created once, reused by later runs).
pub fn sdk_python() -> PathBuf {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    PY.get_or_init(|| {
        let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
        std::fs::create_dir_all(&target).unwrap();
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(target.join("sdk-venv.lock"))
            .unwrap();
        // Held until the venv is ready; released when dropped (also on a panic).
        let _lock = Flock::lock(lock, FlockArg::LockExclusive)
            .map_err(|(_, e)| e)
            .expect("flock target/sdk-venv.lock");
        make_venv(&target.join("sdk-venv"))
    })
    .clone()
}

/// Make the venv at `venv` unless it already has the pinned SDKs.
fn make_venv(venv: &Path) -> PathBuf {
    let py = venv.join("bin/python");
    let installed = py.exists()
        && Command::new(&py)
            .args([
                "-c",
                "import importlib.metadata as m; assert m.version('cubesandbox') == '0.7.3'; assert m.version('mcp') == '2.3.0'",
            ])
            .status()
            .is_ok_and(|s| s.success());
    if !installed {
        let st = Command::new("python3")
            .args(["-m", "venv"])
            .arg(venv)
            .status()
            .expect("python3 is needed for the SDK tests (install python3 and python3-venv)");
        assert!(
            st.success(),
            "python3 -m venv failed (install python3-venv)"
        );
        let st = Command::new(&py)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(SDKS)
            .status()
            .unwrap();
        assert!(st.success(), "pip install {SDKS:?} failed");
    }
    py
}
