//! A minimal POSIX ustar writer and reader for backups: regular files and
//! directories, names up to 100 bytes, sizes below 8 GiB. Any `tar`
//! extracts what it writes (`tar -xf FILE`); the reader refuses anything
//! but files and directories with relative names.

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

fn parse_octal(field: &[u8]) -> io::Result<u64> {
    let t: Vec<u8> = field
        .iter()
        .copied()
        .take_while(|b| *b != 0 && *b != b' ')
        .skip_while(|b| *b == b' ')
        .collect();
    if t.is_empty() {
        return Ok(0);
    }
    let s = std::str::from_utf8(&t).map_err(|_| invalid("bad octal field".into()))?;
    u64::from_str_radix(s, 8).map_err(|_| invalid(format!("bad octal field '{s}'")))
}

/// One entry of an archive being read.
pub enum Entry {
    Dir { name: String, mode: u32 },
    File { name: String, mode: u32, size: u64 },
}

/// Reads what `TarWriter` writes (ustar, regular files and directories);
/// refuses anything else: links, devices, absolute names, `..`.
pub struct TarReader<R: Read> {
    r: R,
    /// Bytes of the current file not read yet, then its padding.
    left: u64,
    pad: u64,
}

impl<R: Read> TarReader<R> {
    pub fn new(r: R) -> Self {
        Self { r, left: 0, pad: 0 }
    }

    /// The next entry, or None at the end of the archive. A file's data
    /// must be read with `copy_to` before the next call.
    pub fn next_entry(&mut self) -> io::Result<Option<Entry>> {
        if self.left > 0 {
            return Err(invalid("the previous file was not read".into()));
        }
        io::copy(&mut (&mut self.r).take(self.pad), &mut io::sink())?;
        self.pad = 0;
        let mut h = [0u8; BLOCK];
        self.r.read_exact(&mut h)?;
        if h.iter().all(|b| *b == 0) {
            return Ok(None);
        }
        let field = |from: usize, len: usize| h.get(from..from + len).unwrap_or(&[]);
        let stored = parse_octal(field(148, 8))?;
        let mut sum: u64 = h.iter().map(|b| u64::from(*b)).sum();
        sum -= field(148, 8).iter().map(|b| u64::from(*b)).sum::<u64>();
        sum += 8 * u64::from(b' ');
        if sum != stored {
            return Err(invalid("tar header checksum mismatch".into()));
        }
        if field(257, 6) != b"ustar\0" {
            return Err(invalid("not a ustar archive".into()));
        }
        let name: Vec<u8> = field(0, 100)
            .iter()
            .copied()
            .take_while(|b| *b != 0)
            .collect();
        let name =
            String::from_utf8(name).map_err(|_| invalid("tar entry name is not UTF-8".into()))?;
        if name.is_empty()
            || name.starts_with('/')
            || name.split('/').any(|c| c == "..")
            || field(345, 155).first().is_some_and(|b| *b != 0)
        {
            return Err(invalid(format!("tar entry name '{name}' is not allowed")));
        }
        let mode = u32::try_from(parse_octal(field(100, 8))? & 0o777).unwrap_or(0o600);
        let size = parse_octal(field(124, 12))?;
        match field(156, 1).first().copied().unwrap_or(0) {
            b'0' | 0 => {
                self.left = size;
                self.pad = (BLOCK as u64 - size % BLOCK as u64) % BLOCK as u64;
                Ok(Some(Entry::File { name, mode, size }))
            }
            b'5' => Ok(Some(Entry::Dir {
                name: name.trim_end_matches('/').to_string(),
                mode,
            })),
            k => Err(invalid(format!(
                "tar entry '{name}' of type '{}' is not allowed (files and directories only)",
                char::from(k)
            ))),
        }
    }

    /// The current file's data.
    pub fn copy_to(&mut self, w: &mut impl Write) -> io::Result<u64> {
        let n = io::copy(&mut (&mut self.r).take(self.left), w)?;
        if n != self.left {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the archive ends inside a file",
            ));
        }
        self.left = 0;
        Ok(n)
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
        // Our reader reads it back.
        let mut r = TarReader::new(std::fs::File::open(&path).unwrap());
        let mut seen = vec![];
        while let Some(e) = r.next_entry().unwrap() {
            match e {
                Entry::Dir { name, mode } => seen.push(format!("{name}/ {mode:o}")),
                Entry::File { name, mode, size } => {
                    let mut data = vec![];
                    assert_eq!(r.copy_to(&mut data).unwrap(), size);
                    if name == "tls/a.pem" {
                        assert_eq!(data, body);
                    }
                    seen.push(format!("{name} {mode:o} {size}"));
                }
            }
        }
        assert_eq!(seen, ["tls/ 700", "tls/a.pem 644 1300", "empty 600 0"]);
        // A corrupted header is refused.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[10] ^= 1;
        assert!(TarReader::new(bytes.as_slice()).next_entry().is_err());
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
