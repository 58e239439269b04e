//! Copying and removing trees a sandbox can write, as root, without ever
//! following a path the sandbox controls.
//!
//! The backend runs as root and the sandbox's `/workspace`, `/tmp` and
//! `/root` are directories of the host (`sandboxes/<id>/state/…`) that the
//! sandbox writes. A sandbox can put a symbolic link wherever the backend
//! expects a directory or a file, at any moment: a path-based `create`,
//! `mkdir` or `chmod` below such a tree would then land on the host. So every
//! step here is relative to a directory descriptor, one name at a time:
//!
//! - directories are entered with `openat(O_DIRECTORY | O_NOFOLLOW)` on a
//!   single name (a name from `readdir` holds no `/`, and `.`/`..` are
//!   skipped), so no link is ever resolved, at any depth;
//! - files are created with `O_CREAT | O_EXCL | O_NOFOLLOW` (an existing name,
//!   link or not, is an error, never a target) and their owner, mode and time
//!   set on the open descriptor (`fchown`, `fchmod`, `futimens`);
//! - links are recreated as links (`symlinkat`, owner by `fchownat` with
//!   `AT_SYMLINK_NOFOLLOW`), never followed; FIFOs, sockets and devices are
//!   skipped;
//! - set-user-id and set-group-id bits are never copied (`MODE_MASK`), so a
//!   snapshot cannot plant a set-id program, whoever it ends up owned by;
//! - removal only ever `unlinkat`s names inside descriptors it opened with
//!   `O_NOFOLLOW`, and keeps the number of open descriptors bounded however
//!   deep the tree (too deep a directory is moved up and removed from there).
//!
//! Only the top directory is opened by path: it is the backend's own
//! (`state/workspace`, a snapshot's `data/…`), below directories only the
//! backend can write.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{Mode, SFlag};
use nix::unistd::{Gid, Uid, UnlinkatFlags};

/// The mode bits a copy keeps: permissions and the sticky bit, never
/// set-user-id or set-group-id.
pub const MODE_MASK: u32 = 0o1777;

/// Deepest directory nesting a copy follows. Each level holds two
/// descriptors while it is copied; a deeper tree is refused with an error
/// rather than copied in part.
pub const MAX_DEPTH: usize = 256;

/// Directory levels a removal holds open before it moves a deeper directory
/// up to the top and carries on from there.
const REMOVE_OPEN_LEVELS: usize = 32;

const DIR_FLAGS: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_DIRECTORY)
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_CLOEXEC);

/// Map file ownership from one sandbox's id range to another's.
pub struct Shift {
    pub from_uid: u32,
    pub from_gid: u32,
    pub to_uid: u32,
    pub to_gid: u32,
    pub count: u32,
}

impl Shift {
    /// Keep ids as they are (copies inside the backend's own store).
    pub fn keep(uid: u32, gid: u32) -> Self {
        Self {
            from_uid: uid,
            from_gid: gid,
            to_uid: uid,
            to_gid: gid,
            count: u32::MAX,
        }
    }

    fn uid(&self, u: u32) -> u32 {
        match u.checked_sub(self.from_uid) {
            Some(off) if off < self.count => self.to_uid.saturating_add(off),
            _ => self.to_uid,
        }
    }

    fn gid(&self, g: u32) -> u32 {
        match g.checked_sub(self.from_gid) {
            Some(off) if off < self.count => self.to_gid.saturating_add(off),
            _ => self.to_gid,
        }
    }
}

/// Open a directory that must not be a link (only its last component is
/// checked: see the module head).
pub fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    Ok(nix::fcntl::open(path, DIR_FLAGS, Mode::empty())?)
}

/// Open `name` inside `dir` as a directory, never following a link.
pub fn open_dir_at(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<OwnedFd> {
    Ok(nix::fcntl::openat(dir, name, DIR_FLAGS, Mode::empty())?)
}

fn cname(name: &str) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::other("a name with a NUL byte"))
}

