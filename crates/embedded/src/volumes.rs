//! Volumes: storage that outlives sandboxes (`POST /volumes`), mounted into
//! the sandboxes that name them (`volumeMounts` on create).
//!
//! Each volume lives in the backend's state directory, `volumes/<id>/`:
//! `volume.json` (its record), `data/` (what sandboxes see) and, for a
//! volume with a size (`sizeMB`, as root only), `volume.img`: an ext4 file
//! system in a sparse image (as a sandbox's own disk, `disk.rs`), mounted
//! on `data/` only while a sandbox uses it, so that its loop device
//! detaches when the last such sandbox ends or the volume is deleted.
//!
//! A sandbox's launcher opens `data/` before the sandbox takes its ids and
//! its init binds it at the mount's path (nosuid, nodev; read-only when the
//! mount says so), after the masks: the rest of the state directory stays
//! hidden. Volumes are not part of snapshots: the bind exists only in the
//! sandbox's own mount namespace, so the backend's copy of the sandbox's
//! directories sees an empty mount point.
//!
//! Files belong to ids of the slice of the sandbox that wrote them
//! (`subids.rs`): mounted into a sandbox of another slice, they are given
//! to the same ids of the new slice first (`tree::reslice`), while no
//! sandbox can write them; the record keeps the slice they belong to.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::tree;
use crate::clock::random_hex;
use crate::error::BackendError;
use crate::gateway::GATEWAY_DIR;
use crate::wire::{self, CreateVolume, VolumeMount};

/// The volumes' directory in the state directory.
pub const DIR: &str = "volumes";
/// What sandboxes see of a volume, in its directory.
pub const DATA: &str = "data";
/// A sized volume's file system image, in its directory.
pub const IMAGE: &str = "volume.img";
const META: &str = "volume.json";
/// The largest volume size (MiB): 16 TiB, ext4's own bound with 4 KiB blocks.
pub const MAX_MB: u64 = 16 * 1024 * 1024;
/// The most volumes one sandbox mounts.
pub const MAX_MOUNTS: usize = 32;
/// Directories no volume may be mounted on or under: the kernel's views
/// the sandbox's init sets up, and its old root while it builds the new one.
const RESERVED: [&str; 4] = ["proc", "sys", "dev", ".oldroot"];
/// The sandbox directories a rollback empties and refills (a volume's
/// mount point below them would go with them).
const WRITABLE: [&str; 3] = ["workspace", "tmp", "root"];

/// A volume's record (`volumes/<id>/volume.json`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeMeta {
    pub id: String,
    pub name: String,
    pub created_at: String,
    /// As asked (recorded, not interpreted: this backend has one kind).
    #[serde(default)]
    pub driver: Option<String>,
    /// The size of its file system (MiB); None: a directory.
    #[serde(default)]
    pub size_mb: Option<u64>,
    /// The slice its files belong to (the host uid and gid of that slice's
    /// root); None: no sandbox has mounted it yet.
    #[serde(default)]
    pub slice: Option<(u32, u32)>,
}

impl VolumeMeta {
    pub fn wire(&self) -> wire::Volume {
        wire::Volume {
            volume_id: self.id.clone(),
            name: self.name.clone(),
            token: String::new(),
        }
    }
}

/// What the launcher binds (`launch::VolumeBind`).
pub use crate::launch::VolumeBind;

/// How a volume's files move between slices (see `tree::Reslice`).
#[derive(Debug, Clone, Copy)]
pub struct Slices {
    /// The first id of the first sandbox's slice.
    pub base: u32,
    /// Ids per slice.
    pub count: u32,
}

/// The volumes of one backend.
pub struct Volumes {
    dir: PathBuf,
    map: Mutex<BTreeMap<String, VolumeMeta>>,
    /// The slice each volume's files are to belong to next, as the last
    /// sandbox create that decided it said (under the manager's lock);
    /// `attach` moves them there.
    wanted: Mutex<HashMap<String, (u32, u32)>>,
    /// Serialises mounting, moving ids and unmounting (blocking threads).
    attach_lock: Mutex<()>,
}

fn internal(what: &str, e: impl std::fmt::Display) -> BackendError {
    BackendError::Internal(format!("{what}: {e}"))
}

