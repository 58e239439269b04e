//! Protocol fidelity with a client nobody here wrote: the official Python
//! SDK `cubesandbox==0.7.3`, unmodified, against the standalone backend.

use std::io::BufRead;
use std::path::Path;
use std::process::{Command, Stdio};

use crate::kit::{BIN, sdk_python};

#[test]
fn official_python_sdk_basic_flow() {
    let py = sdk_python();
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(BIN)
        .args([
            "embedded-backend",
            "--listen",
            "127.0.0.1:0",
            "--plain-http",
            "--state-dir",
        ])
        .arg(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line.trim().rsplit(' ').next().unwrap().to_string();
    assert!(url.starts_with("http://127.0.0.1:"), "{line}");
    let port = url.rsplit(':').next().unwrap().to_string();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/sdk_smoke.py");
    let out = Command::new(&py)
        .arg(&script)
        .env("CUBE_API_URL", &url)
        .env("CUBE_PROXY_NODE_IP", "127.0.0.1")
        .env("CUBE_PROXY_PORT_HTTP", &port)
        .env("CUBE_TEMPLATE_ID", "host")
        .env_remove("CUBE_API_KEY")
        .output()
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "SDK smoke test failed");
    assert!(stdout.contains("sdk-smoke: all ok"));
}