/// Copy what is inside directory `src` into the existing directory `dst`
/// (whose own owner and mode stay), shifting owners. A missing `src` copies
/// nothing. (The backend copies by descriptor, `copy_sub`; the tests copy
/// by path.)
#[cfg(test)]
pub fn copy_tree(src: &Path, dst: &Path, shift: &Shift) -> io::Result<()> {
    let from = match open_dir(src) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
        Err(e) => return Err(e),
    };
    let to = open_dir(dst)?;
    copy_into(from.as_fd(), to.as_fd(), shift, 0)
}

/// Copy directory `sub` of `src_parent` into directory `sub` of
/// `dst_parent`, both by descriptor.
pub fn copy_sub(
    src_parent: BorrowedFd<'_>,
    dst_parent: BorrowedFd<'_>,
    sub: &str,
    shift: &Shift,
) -> io::Result<()> {
    let name = cname(sub)?;
    let from = match open_dir_at(src_parent, &name) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
        Err(e) => return Err(e),
    };
    let to = open_dir_at(dst_parent, &name)?;
    copy_into(from.as_fd(), to.as_fd(), shift, 0)
}

fn names_of(dir: BorrowedFd<'_>) -> io::Result<Vec<CString>> {
    let fd = nix::fcntl::openat(dir, c".", DIR_FLAGS, Mode::empty())?;
    let mut d = nix::dir::Dir::from_fd(fd)?;
    let mut out = vec![];
    for e in d.iter() {
        let e = e?;
        let n = e.file_name();
        if n.to_bytes() != b"." && n.to_bytes() != b".." {
            out.push(n.to_owned());
        }
    }
    Ok(out)
}

fn kind_of(st: &nix::sys::stat::FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits())
}

fn owner(shift: &Shift, st: &nix::sys::stat::FileStat) -> (Option<Uid>, Option<Gid>) {
    (
        Some(Uid::from_raw(shift.uid(st.st_uid))),
        Some(Gid::from_raw(shift.gid(st.st_gid))),
    )
}

fn mode(st: &nix::sys::stat::FileStat) -> Mode {
    Mode::from_bits_truncate(st.st_mode & MODE_MASK)
}

fn copy_into(
    src: BorrowedFd<'_>,
    dst: BorrowedFd<'_>,
    shift: &Shift,
    depth: usize,
) -> io::Result<()> {
    for name in names_of(src)? {
        let st = match nix::sys::stat::fstatat(src, name.as_c_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::ENOENT) => continue, // removed meanwhile
            Err(e) => return Err(e.into()),
        };
        let kind = kind_of(&st);
        if kind == SFlag::S_IFLNK {
            let target = nix::fcntl::readlinkat(src, name.as_c_str())?;
            nix::unistd::symlinkat(target.as_os_str(), dst, name.as_c_str())?;
            let (u, g) = owner(shift, &st);
            nix::unistd::fchownat(dst, name.as_c_str(), u, g, AtFlags::AT_SYMLINK_NOFOLLOW)?;
        } else if kind == SFlag::S_IFDIR {
            if depth >= MAX_DEPTH {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("its directories nest deeper than {MAX_DEPTH} levels"),
                ));
            }
            let from = match open_dir_at(src, &name) {
                Ok(fd) => fd,
                // Swapped for a link or removed meanwhile: not copied.
                Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
                    continue;
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
                Err(e) => return Err(e),
            };
            let st = nix::sys::stat::fstat(&from)?;
            nix::sys::stat::mkdirat(dst, name.as_c_str(), Mode::from_bits_truncate(0o700))?;
            let to = open_dir_at(dst, &name)?;
            copy_into(from.as_fd(), to.as_fd(), shift, depth + 1)?;
            let (u, g) = owner(shift, &st);
            nix::unistd::fchown(&to, u, g)?;
            nix::sys::stat::fchmod(&to, mode(&st))?;
        } else if kind == SFlag::S_IFREG {
            let fd = match nix::fcntl::openat(
                src,
                name.as_c_str(),
                OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
                Mode::empty(),
            ) {
                Ok(fd) => fd,
                Err(Errno::ENOENT | Errno::ELOOP) => continue,
                Err(e) => return Err(e.into()),
            };
            let st = nix::sys::stat::fstat(&fd)?;
            if kind_of(&st) != SFlag::S_IFREG {
                continue; // swapped for something else meanwhile
            }
            let out = nix::fcntl::openat(
                dst,
                name.as_c_str(),
                OFlag::O_WRONLY
                    | OFlag::O_CREAT
                    | OFlag::O_EXCL
                    | OFlag::O_NOFOLLOW
                    | OFlag::O_CLOEXEC,
                Mode::from_bits_truncate(0o600),
            )?;
            let mut from = std::fs::File::from(fd);
            let mut to = std::fs::File::from(out);
            io::copy(&mut from, &mut to)?;
            let (u, g) = owner(shift, &st);
            nix::unistd::fchown(&to, u, g)?;
            nix::sys::stat::fchmod(&to, mode(&st))?;
            let atime = nix::sys::time::TimeSpec::new(st.st_atime, st.st_atime_nsec);
            let mtime = nix::sys::time::TimeSpec::new(st.st_mtime, st.st_mtime_nsec);
            nix::sys::stat::futimens(&to, &atime, &mtime)?;
        }
        // FIFOs, sockets and devices are not copied.
    }
    Ok(())
}

