//! Backup archives: POSIX ustar, written and read with the `tar` crate, so
//! any `tar -xf FILE` extracts a backup.
//!
//! What a restore accepts (the safe-unpack policy, [`check`]): regular
//! files and directories only (no links, devices or FIFOs); names that are
//! relative and made of plain components (no `/` at the start, no `.` or
//! `..`, no NUL), at most 100 bytes, as the writer makes them; and nothing
//! is written by the archive's own paths: the caller creates each entry
//! itself, below its staging directory, with modes it masks.

use std::io::{self, Read, Write};
use std::path::{Component, Path};

/// The largest file a ustar size field holds (8 GiB - 1).
pub const MAX_SIZE: u64 = 0o77777777777;

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// A name the writer may write and the reader accepts.
fn check_name(name: &str) -> io::Result<()> {
    let plain = !name.is_empty()
        && name.len() <= 100
        && !name.contains('\0')
        && Path::new(name)
            .components()
            .all(|c| matches!(c, Component::Normal(_)));
    if plain {
        Ok(())
    } else {
        Err(invalid(format!("tar entry name '{name}' is not allowed")))
    }
}

fn header(
    name: &str,
    mode: u32,
    size: u64,
    mtime: u64,
    kind: tar::EntryType,
) -> io::Result<tar::Header> {
    check_name(name.trim_end_matches('/'))?;
    if size > MAX_SIZE {
        return Err(invalid(format!("{name} is larger than 8 GiB")));
    }
    let mut h = tar::Header::new_ustar();
    h.set_path(name)?;
    h.set_mode(mode & 0o7777);
    h.set_uid(0);
    h.set_gid(0);
    h.set_username("root")?;
    h.set_groupname("root")?;
    h.set_size(size);
    h.set_mtime(mtime);
    h.set_entry_type(kind);
    h.set_cksum();
    Ok(h)
}

/// Writes a backup archive.
pub struct TarWriter<W: Write> {
    b: tar::Builder<W>,
}

impl<W: Write> TarWriter<W> {
    pub fn new(w: W) -> Self {
        Self {
            b: tar::Builder::new(w),
        }
    }

    pub fn dir(&mut self, name: &str, mode: u32, mtime: u64) -> io::Result<()> {
        let name = format!("{}/", name.trim_end_matches('/'));
        let h = header(&name, mode, 0, mtime, tar::EntryType::Directory)?;
        self.b.append(&h, io::empty())
    }

    /// A regular file of exactly `size` bytes read from `r` (fewer is an
    /// error, more is not read).
    pub fn file(
        &mut self,
        name: &str,
        mode: u32,
        mtime: u64,
        size: u64,
        r: &mut impl Read,
    ) -> io::Result<()> {
        let h = header(name, mode, size, mtime, tar::EntryType::Regular)?;
        let mut exact = CountedReader {
            r: r.take(size),
            n: 0,
        };
        self.b.append(&h, &mut exact)?;
        if exact.n != size {
            return Err(invalid(format!(
                "{name} changed size while it was archived ({} of {size} bytes)",
                exact.n
            )));
        }
        Ok(())
    }

    /// Write the end-of-archive blocks; the inner writer.
    pub fn finish(self) -> io::Result<W> {
        self.b.into_inner()
    }
}

struct CountedReader<R> {
    r: R,
    n: u64,
}

impl<R: Read> Read for CountedReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.r.read(buf)?;
        self.n += n as u64;
        Ok(n)
    }
}

/// What a backup entry is, once [`check`]ed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    Dir,
    File { size: u64 },
}

