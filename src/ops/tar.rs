//! A minimal POSIX ustar writer for backups: regular files and
//! directories, names up to 100 bytes, sizes below 8 GiB. Any `tar`
//! extracts the result (`tar -xf FILE`).

use std::io::{self, Read, Write};

const BLOCK: usize = 512;
/// The largest size an 11-digit octal field holds.
pub const MAX_SIZE: u64 = 0o77777777777;

pub struct TarWriter<W: Write> {
    w: W,
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// `value` as `width - 1` octal digits and a NUL.
fn octal(field: &mut [u8], value: u64) -> io::Result<()> {
    let digits = field.len().saturating_sub(1);
    let s = format!("{value:0digits$o}");
    if s.len() != digits {
        return Err(invalid(format!("{value} does not fit a tar header field")));
    }
    for (d, b) in field.iter_mut().zip(s.bytes().chain(std::iter::once(0))) {
        *d = b;
    }
    Ok(())
}

fn put(field: &mut [u8], s: &[u8]) {
    for (d, b) in field.iter_mut().zip(s.iter()) {
        *d = *b;
    }
}

fn header(name: &str, mode: u32, size: u64, mtime: u64, kind: u8) -> io::Result<[u8; BLOCK]> {
    if name.is_empty() || name.len() > 100 || name.starts_with('/') || name.contains("..") {
        return Err(invalid(format!("tar entry name '{name}' is not allowed")));
    }
    if size > MAX_SIZE {
        return Err(invalid(format!("{name} is larger than 8 GiB")));
    }
    let mut h = [0u8; BLOCK];
    // The ustar layout: name, mode, uid, gid, size, mtime, checksum,
    // type, link name, magic + version, user and group names (329 of 512).
    let (name_f, rest) = h.split_at_mut(100);
    put(name_f, name.as_bytes());
    let (mode_f, rest) = rest.split_at_mut(8);
    octal(mode_f, u64::from(mode & 0o7777))?;
    let (uid_f, rest) = rest.split_at_mut(8);
    octal(uid_f, 0)?;
    let (gid_f, rest) = rest.split_at_mut(8);
    octal(gid_f, 0)?;
    let (size_f, rest) = rest.split_at_mut(12);
    octal(size_f, size)?;
    let (mtime_f, rest) = rest.split_at_mut(12);
    octal(mtime_f, mtime)?;
    let (chk_f, rest) = rest.split_at_mut(8);
    chk_f.fill(b' ');
    let (type_f, rest) = rest.split_at_mut(1);
    put(type_f, &[kind]);
    let (_link_f, rest) = rest.split_at_mut(100);
    let (magic_f, rest) = rest.split_at_mut(8);
    put(magic_f, b"ustar\x0000");
    let (uname_f, rest) = rest.split_at_mut(32);
    put(uname_f, b"root");
    let (gname_f, _) = rest.split_at_mut(32);
    put(gname_f, b"root");
    let sum: u64 = h.iter().map(|b| u64::from(*b)).sum();
    let chk = format!("{sum:06o}\0 ");
    if let Some(c) = h.get_mut(148..156) {
        put(c, chk.as_bytes());
    }
    Ok(h)
}

impl<W: Write> TarWriter<W> {
    pub fn new(w: W) -> Self {
        Self { w }
    }

    pub fn dir(&mut self, name: &str, mode: u32, mtime: u64) -> io::Result<()> {
        let name = if name.ends_with('/') {
            name.to_string()
        } else {
            format!("{name}/")
        };
        self.w.write_all(&header(&name, mode, 0, mtime, b'5')?)
    }

    /// A regular file of exactly `size` bytes read from `r`.
    pub fn file(
        &mut self,
        name: &str,
        mode: u32,
        mtime: u64,
        size: u64,
        r: &mut impl Read,
    ) -> io::Result<()> {
        self.w.write_all(&header(name, mode, size, mtime, b'0')?)?;
        let n = io::copy(&mut r.take(size), &mut self.w)?;
        if n != size {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{name} changed while it was archived ({n} of {size} bytes)"),
            ));
        }
        let pad = (BLOCK - (size % BLOCK as u64) as usize) % BLOCK;
        self.w.write_all(&vec![0u8; pad])
    }

    /// The end-of-archive marker; returns the writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.w.write_all(&[0u8; 2 * BLOCK])?;
        self.w.flush()?;
        Ok(self.w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GNU tar lists and extracts what we write, byte for byte.
    #[test]
    fn tar_reads_it() {
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
        assert!(header("../x", 0o600, 0, 0, b'0').is_err());
        let Ok(out) = std::process::Command::new("tar")
            .arg("-xf")
            .arg(&path)
            .arg("-C")
            .arg(dir.path())
            .output()
        else {
            eprintln!("no tar here: skipped");
            return;
        };
        assert!(out.status.success(), "{out:?}");
        assert_eq!(std::fs::read(dir.path().join("tls/a.pem")).unwrap(), body);
        assert_eq!(std::fs::read(dir.path().join("empty")).unwrap(), b"");
        use std::os::unix::fs::PermissionsExt;
        let m = std::fs::metadata(dir.path().join("tls/a.pem")).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o644);
    }
}