/// Ids of sandboxes' slices, given in place to another slice: each id at or
/// above `base` (of whichever sandbox's slice of `count` ids) becomes the
/// id at the same offset in the slice at `to`; ids below `base` (the
/// host's, the service's own) stay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reslice {
    pub base: u32,
    pub count: u32,
    pub to_uid: u32,
    pub to_gid: u32,
}

impl Reslice {
    fn map(base: u32, count: u32, to: u32, id: u32) -> Option<u32> {
        let off = id.checked_sub(base)? % count.max(1);
        Some(to.saturating_add(off))
    }

    fn uid(&self, u: u32) -> Option<u32> {
        Self::map(self.base, self.count, self.to_uid, u).filter(|n| *n != u)
    }

    fn gid(&self, g: u32) -> Option<u32> {
        Self::map(self.base, self.count, self.to_gid, g).filter(|n| *n != g)
    }
}

/// Give the tree in the directory open as `root` (the directory itself
/// included; it goes to the slice's root when its owner is no sandbox's)
/// to another slice (`Reslice`), in place: every entry by descriptor and
/// name, links changed themselves (never followed), directories entered
/// with `O_NOFOLLOW`. Deeper than `MAX_DEPTH` is refused (`InvalidInput`),
/// the part done staying done (a second run finishes it: the mapping is
/// the same whichever slice an id is in). A volume's files (`volumes.rs`)
/// move so, while no sandbox can write them.
pub fn reslice(root: &OwnedFd, r: &Reslice) -> io::Result<()> {
    let st = nix::sys::stat::fstat(root)?;
    let u = r
        .uid(st.st_uid)
        .or((st.st_uid < r.base).then_some(r.to_uid));
    let g = r
        .gid(st.st_gid)
        .or((st.st_gid < r.base).then_some(r.to_gid));
    if u.is_some() || g.is_some() {
        nix::unistd::fchown(root, u.map(Uid::from_raw), g.map(Gid::from_raw))?;
    }
    reslice_into(root.as_fd(), r, 0)
}

