//! The few system calls that need `unsafe`: all of them live here, each with
//! its safety argument. Everything else goes through `nix`'s safe wrappers.
#![allow(unsafe_code)]

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::process::Command;

use nix::unistd::{ForkResult, Pid};

/// Which side of a fork we are on.
pub enum Forked {
    Parent(Pid),
    Child,
}

/// `fork(2)`.
///
/// Callers must be single-threaded (the sandbox launcher and the MCP
/// gateway's starter run before any runtime or thread is started), so the
/// child may run arbitrary code.
pub fn fork_single_threaded() -> nix::Result<Forked> {
    // SAFETY: only called from the launcher and the gateway's starter
    // (`launch::launcher_main`, `gateway::gateway_main`, both entered
    // first thing in `main`), which have not started a thread: the child
    // inherits a consistent copy of the whole (single-threaded) process, so
    // it may allocate and run ordinary Rust code.
    match unsafe { nix::unistd::fork() }? {
        ForkResult::Parent { child } => Ok(Forked::Parent(child)),
        ForkResult::Child => Ok(Forked::Child),
    }
}

/// Make the spawned process a session leader whose controlling terminal is
/// its stdin (the PTY slave).
pub fn setsid_with_controlling_tty(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs between fork and exec in the child and only
    // calls async-signal-safe functions (setsid, ioctl) on fd 0, which the
    // Command has already set to the PTY slave.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// `TIOCSWINSZ` on a PTY master.
pub fn set_winsize(fd: BorrowedFd<'_>, rows: u16, cols: u16) -> std::io::Result<()> {
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: fd is a valid open descriptor for the duration of the borrow and
    // `ws` is a properly initialised winsize that outlives the call.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Bring the loopback interface up in the current network namespace.
pub fn loopback_up() -> std::io::Result<()> {
    let sock = nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Inet,
        nix::sys::socket::SockType::Datagram,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(std::io::Error::from)?;
    // SAFETY: ifreq is plain old data; zeroed is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: valid socket fd and a valid, initialised ifreq for both ioctls;
    // ifru_flags is the union member SIOCGIFFLAGS/SIOCSIFFLAGS use.
    unsafe {
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Close a descriptor this process inherited but whose owner (a stack frame
/// of the forked parent) will never run its destructor here: the caller
/// never returns (it serves or reaps until `exit`).
pub fn close_inherited(fd: &std::os::fd::OwnedFd) {
    // SAFETY: the owning `OwnedFd` is never dropped in this process (the
    // caller ends with `std::process::exit`), so no double close happens.
    unsafe {
        libc::close(fd.as_raw_fd());
    }
}

/// Close every descriptor from `first` up: the launcher must not pass
/// whatever its parent leaked (e.g. a shell's job-control pipes) into a
/// sandbox. Runs single-threaded at process start.
pub fn close_fds_from(first: i32) {
    let fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse().ok()))
                .filter(|fd| *fd >= first)
                .collect()
        })
        .unwrap_or_default();
    for fd in fds {
        // SAFETY: single-threaded process start; nothing owns these
        // descriptors yet (the read_dir handle is already closed).
        unsafe {
            libc::close(fd);
        }
    }
}

/// `getxattr(2)`: the value of extended attribute `name` of `path` into
/// `buf`; its length.
pub fn getxattr(path: &std::path::Path, name: &str, buf: &mut [u8]) -> std::io::Result<usize> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    let name = std::ffi::CString::new(name)?;
    // SAFETY: both strings are NUL-terminated and outlive the call; the
    // kernel writes at most `buf.len()` bytes into `buf`.
    let n = unsafe {
        libc::getxattr(
            path.as_ptr(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    usize::try_from(n).map_err(|_| std::io::Error::last_os_error())
}

/// `mount_setattr(2)` with `AT_RECURSIVE`: set `attr_set` (`MOUNT_ATTR_*`)
/// on the mount at `path` and on every mount below it, all or none.
/// Linux 5.12 and later; older kernels answer `ENOSYS`.
pub fn mount_setattr_recursive(path: &std::path::Path, attr_set: u64) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    /// `struct mount_attr` (linux/mount.h), its first published size.
    #[repr(C)]
    struct MountAttr {
        attr_set: u64,
        attr_clr: u64,
        propagation: u64,
        userns_fd: u64,
    }
    const AT_RECURSIVE: libc::c_uint = 0x8000;
    let path = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    let attr = MountAttr {
        attr_set,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: `path` is NUL-terminated and `attr` a fully initialised
    // mount_attr; both outlive the call, and the size passed is attr's own.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            path.as_ptr(),
            AT_RECURSIVE | libc::AT_SYMLINK_NOFOLLOW as libc::c_uint,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Give the memory the allocator holds free back to the system
/// (`malloc_trim(3)`, glibc: every arena, not only the top of the main
/// heap). After a long export: its batches were freed, but on the blocking
/// pool's threads, each with an arena of its own, the freed pages stayed
/// with the process and the service's RSS climbed export after export
/// (#35 item 6). A no-op with other C libraries.
pub fn release_free_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim takes no pointer and only walks the allocator's
    // own arenas under their locks; any thread may call it at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Own a descriptor `recvmsg(2)` has just installed in this process from an
/// `SCM_RIGHTS` message (`egress_tap::attach`), so that it is closed when
/// dropped, whatever it turns out to be.
pub fn own_received_fd(fd: RawFd) -> OwnedFd {
    // SAFETY: the kernel installed `fd` in this process's table for the
    // recvmsg call whose control message named it, and the caller takes
    // it from that message once: nothing else in this process owns it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// `getsockopt(SOL_SOCKET, SO_PROTOCOL)`: a socket's protocol
/// (`IPPROTO_TCP`, …), which nix has no option for.
pub fn socket_protocol(fd: BorrowedFd<'_>) -> std::io::Result<i32> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: fd is open for the borrow; `value` and `len` are valid,
    // initialised and outlive the call, and `len` is `value`'s size.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PROTOCOL,
            (&mut value as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(value)
    }
}