fn now_rfc3339() -> String {
    crate::clock::system_now()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

fn write_meta(dir: &Path, m: &VolumeMeta) -> std::io::Result<()> {
    let tmp = dir.join("volume.json.tmp");
    std::fs::write(
        &tmp,
        serde_json::to_vec_pretty(m).map_err(std::io::Error::other)?,
    )?;
    std::fs::rename(tmp, dir.join(META))
}

/// A UUID-shaped id (version 4) for a volume created without a name.
fn uuid_like() -> String {
    let h = random_hex(16);
    let part = |a: usize, b: usize| h.get(a..b).unwrap_or("0");
    format!(
        "{}-{}-4{}-8{}-{}",
        part(0, 8),
        part(8, 12),
        part(13, 16),
        part(17, 20),
        part(20, 32)
    )
}

/// What a valid create asks for: the id (= name) and the size.
fn check_create(
    req: &CreateVolume,
    images: &Result<(), super::disk::Unavailable>,
) -> Result<(String, Option<u64>), BackendError> {
    let id = if req.name.is_empty() {
        uuid_like()
    } else if wire::valid_volume_id(&req.name) {
        req.name.clone()
    } else {
        return Err(BackendError::BadRequest(
            "volume name must be 1-128 characters of [a-zA-Z0-9_-]".into(),
        ));
    };
    if let Some(d) = &req.driver
        && (d.len() > 128 || d.chars().any(char::is_control))
    {
        return Err(BackendError::BadRequest("invalid volume driver".into()));
    }
    let size = match req.size_mb {
        None | Some(0) => None,
        Some(mb) => {
            if let Err(why) = images {
                return Err(BackendError::BadRequest(format!(
                    "volume sizes: {why}; create the volume without sizeMB"
                )));
            }
            if !(super::disk::MIN_MB..=MAX_MB).contains(&mb) {
                return Err(BackendError::BadRequest(format!(
                    "sizeMB must be 0 (no size) or {}..={MAX_MB}",
                    super::disk::MIN_MB
                )));
            }
            Some(mb)
        }
    };
    Ok((id, size))
}

/// Check and normalise a sandbox's `volumeMounts`: valid volume ids, each
/// at most once; absolute paths without `.` or `..`, not `/`, not on or
/// under `/proc`, `/sys` or `/dev`, none on or under another.
pub fn check_mounts(mounts: &[VolumeMount]) -> Result<Vec<VolumeMount>, BackendError> {
    let bad = |m: String| Err(BackendError::BadRequest(format!("volumeMounts: {m}")));
    if mounts.len() > MAX_MOUNTS {
        return bad(format!("at most {MAX_MOUNTS} volumes per sandbox"));
    }
    let mut out: Vec<VolumeMount> = Vec::with_capacity(mounts.len());
    let mut names = HashSet::new();
    for m in mounts {
        if !wire::valid_volume_id(&m.name) {
            return bad(format!(
                "invalid volume name '{}' (the volume's ID)",
                m.name.escape_debug()
            ));
        }
        if !names.insert(m.name.as_str()) {
            return bad(format!("volume {} is mounted more than once", m.name));
        }
        let p = Path::new(&m.path);
        let shown = m.path.escape_debug();
        if !p.is_absolute() {
            return bad(format!(
                "path '{shown}' of volume {} is not absolute",
                m.name
            ));
        }
        if m.path.len() > 1024 || m.path.contains('\0') {
            return bad(format!("path of volume {} is too long or invalid", m.name));
        }
        if m.path.split('/').any(|s| s == "." || s == "..") {
            return bad(format!(
                "path '{shown}' of volume {} must not hold '.' or '..'",
                m.name
            ));
        }
        let mut norm = PathBuf::from("/");
        for c in p.components() {
            match c {
                Component::RootDir => {}
                Component::Normal(n) if n.len() <= 255 => norm.push(n),
                _ => {
                    return bad(format!(
                        "path '{shown}' of volume {} must not hold '.' or '..'",
                        m.name
                    ));
                }
            }
        }
        let first = norm
            .components()
            .nth(1)
            .and_then(|c| c.as_os_str().to_str())
            .map(str::to_string);
        match first {
            None => return bad(format!("volume {} cannot be mounted on /", m.name)),
            Some(f) if RESERVED.contains(&f.as_str()) => {
                return bad(format!(
                    "volume {} cannot be mounted on or under /{f}",
                    m.name
                ));
            }
            Some(_) => {}
        }
        if Path::new(GATEWAY_DIR).starts_with(&norm) || norm.starts_with(GATEWAY_DIR) {
            return bad(format!(
                "volume {} cannot be mounted on /run or on or under {GATEWAY_DIR}: the \
                 sandbox's MCP gateway is there",
                m.name
            ));
        }
        let Some(path) = norm.to_str().map(str::to_string) else {
            return bad(format!("path of volume {} is not UTF-8", m.name));
        };
        for o in &out {
            let op = Path::new(&o.path);
            if op.starts_with(&norm) || norm.starts_with(op) {
                return bad(format!(
                    "volumes {} and {} are mounted on the same path or one inside the other",
                    o.name, m.name
                ));
            }
        }
        out.push(VolumeMount {
            name: m.name.clone(),
            path,
            read_only: m.read_only.filter(|r| *r),
        });
    }
    Ok(out)
}

/// Whether a (normalised) mount path is inside `/workspace`, `/tmp` or
/// `/root`, which a rollback empties (taking the mount point with it).
pub fn under_writable(path: &str) -> bool {
    WRITABLE.iter().any(|w| {
        Path::new(path)
            .strip_prefix(Path::new("/").join(w))
            .is_ok_and(|r| !r.as_os_str().is_empty())
    })
}

impl Volumes {
    /// Open (make) `STATE/volumes` and read the records; leftovers of a
    /// create or a delete that did not finish are removed.
    pub fn open(state_dir: &Path) -> std::io::Result<Self> {
        let dir = state_dir.join(DIR);
        std::fs::create_dir_all(&dir)?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
        let mut map = BTreeMap::new();
        for e in std::fs::read_dir(&dir)?.flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            let meta: Option<VolumeMeta> = std::fs::read(path.join(META))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .filter(|m: &VolumeMeta| m.id == name && wire::valid_volume_id(&m.id));
            match meta {
                Some(m) => {
                    map.insert(m.id.clone(), m);
                }
                None if e.file_type().is_ok_and(|t| t.is_dir()) => {
                    tracing::warn!(dir = %path.display(), "removing an unfinished volume");
                    super::disk::detach(&path.join(DATA));
                    let _ = tree::remove_tree(&path);
                }
                None => {}
            }
        }
        Ok(Self {
            dir,
            map: Mutex::new(map),
            wanted: Mutex::default(),
            attach_lock: Mutex::new(()),
        })
    }

    fn vol_dir(&self, id: &str) -> PathBuf {
        self.dir.join(id)
    }

    /// The directory sandboxes see of volume `id`.
    pub fn data_path(&self, id: &str) -> PathBuf {
        self.vol_dir(id).join(DATA)
    }

    pub fn get(&self, id: &str) -> Option<VolumeMeta> {
        self.map.lock().ok().and_then(|m| m.get(id).cloned())
    }

    pub fn ids(&self) -> Vec<String> {
        self.map
            .lock()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Every volume, oldest first.
    pub fn list(&self) -> Vec<VolumeMeta> {
        let mut v: Vec<VolumeMeta> = self
            .map
            .lock()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default();
        v.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        v
    }

    /// `POST /volumes` (blocking: a sized volume runs `mkfs`). The
    /// directory's creation claims the name; on any failure nothing stays.
    /// `images`: whether this backend can make file system images
    /// (`disk::available`).
    pub fn create(
        &self,
        req: &CreateVolume,
        images: &Result<(), super::disk::Unavailable>,
    ) -> Result<VolumeMeta, BackendError> {
        let (id, size_mb) = check_create(req, images)?;
        let dir = self.vol_dir(&id);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(BackendError::Conflict(format!(
                    "volume {id} already exists"
                )));
            }
            Err(e) => return Err(internal("create volume", e)),
        }
        let meta = VolumeMeta {
            id: id.clone(),
            name: id.clone(),
            created_at: now_rfc3339(),
            driver: req.driver.clone().filter(|d| !d.is_empty()),
            size_mb,
            slice: None,
        };
        let made = (|| -> std::io::Result<()> {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
            let data = dir.join(DATA);
            std::fs::create_dir(&data)?;
            std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755))?;
            if let Some(mb) = size_mb {
                super::disk::make_image(&dir.join(IMAGE), mb)?;
            }
            write_meta(&dir, &meta)
        })();
        if let Err(e) = made {
            let _ = tree::remove_tree(&dir);
            return Err(internal("create volume", e));
        }
        if let Ok(mut m) = self.map.lock() {
            m.insert(id.clone(), meta.clone());
        }
        tracing::info!(volume = %id, size_mb = ?size_mb, "volume created");
        Ok(meta)
    }

    /// Forget volume `id` (the caller checked that no sandbox uses it);
    /// then `destroy` removes its files.
    pub fn forget(&self, id: &str) -> Option<VolumeMeta> {
        if let Ok(mut w) = self.wanted.lock() {
            w.remove(id);
        }
        self.map.lock().ok().and_then(|mut m| m.remove(id))
    }

    /// The first step of removing volume `id` (blocking; no sandbox uses
    /// it): its file system unmounted, its directory moved aside (its name
    /// is free at once; a backend that stops now removes the rest when it
    /// starts). Then `forget` it and `tree::remove_tree` what this returns.
    pub fn set_aside(&self, id: &str) -> Result<PathBuf, BackendError> {
        let _a = self
            .attach_lock
            .lock()
            .map_err(|_| internal("volume", "poisoned"))?;
        let dir = self.vol_dir(id);
        super::disk::detach(&dir.join(DATA));
        let aside = self.dir.join(format!(".deleting-{}", random_hex(8)));
        std::fs::rename(&dir, &aside).map_err(|e| internal("delete volume", e))?;
        Ok(aside)
    }

    /// The files of volume `id` are to belong to the slice whose root is
    /// `uid`/`gid` (decided while no other sandbox can write them).
    pub fn want_slice(&self, id: &str, uid: u32, gid: u32) {
        if let Ok(mut w) = self.wanted.lock() {
            w.insert(id.to_string(), (uid, gid));
        }
    }

    /// Make volume `id` ready for a sandbox's launch (blocking): its file
    /// system mounted on `data/` (sized ones), its files moved to the slice
    /// last wanted (`want_slice`). Returns `data/`.
    pub fn attach(&self, id: &str, slices: Slices) -> Result<PathBuf, BackendError> {
        let _a = self
            .attach_lock
            .lock()
            .map_err(|_| internal("volume", "poisoned"))?;
        let meta = self
            .get(id)
            .ok_or_else(|| BackendError::BadRequest(format!("volume {id} not found")))?;
        let dir = self.vol_dir(id);
        let data = dir.join(DATA);
        if meta.size_mb.is_some() {
            super::disk::attach_image(&dir.join(IMAGE), &data)
                .map_err(|e| internal(&format!("mount volume {id}"), e))?;
        }
        let wanted = self.wanted.lock().ok().and_then(|w| w.get(id).copied());
        if let Some((uid, gid)) = wanted
            && meta.slice != Some((uid, gid))
        {
            let r = tree::Reslice {
                base: slices.base,
                count: slices.count,
                to_uid: uid,
                to_gid: gid,
            };
            let fresh = meta.slice.is_none();
            tree::open_dir(&data)
                .and_then(|fd| {
                    if fresh && meta.size_mb.is_some() {
                        // mkfs's lost+found (the host's root's) is of no
                        // use to a sandbox.
                        let _ = nix::unistd::unlinkat(
                            &fd,
                            c"lost+found",
                            nix::unistd::UnlinkatFlags::RemoveDir,
                        );
                    }
                    tree::reslice(&fd, &r)
                })
                .map_err(|e| match e.kind() {
                    std::io::ErrorKind::InvalidInput => BackendError::Conflict(format!(
                        "volume {id} cannot be given to the sandbox's ids: {e}"
                    )),
                    _ => internal(&format!("give volume {id} to the sandbox's ids"), e),
                })?;
            let mut m = meta;
            m.slice = Some((uid, gid));
            write_meta(&dir, &m).map_err(|e| internal("persist volume", e))?;
            tracing::info!(volume = %id, uid, "volume's files given to another sandbox's ids");
            if let Ok(mut map) = self.map.lock() {
                map.insert(id.to_string(), m);
            }
        }
        Ok(data)
    }

    /// No sandbox uses volume `id` any more (blocking): unmount its file
    /// system, whose loop device then detaches once the sandboxes' own
    /// mounts of it are gone.
    pub fn release(&self, id: &str) {
        let Ok(_a) = self.attach_lock.lock() else {
            return;
        };
        if self.get(id).is_some_and(|m| m.size_mb.is_some()) {
            super::disk::detach(&self.data_path(id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(name: &str, path: &str) -> VolumeMount {
        VolumeMount {
            name: name.into(),
            path: path.into(),
            read_only: None,
        }
    }

    #[test]
    fn mounts_are_checked_and_normalised() {
        let ok = check_mounts(&[
            mount("a", "/mnt/a/"),
            mount("b", "//data//b"),
            mount("c", "/run/x"),
        ])
        .unwrap();
        assert_eq!(ok[0].path, "/mnt/a");
        assert_eq!(ok[1].path, "/data/b");
        for bad in [
            vec![mount("a", "mnt/a")],
            vec![mount("a", "/")],
            vec![mount("a", "/proc/x")],
            vec![mount("a", "/dev")],
            vec![mount("a", "/mnt/../etc")],
            vec![mount("a", "/mnt/./x")],
            vec![mount("a.b", "/mnt/a")],
            vec![mount("", "/mnt/a")],
            vec![mount("a", "/mnt/a"), mount("a", "/mnt/b")],
            vec![mount("a", "/mnt/a"), mount("b", "/mnt/a")],
            vec![mount("a", "/mnt"), mount("b", "/mnt/b")],
            vec![mount("a", "/mnt/x\0")],
            // The MCP gateway's directory, and what would hide it.
            vec![mount("a", "/run")],
            vec![mount("a", "/run/cube")],
            vec![mount("a", "/run/cube/x")],
        ] {
            assert!(
                matches!(check_mounts(&bad), Err(BackendError::BadRequest(_))),
                "{bad:?}"
            );
        }
        assert!(under_writable("/workspace/v"));
        assert!(!under_writable("/workspace"));
        assert!(!under_writable("/workspaces/v"));
        assert!(!under_writable("/mnt/v"));
    }

    #[test]
    fn names_sizes_and_ids() {
        let yes = Ok(());
        let no = Err(super::super::disk::Unavailable::NotRoot);
        let req = |name: &str, size: Option<u64>| CreateVolume {
            name: name.into(),
            driver: None,
            size_mb: size,
        };
        assert_eq!(check_create(&req("v_1-x", None), &no).unwrap().0, "v_1-x");
        let (id, _) = check_create(&req("", None), &no).unwrap();
        assert_eq!(id.len(), 36);
        assert!(wire::valid_volume_id(&id));
        assert!(check_create(&req("a b", None), &yes).is_err());
        assert!(check_create(&req(&"a".repeat(129), None), &yes).is_err());
        let e = check_create(&req("v", Some(64)), &no).unwrap_err();
        assert!(
            e.to_string().contains("need the backend to run as root"),
            "{e}"
        );
        assert_eq!(check_create(&req("v", Some(0)), &no).unwrap().1, None);
        assert_eq!(check_create(&req("v", Some(64)), &yes).unwrap().1, Some(64));
        assert!(check_create(&req("v", Some(1)), &yes).is_err());
    }

    #[test]
    fn create_claims_the_name_and_a_failure_leaves_nothing() {
        let t = tempfile::tempdir().unwrap();
        let v = Volumes::open(t.path()).unwrap();
        let req = CreateVolume {
            name: "v".into(),
            ..Default::default()
        };
        let m = v
            .create(&req, &Err(super::super::disk::Unavailable::NotRoot))
            .unwrap();
        assert_eq!(m.wire().token, "");
        assert!(t.path().join("volumes/v/data").is_dir());
        assert!(matches!(
            v.create(&req, &Err(super::super::disk::Unavailable::NotRoot)),
            Err(BackendError::Conflict(_))
        ));
        // Read back by a new backend; an unfinished one is removed.
        std::fs::create_dir(t.path().join("volumes/half")).unwrap();
        let v2 = Volumes::open(t.path()).unwrap();
        assert_eq!(v2.ids(), vec!["v".to_string()]);
        assert!(!t.path().join("volumes/half").exists());
        let aside = v2.set_aside("v").unwrap();
        assert!(v2.forget("v").is_some());
        tree::remove_tree(&aside).unwrap();
        assert_eq!(
            std::fs::read_dir(t.path().join("volumes")).unwrap().count(),
            0
        );
    }
}