fn reslice_into(dir: BorrowedFd<'_>, r: &Reslice, depth: usize) -> io::Result<()> {
    for name in names_of(dir)? {
        let st = match nix::sys::stat::fstatat(dir, name.as_c_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::ENOENT) => continue,
            Err(e) => return Err(e.into()),
        };
        let (u, g) = (r.uid(st.st_uid), r.gid(st.st_gid));
        if u.is_some() || g.is_some() {
            match nix::unistd::fchownat(
                dir,
                name.as_c_str(),
                u.map(Uid::from_raw),
                g.map(Gid::from_raw),
                AtFlags::AT_SYMLINK_NOFOLLOW,
            ) {
                Ok(()) | Err(Errno::ENOENT) => {}
                Err(e) => return Err(e.into()),
            }
        }
        if kind_of(&st) == SFlag::S_IFDIR {
            if depth >= MAX_DEPTH {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("its directories nest deeper than {MAX_DEPTH} levels"),
                ));
            }
            match open_dir_at(dir, &name) {
                Ok(fd) => reslice_into(fd.as_fd(), r, depth + 1)?,
                Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// One directory being emptied: its descriptor, its name in the level
/// above, and the names still to remove.
struct Level {
    fd: OwnedFd,
    name: CString,
    todo: Vec<CString>,
}

/// Remove everything inside directory `dir`, keeping `dir` itself (tests;
/// the backend clears by descriptor, `clear_fd`).
#[cfg(test)]
pub fn clear_dir(dir: &Path) -> io::Result<()> {
    let fd = open_dir(dir)?;
    clear_fd(fd)
}

/// Remove everything inside the directory open as `root`.
pub fn clear_fd(root: OwnedFd) -> io::Result<()> {
    let todo = names_of(root.as_fd())?;
    let mut stack = vec![Level {
        fd: root,
        name: CString::default(),
        todo,
    }];
    let mut moved: u64 = 0;
    loop {
        let depth = stack.len();
        let Some(top) = stack.last_mut() else {
            return Ok(());
        };
        let Some(name) = top.todo.pop() else {
            if depth == 1 {
                return Ok(());
            }
            if let Some(done) = stack.pop()
                && let Some(parent) = stack.last()
            {
                let Level { fd, name, .. } = done;
                drop(fd);
                match nix::unistd::unlinkat(&parent.fd, name.as_c_str(), UnlinkatFlags::RemoveDir) {
                    Ok(()) | Err(Errno::ENOENT) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            continue;
        };
        let st =
            match nix::sys::stat::fstatat(&top.fd, name.as_c_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                Err(Errno::ENOENT) => continue,
                Err(e) => return Err(e.into()),
            };
        if kind_of(&st) != SFlag::S_IFDIR {
            match nix::unistd::unlinkat(&top.fd, name.as_c_str(), UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => {}
                // Became a directory meanwhile: look again.
                Err(Errno::EISDIR) => top.todo.push(name),
                Err(e) => return Err(e.into()),
            }
            continue;
        }
        if depth <= REMOVE_OPEN_LEVELS {
            match open_dir_at(top.fd.as_fd(), &name) {
                Ok(fd) => {
                    let todo = names_of(fd.as_fd())?;
                    stack.push(Level { fd, name, todo });
                }
                // Swapped for a link or a file meanwhile: unlink that instead.
                Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
                    top.todo.push(name);
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(e),
            }
            continue;
        }
        // Too deep to hold open: move it up to the top and remove it from
        // there (a rename inside one tree, never across devices).
        let from = top.fd.try_clone()?;
        let Some(first) = stack.first_mut() else {
            return Ok(());
        };
        loop {
            moved += 1;
            let fresh = cname(&format!(".cube-adapter-removing-{moved}"))?;
            match nix::fcntl::renameat2(
                &from,
                name.as_c_str(),
                &first.fd,
                fresh.as_c_str(),
                nix::fcntl::RenameFlags::RENAME_NOREPLACE,
            ) {
                Ok(()) => {
                    first.todo.push(fresh);
                    break;
                }
                Err(Errno::EEXIST) => continue,
                Err(Errno::ENOENT) => break,
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// Remove a directory and everything in it (nothing when it is missing).
pub fn remove_tree(path: &Path) -> io::Result<()> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::other("cannot remove a root directory"));
    };
    let parent = open_dir(parent)?;
    let name = CString::new(name.as_bytes()).map_err(|_| io::Error::other("NUL in a path"))?;
    match open_dir_at(parent.as_fd(), &name) {
        Ok(fd) => clear_fd(fd)?,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
            return Ok(nix::unistd::unlinkat(
                parent.as_fd(),
                name.as_c_str(),
                UnlinkatFlags::NoRemoveDir,
            )?);
        }
        Err(e) => return Err(e),
    }
    match nix::unistd::unlinkat(parent.as_fd(), name.as_c_str(), UnlinkatFlags::RemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Move every entry of directory `from` into directory `to` (same
/// filesystem), never replacing a name that exists there.
pub fn move_all(from: BorrowedFd<'_>, to: BorrowedFd<'_>) -> io::Result<()> {
    for name in names_of(from)? {
        nix::fcntl::renameat2(
            from,
            name.as_c_str(),
            to,
            name.as_c_str(),
            nix::fcntl::RenameFlags::RENAME_NOREPLACE,
        )?;
    }
    Ok(())
}

/// Make directory `name` in `dir` (mode 0700, for the backend alone) and
/// open it.
pub fn make_dir_at(dir: BorrowedFd<'_>, name: &str) -> io::Result<OwnedFd> {
    let name = cname(name)?;
    nix::sys::stat::mkdirat(dir, name.as_c_str(), Mode::from_bits_truncate(0o700))?;
    open_dir_at(dir, &name)
}

/// Open directory `name` in `dir`, never following a link.
pub fn open_sub(dir: BorrowedFd<'_>, name: &str) -> io::Result<OwnedFd> {
    open_dir_at(dir, &cname(name)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// Links are copied as links (never followed), FIFOs and sockets are
    /// skipped, files keep their bytes and modes.
    #[test]
    fn copy_tree_never_follows_links() {
        let t = tempfile::tempdir().unwrap();
        let (src, dst) = (t.path().join("src"), t.path().join("dst"));
        std::fs::create_dir_all(src.join("sub")).unwrap();
        std::fs::write(src.join("sub/f"), b"data").unwrap();
        std::fs::set_permissions(src.join("sub/f"), std::fs::Permissions::from_mode(0o640))
            .unwrap();
        std::os::unix::fs::symlink("/etc", src.join("etc-link")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", src.join("file-link")).unwrap();
        nix::unistd::mkfifo(
            &src.join("fifo"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        std::fs::create_dir(&dst).unwrap();
        let me = (
            nix::unistd::getuid().as_raw(),
            nix::unistd::getgid().as_raw(),
        );
        let keep = Shift {
            from_uid: me.0,
            from_gid: me.1,
            to_uid: me.0,
            to_gid: me.1,
            count: 1,
        };
        copy_tree(&src, &dst, &keep).unwrap();
        assert_eq!(std::fs::read(dst.join("sub/f")).unwrap(), b"data");
        let mode = std::fs::metadata(dst.join("sub/f"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o640);
        for l in ["etc-link", "file-link"] {
            let md = std::fs::symlink_metadata(dst.join(l)).unwrap();
            assert!(md.file_type().is_symlink(), "{l} was followed");
        }
        assert!(!dst.join("fifo").exists());
        // A source that is itself a link is not followed either.
        let dst2 = t.path().join("dst2");
        std::fs::create_dir(&dst2).unwrap();
        assert!(copy_tree(&src.join("etc-link"), &dst2, &keep).is_err());
        assert_eq!(std::fs::read_dir(&dst2).unwrap().count(), 0);
    }

    fn me() -> Shift {
        Shift::keep(
            nix::unistd::getuid().as_raw(),
            nix::unistd::getgid().as_raw(),
        )
    }

    /// A listing of a tree that never follows links: path, kind, mode,
    /// owner, contents or link target.
    fn fingerprint(root: &Path) -> Vec<String> {
        use std::os::unix::fs::MetadataExt;
        let mut out = vec![];
        let mut todo = vec![root.to_path_buf()];
        while let Some(p) = todo.pop() {
            let md = std::fs::symlink_metadata(&p).unwrap();
            let what = if md.file_type().is_symlink() {
                format!("-> {}", std::fs::read_link(&p).unwrap().display())
            } else if md.is_dir() {
                let mut names: Vec<_> = std::fs::read_dir(&p)
                    .unwrap()
                    .map(|e| e.unwrap().path())
                    .collect();
                names.sort();
                todo.extend(names);
                "dir".into()
            } else {
                format!("{:?}", std::fs::read(&p).unwrap())
            };
            out.push(format!(
                "{} {:o} {}:{} {what}",
                p.display(),
                md.mode(),
                md.uid(),
                md.gid()
            ));
        }
        out
    }

    /// Set-id bits never survive a copy; the sticky bit does.
    #[test]
    fn reslice_moves_slice_ids_in_place_and_never_follows_links() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("v");
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::write(root.join("a/b/f"), b"x").unwrap();
        let outside = t.path().join("outside");
        std::fs::write(&outside, b"o").unwrap();
        std::os::unix::fs::symlink(&outside, root.join("a/l")).unwrap();
        let uid = nix::unistd::geteuid().as_raw();
        let gid = nix::unistd::getegid().as_raw();
        // Everything is ours: with our id as the base, slice offset 0 goes
        // to itself (no change), the root directory included.
        let r = Reslice {
            base: uid,
            count: 65536,
            to_uid: uid,
            to_gid: gid,
        };
        reslice(&open_dir(&root).unwrap(), &r).unwrap();
        assert_eq!(Reslice::map(10, 100, 1000, 15), Some(1005));
        assert_eq!(Reslice::map(10, 100, 1000, 115), Some(1005));
        assert_eq!(Reslice::map(10, 100, 1000, 9), None);
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let base = 0x4000_0000;
        let (a, b) = (base + 2 * 65536, base + 5 * 65536);
        for p in ["a", "a/b", "a/b/f"] {
            std::os::unix::fs::chown(root.join(p), Some(a + 7), Some(a + 8)).unwrap();
        }
        std::os::unix::fs::lchown(root.join("a/l"), Some(a), Some(a)).unwrap();
        let r = Reslice {
            base,
            count: 65536,
            to_uid: b,
            to_gid: b,
        };
        reslice(&open_dir(&root).unwrap(), &r).unwrap();
        use std::os::unix::fs::MetadataExt;
        for p in ["a", "a/b", "a/b/f"] {
            let m = std::fs::symlink_metadata(root.join(p)).unwrap();
            assert_eq!((m.uid(), m.gid()), (b + 7, b + 8), "{p}");
        }
        let l = std::fs::symlink_metadata(root.join("a/l")).unwrap();
        assert_eq!((l.uid(), l.gid()), (b, b));
        // The root directory was the host's: it goes to the slice's root.
        let m = std::fs::metadata(&root).unwrap();
        assert_eq!((m.uid(), m.gid()), (b, b));
        // Never through the link.
        assert_eq!(std::fs::metadata(&outside).unwrap().uid(), 0);
    }

    #[test]
    fn copies_drop_set_id_bits() {
        let t = tempfile::tempdir().unwrap();
        let (src, dst) = (t.path().join("src"), t.path().join("dst"));
        std::fs::create_dir_all(src.join("shared")).unwrap();
        std::fs::create_dir(&dst).unwrap();
        std::fs::write(src.join("tool"), b"#!/bin/sh\n").unwrap();
        std::fs::set_permissions(src.join("tool"), std::fs::Permissions::from_mode(0o6755))
            .unwrap();
        std::fs::set_permissions(src.join("shared"), std::fs::Permissions::from_mode(0o3777))
            .unwrap();
        copy_tree(&src, &dst, &me()).unwrap();
        let mode = |p: &str| {
            std::fs::symlink_metadata(dst.join(p))
                .unwrap()
                .permissions()
                .mode()
                & 0o7777
        };
        assert_eq!(mode("tool"), 0o755);
        assert_eq!(mode("shared"), 0o1777);
    }

    /// Removal never follows a link out of the tree, and empties trees far
    /// deeper than it holds open (and deeper than a path can name).
    #[test]
    fn clear_and_remove_stay_inside_and_go_deep() {
        let t = tempfile::tempdir().unwrap();
        let outside = t.path().join("outside");
        std::fs::create_dir_all(outside.join("keep")).unwrap();
        std::fs::write(outside.join("keep/f"), b"x").unwrap();
        let before = fingerprint(&outside);

        let dir = t.path().join("dir");
        std::fs::create_dir(&dir).unwrap();
        std::os::unix::fs::symlink(&outside, dir.join("link")).unwrap();
        std::os::unix::fs::symlink(outside.join("keep/f"), dir.join("flink")).unwrap();
        // 3,000 levels of 2-byte names: 9,000 bytes, more than PATH_MAX.
        let mut fd = open_dir(&dir).unwrap();
        for i in 0..3000 {
            fd = make_dir_at(fd.as_fd(), "dd").unwrap();
            if i % 500 == 0 {
                std::os::unix::fs::symlink(
                    &outside,
                    format!("/proc/self/fd/{}/up", {
                        use std::os::fd::AsRawFd;
                        fd.as_raw_fd()
                    }),
                )
                .unwrap();
            }
        }
        drop(fd);
        clear_dir(&dir).unwrap();
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        assert_eq!(fingerprint(&outside), before);

        // A copy refuses what is nested too deep, whole.
        let mut fd = open_dir(&dir).unwrap();
        for _ in 0..=MAX_DEPTH {
            fd = make_dir_at(fd.as_fd(), "d").unwrap();
        }
        drop(fd);
        let copy = t.path().join("copy");
        std::fs::create_dir(&copy).unwrap();
        let err = copy_tree(&dir, &copy, &me()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");

        remove_tree(&dir).unwrap();
        assert!(!dir.exists());
        remove_tree(&dir).unwrap(); // already gone: nothing to do
        assert_eq!(fingerprint(&outside), before);
    }

    /// A copy into a directory that another thread keeps rewriting (dirs
    /// swapped for links to a directory outside, as a sandbox would) never
    /// writes, creates or changes anything outside.
    #[test]
    fn copy_into_a_racing_tree_never_touches_outside() {
        let t = tempfile::tempdir().unwrap();
        let outside = t.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(outside.join("canary"), b"still here").unwrap();
        let before = fingerprint(&outside);

        let src = t.path().join("src");
        for d in 0..8 {
            let sub = src.join(format!("d{d}"));
            std::fs::create_dir_all(sub.join("inner")).unwrap();
            for f in 0..40 {
                std::fs::write(sub.join(format!("f{f}")), b"data").unwrap();
            }
            std::fs::write(sub.join("inner/g"), b"data").unwrap();
            std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o777)).unwrap();
        }
        let dst = t.path().join("dst");
        std::fs::create_dir(&dst).unwrap();

        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let swapper = {
            let (dst, outside, stop) = (dst.clone(), outside.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    for d in 0..8 {
                        let p = dst.join(format!("d{d}"));
                        n += 1;
                        // Wait for the copy to make the directory, then
                        // swap it for a link while files go into it.
                        if std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir())
                            && std::fs::rename(&p, dst.join(format!(".old{n}"))).is_ok()
                        {
                            let _ = std::os::unix::fs::symlink(&outside, &p);
                        }
                        // The inner swap by descriptor, as the sandbox
                        // (which cannot write outside) would see it.
                        if let Ok(fd) = open_dir(&p)
                            && let Ok(top) = open_dir(&dst)
                        {
                            let _ = nix::fcntl::renameat(
                                &fd,
                                c"inner",
                                &top,
                                format!(".in{n}").as_str(),
                            );
                            let _ = nix::unistd::symlinkat(&outside, &fd, c"inner");
                        }
                    }
                }
            })
        };
        let mut copied = 0;
        for _ in 0..100 {
            let _ = clear_dir(&dst);
            if copy_tree(&src, &dst, &me()).is_ok() {
                copied += 1;
            }
            assert_eq!(fingerprint(&outside), before, "something outside changed");
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        swapper.join().unwrap();
        assert_eq!(fingerprint(&outside), before);
        // Without the swapper, the same copy is exact.
        clear_dir(&dst).unwrap();
        copy_tree(&src, &dst, &me()).unwrap();
        let strip = |v: Vec<String>, root: &Path| -> Vec<String> {
            let r = root.display().to_string();
            v.into_iter().map(|l| l.replacen(&r, "", 1)).collect()
        };
        assert_eq!(
            strip(fingerprint(&dst), &dst),
            strip(fingerprint(&src), &src)
        );
        eprintln!("{copied} of 100 racing copies completed");
    }
}
