//! A sandbox's own disk: its writable directories (`/workspace`, `/tmp`,
//! `/root`) live on a file system of a fixed size, so a sandbox that fills
//! them gets "No space left on device" and the host's disk (with the
//! appliance's audit journal on it) keeps its room.
//!
//! The file system is ext4 in a sparse image, `sandboxes/<id>/disk.img`,
//! loop-mounted (nosuid, nodev, discard) on `sandboxes/<id>/state`: it
//! takes on the host's disk only what the sandbox holds, up to its size
//! (what it deletes goes back to the host, as the loop device punches
//! holes in the image). The loop device
//! detaches by itself when the last mount of it goes (the host's and the
//! sandbox's own). Mounting a loop device needs root on the host: a backend
//! that runs unprivileged makes no disks, and says so when it starts.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The size of a sandbox's disk when neither the request nor the
/// configuration names one (MiB).
pub const DEFAULT_MB: u64 = 4096;
/// The image's name in a sandbox's directory.
pub const IMAGE: &str = "disk.img";
/// The smallest disk a sandbox may have (MiB): ext4's own structures need
/// a few.
pub const MIN_MB: u64 = 16;

fn tool(name: &str) -> Option<PathBuf> {
    ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// Why this process cannot make sandbox disks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    #[error("per-sandbox disks need the backend to run as root on the host")]
    NotRoot,
    #[error("per-sandbox disks need {0} (e2fsprogs, mount)")]
    Missing(&'static str),
}

/// Whether this process can make sandbox disks (root, and the tools).
pub fn available() -> Result<(), Unavailable> {
    if !nix::unistd::geteuid().is_root() || super::subids::in_user_namespace() {
        return Err(Unavailable::NotRoot);
    }
    for t in ["mkfs.ext4", "mount"] {
        if tool(t).is_none() {
            return Err(Unavailable::Missing(t));
        }
    }
    Ok(())
}

fn run(cmd: &mut Command) -> std::io::Result<()> {
    let out = cmd.output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "{:?} failed: {}",
            cmd.get_program(),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// Make a disk of `mb` MiB for the sandbox in `dir` and mount it on
/// `dir/state` (made here).
pub fn make(dir: &Path, mb: u64) -> std::io::Result<()> {
    let img = dir.join(IMAGE);
    let state = dir.join("state");
    std::fs::create_dir_all(&state)?;
    make_image(&img, mb)?;
    mount_image(&img, &state)
}

/// Make the sparse image `img` (which must not exist) of `mb` MiB with an
/// empty ext4 file system in it (also a sized volume's, `volumes.rs`).
pub fn make_image(img: &Path, mb: u64) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(img)?;
    f.set_len(mb.saturating_mul(1024 * 1024))?;
    drop(f);
    let mkfs = tool("mkfs.ext4").ok_or_else(|| std::io::Error::other("no mkfs.ext4"))?;
    // No reserved blocks (the sandbox's root gets the whole size); inode
    // tables initialised lazily (a large disk is made at once); no journal:
    // the disk lives no longer than its sandbox, which a host crash ends
    // (its image is then removed unread), and without one it is made,
    // mounted and unmounted faster and written once.
    run(Command::new(mkfs)
        .args([
            "-q",
            "-F",
            "-m",
            "0",
            "-O",
            "^has_journal",
            "-E",
            "lazy_itable_init=1",
        ])
        .arg(img))
}

fn mount_image(source: &Path, state: &Path) -> std::io::Result<()> {
    let mount = tool("mount").ok_or_else(|| std::io::Error::other("no mount"))?;
    run(Command::new(mount)
        .args(["-o", "loop,nosuid,nodev,noatime,discard"])
        .arg(source)
        .arg(state))
}

/// Whether `path` is a mount point (its device differs from its parent's).
pub fn is_mount_point(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (
        std::fs::metadata(path),
        path.parent().map(std::fs::metadata),
    ) {
        (Ok(a), Some(Ok(b))) => a.dev() != b.dev(),
        _ => false,
    }
}

/// After the backend restarted in another mount namespace (a new service
/// process under systemd): mount the running sandbox's disk on its `state`
/// again. The loop device is still attached (the sandbox's own mounts hold
/// it): mounting that device, never the image through a second one, shares
/// the one file system.
pub fn remount(dir: &Path) -> std::io::Result<()> {
    let img = dir.join(IMAGE);
    let state = dir.join("state");
    if !img.exists() || is_mount_point(&state) {
        return Ok(());
    }
    match loop_device_of(&img)? {
        Some(dev) => mount_device(&dev, &state),
        None => Err(std::io::Error::other(format!(
            "no loop device holds {}",
            img.display()
        ))),
    }
}

/// The loop device whose backing file is `img`, if one is attached.
pub fn loop_device_of(img: &Path) -> std::io::Result<Option<PathBuf>> {
    let canonical = img.canonicalize()?;
    Ok(std::fs::read_dir("/sys/block")?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("loop"))
        .find(|e| {
            std::fs::read_to_string(e.path().join("loop/backing_file"))
                .is_ok_and(|b| Path::new(b.trim()) == canonical)
        })
        .map(|e| PathBuf::from("/dev").join(e.file_name())))
}

