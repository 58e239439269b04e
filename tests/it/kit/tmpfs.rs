//! A size-limited tmpfs mounted for a test's duration (needs root and
//! util-linux's `mount`; fails loudly without them).

/// A tmpfs of `size` mounted on `dir` for the test's duration (root only).
pub struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    pub fn mount(dir: &std::path::Path, size: &str) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let st = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(dir)
            .status()
            .expect("`mount` is needed (util-linux)");
        assert!(
            st.success(),
            "mounting a tmpfs needs root (CI runs as root)"
        );
        Self(dir.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}