/// The safe-unpack policy for one entry: its name, kind and mode, or why it
/// is refused.
pub fn check<R: Read>(e: &tar::Entry<'_, R>) -> io::Result<(String, Kind, u32)> {
    let h = e.header();
    let path = e.path()?;
    let name = path
        .to_str()
        .ok_or_else(|| invalid("a tar entry name that is not UTF-8".into()))?
        .trim_end_matches('/')
        .to_string();
    check_name(&name)?;
    let mode = h.mode()? & 0o7777;
    let kind = match h.entry_type() {
        tar::EntryType::Directory => Kind::Dir,
        tar::EntryType::Regular | tar::EntryType::Continuous => Kind::File { size: h.size()? },
        other => {
            return Err(invalid(format!(
                "tar entry '{name}' is a {other:?}: a backup holds only files and directories"
            )));
        }
    };
    Ok((name, kind, mode))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GNU tar lists and extracts what we write, byte for byte; our policy
    /// reads it back and refuses what a backup never holds.
    #[test]
    fn tar_reads_it_and_the_policy_holds() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.tar");
        let body: Vec<u8> = (0..1300u32).map(|i| (i % 251) as u8).collect();
        {
            let f = std::fs::File::create(&path).unwrap();
            let mut t = TarWriter::new(f);
            t.dir("tls", 0o700, 1_700_000_000).unwrap();
            t.file(
                "tls/a.pem",
                0o644,
                1_700_000_000,
                1300,
                &mut body.as_slice(),
            )
            .unwrap();
            t.file("empty", 0o600, 1_700_000_000, 0, &mut io::empty())
                .unwrap();
            t.finish().unwrap();
        }
        // A file shorter than announced is an error (the caller then drops
        // the partial archive), never silent padding.
        let mut t = TarWriter::new(vec![]);
        assert!(t.file("short", 0o600, 0, 10, &mut &b"abc"[..]).is_err());
        for bad in ["../x", "/etc/passwd", "a/../../b", "./a", ""] {
            assert!(
                header(bad, 0o600, 0, 0, tar::EntryType::Regular).is_err(),
                "{bad}"
            );
        }
        let mut a = tar::Archive::new(std::fs::File::open(&path).unwrap());
        let mut seen = vec![];
        for e in a.entries().unwrap() {
            let mut e = e.unwrap();
            let (name, kind, mode) = check(&e).unwrap();
            match kind {
                Kind::Dir => seen.push(format!("{name}/ {mode:o}")),
                Kind::File { size } => {
                    let mut data = vec![];
                    e.read_to_end(&mut data).unwrap();
                    assert_eq!(data.len() as u64, size);
                    if name == "tls/a.pem" {
                        assert_eq!(data, body);
                    }
                    seen.push(format!("{name} {mode:o} {size}"));
                }
            }
        }
        assert_eq!(seen, ["tls/ 700", "tls/a.pem 644 1300", "empty 600 0"]);

        // Links and escaping names are refused by the policy.
        let evil = dir.path().join("evil.tar");
        {
            let mut b = tar::Builder::new(std::fs::File::create(&evil).unwrap());
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Symlink);
            h.set_size(0);
            h.set_mode(0o777);
            b.append_link(&mut h, "tls", "/etc").unwrap();
            let mut h = tar::Header::new_gnu();
            h.set_size(1);
            h.set_mode(0o600);
            h.set_entry_type(tar::EntryType::Regular);
            // `append_data` refuses `..` itself: write the name raw.
            h.as_old_mut().name[..5].copy_from_slice(b"../x\0");
            h.set_cksum();
            b.append(&h, &b"x"[..]).unwrap();
            b.finish().unwrap();
        }
        let mut a = tar::Archive::new(std::fs::File::open(&evil).unwrap());
        for e in a.entries().unwrap() {
            let e = e.unwrap();
            assert!(check(&e).is_err());
        }

        let out = std::process::Command::new("tar")
            .arg("-xf")
            .arg(&path)
            .arg("-C")
            .arg(dir.path())
            .output()
            .expect("GNU tar (Debian's tar package) is needed");
        assert!(out.status.success(), "{out:?}");
        assert_eq!(std::fs::read(dir.path().join("tls/a.pem")).unwrap(), body);
        assert_eq!(std::fs::read(dir.path().join("empty")).unwrap(), b"");
    }
}