fn mount_device(dev: &Path, point: &Path) -> std::io::Result<()> {
    let mount = tool("mount").ok_or_else(|| std::io::Error::other("no mount"))?;
    run(Command::new(mount)
        .args(["-o", "nosuid,nodev,noatime,discard"])
        .arg(dev)
        .arg(point))
}

/// Mount the image `img` on `point` unless it is mounted there already:
/// through the loop device that holds it still (a sandbox's mounts keep
/// one after this process's own mount went), never a second one on the
/// same image (two file systems on one image corrupt it); else through a
/// new loop device, which detaches by itself when its last mount goes.
pub fn attach_image(img: &Path, point: &Path) -> std::io::Result<()> {
    if is_mount_point(point) {
        return Ok(());
    }
    if let Some(dev) = loop_device_of(img)? {
        match mount_device(&dev, point) {
            Ok(()) => return Ok(()),
            // It detached meanwhile (its last mount had just gone): a
            // new one below.
            Err(e) if loop_device_of(img)?.is_some() => return Err(e),
            Err(_) => {}
        }
    }
    mount_image(img, point)
}

/// Unmount what is mounted on `point`, lazily (mounts of it elsewhere,
/// in sandboxes, keep it until they end). Nothing when none is.
pub fn detach(point: &Path) {
    if is_mount_point(point) {
        let _ = nix::mount::umount2(point, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// Unmount the sandbox's disk from `dir/state` (before its directory is
/// removed). Lazily: the sandbox's own mounts keep it until the sandbox
/// ends. Nothing when it has none.
pub fn release(dir: &Path) {
    let state = dir.join("state");
    if is_mount_point(&state) {
        let _ = nix::mount::umount2(&state, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// Unmount the disks of sandboxes that ended with nobody to clean up after
/// them (their backend gone for good, say): any mount on a
/// `…/sandboxes/<id>/state` whose `init.json` names a process that no
/// longer runs (one without `init.json` is being made). A running sandbox's disk is never touched. Returns how
/// many.
pub fn release_dead() -> usize {
    let Ok(text) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return 0;
    };
    let mut n = 0;
    for line in text.lines() {
        let Some(point) = line.split(' ').nth(4) else {
            continue;
        };
        if point.contains('\\') {
            continue; // escaped (spaces, or deleted): not one of ours
        }
        let state = Path::new(point);
        let Some(dir) = state.parent() else {
            continue;
        };
        let ours = state.file_name() == Some(std::ffi::OsStr::new("state"))
            && dir.parent().and_then(|p| p.file_name()) == Some(std::ffi::OsStr::new("sandboxes"))
            && dir.join(IMAGE).exists();
        if !ours {
            continue;
        }
        // No init yet: a sandbox being made (a failed one releases its own).
        let Some(init) = std::fs::read(dir.join(super::launch::INIT_FILE))
            .ok()
            .and_then(|b| serde_json::from_slice::<super::launch::InitInfo>(&b).ok())
        else {
            continue;
        };
        let alive = super::launch::process_start_time(init.pid) == Some(init.start_time);
        if !alive && nix::mount::umount2(state, nix::mount::MntFlags::MNT_DETACH).is_ok() {
            n += 1;
        }
    }
    n
}
