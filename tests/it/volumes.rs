//! Volumes on the embedded backend: the CubeAPI calls, mounts into
//! sandboxes (read-write, read-only, one writer at a time), ids across
//! sandboxes' slices, snapshots (which never hold a volume's files) and
//! sized volumes (a file system of their own, as root).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cube_adapter::cube::wire::{CreateSandbox, CreateVolume, VolumeMount};
use cube_adapter::cube::{ErrorKind, SandboxAddr};

use crate::kit::{MB, TestBackend, sh};

/// Unmounts what is still mounted of a test's volumes (a test that failed
/// half-way), so that no loop device outlives it. Declare it after the
/// `TestBackend`: it is then dropped first.
struct VolumeMounts(PathBuf);

impl VolumeMounts {
    fn of(t: &TestBackend) -> Self {
        Self(t.dir.path().join("embedded/volumes"))
    }
}

impl Drop for VolumeMounts {
    fn drop(&mut self) {
        let Ok(text) = std::fs::read_to_string("/proc/self/mountinfo") else {
            return;
        };
        let dir = self.0.canonicalize().unwrap_or_else(|_| self.0.clone());
        for line in text.lines() {
            if let Some(point) = line.split(' ').nth(4)
                && Path::new(point).starts_with(&dir)
            {
                let _ = nix::mount::umount2(point, nix::mount::MntFlags::MNT_DETACH);
            }
        }
    }
}

/// Loop devices whose backing file is under `dir`.
fn loops_under(dir: &Path) -> Vec<String> {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let dir = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/sys/block")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("loop/backing_file")).ok())
        .filter(|b| b.trim().starts_with(&dir))
        .collect()
}

/// Wait (polling, at most 20 s) until `ok` holds.
async fn eventually(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        path: path.into(),
        read_only: read_only.then_some(true),
    }
}

fn with_volumes(template: &str, mounts: Vec<VolumeMount>) -> CreateSandbox {
    CreateSandbox {
        template_id: template.into(),
        volume_mounts: Some(mounts),
        ..Default::default()
    }
}

async fn volume(t: &TestBackend, name: &str, size_mb: Option<u64>) -> String {
    t.client
        .create_volume(&CreateVolume {
            name: name.into(),
            driver: None,
            size_mb,
        })
        .await
        .unwrap()
        .volume_id
}

/// Run a shell command; its stdout, or a panic with its stderr.
async fn run_ok(t: &TestBackend, sb: &SandboxAddr, cmd: &str) -> String {
    let out = t.client.run(sb, &sh(cmd), MB).await.unwrap();
    assert_eq!(
        out.exit_code,
        0,
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Run a shell command that must fail; its stderr.
async fn run_err(t: &TestBackend, sb: &SandboxAddr, cmd: &str) -> String {
    let out = t.client.run(sb, &sh(cmd), MB).await.unwrap();
    assert_ne!(out.exit_code, 0, "{cmd} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The host uid a sandbox's root runs as.
fn host_uid(t: &TestBackend, id: &str) -> u32 {
    let pid = t.backend.manager.init_pid(id).unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

fn no_sandboxes_left(t: &TestBackend) {
    assert_eq!(t.backend.manager.count(), 0);
    let dir = t.dir.path().join("embedded/sandboxes");
    assert_eq!(std::fs::read_dir(dir).unwrap().count(), 0);
}

#[tokio::test]
async fn volumes_are_created_listed_got_and_deleted() {
    let t = TestBackend::start().await;
    let c = &t.client;
    let v = c
        .create_volume(&CreateVolume {
            name: "data-1_x".into(),
            driver: Some("local".into()),
            size_mb: None,
        })
        .await
        .unwrap();
    assert_eq!(
        (v.volume_id.as_str(), v.name.as_str()),
        ("data-1_x", "data-1_x")
    );
    assert_eq!(v.token, "");
    assert!(t.dir.path().join("embedded/volumes/data-1_x/data").is_dir());

    let e = c
        .create_volume(&CreateVolume {
            name: "data-1_x".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Conflict, "{e}");
    for bad in ["a b", "a.b", &"x".repeat(129)] {
        let e = c
            .create_volume(&CreateVolume {
                name: bad.into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{bad}: {e}");
    }

    // No name: a UUID is both ID and name.
    let anon = c.create_volume(&CreateVolume::default()).await.unwrap();
    assert_eq!(anon.volume_id.len(), 36, "{anon:?}");
    assert_eq!(anon.volume_id, anon.name);

    assert_eq!(c.get_volume("data-1_x").await.unwrap(), v);
    let e = c.get_volume("nope").await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound);
    assert!(e.message.contains("volume nope not found"), "{e}");

    let mut ids: Vec<String> = c
        .list_volumes()
        .await
        .unwrap()
        .into_iter()
        .map(|v| v.volume_id)
        .collect();
    ids.sort();
    let mut want = vec![anon.volume_id.clone(), "data-1_x".to_string()];
    want.sort();
    assert_eq!(ids, want);

    c.delete_volume("data-1_x").await.unwrap();
    let e = c.delete_volume("data-1_x").await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound, "{e}");
    c.delete_volume(&anon.volume_id).await.unwrap();
    assert!(c.list_volumes().await.unwrap().is_empty());
    // Nothing of either is left; the name is free again.
    assert_eq!(
        std::fs::read_dir(t.dir.path().join("embedded/volumes"))
            .unwrap()
            .count(),
        0
    );
    volume(&t, "data-1_x", None).await;
    // A new backend on the same state directory finds it again.
    let again =
        cube_adapter::embedded::sandbox::Manager::open(crate::kit::settings(t.dir.path())).unwrap();
    assert_eq!(again.get_volume("data-1_x").unwrap().volume_id, "data-1_x");
}

/// A file written through a volume is there for the next sandbox, owned by
/// that sandbox's own root although its ids are another slice's; the rest
/// of the backend's state directory stays hidden; a pause keeps the mount.
#[tokio::test]
async fn a_volume_outlives_its_sandbox_and_its_files_follow_the_next_ones_ids() {
    let t = TestBackend::start().await;
    let _m = VolumeMounts::of(&t);
    let vol = volume(&t, "shared", None).await;
    // `first` takes slot 0, so `writer` has another slice than `reader`.
    let first = t.sandbox().await;
    let writer = t
        .sandbox_with(with_volumes(
            "host",
            vec![mount(&vol, "/mnt/shared", false)],
        ))
        .await;
    let out = run_ok(
        &t,
        &writer,
        "echo hello > /mnt/shared/f && mkdir /mnt/shared/d && stat -c %u /mnt/shared/f",
    )
    .await;
    assert_eq!(out, "0\n");
    let detail = t.client.get(&writer.id).await.unwrap();
    assert_eq!(
        detail.volume_mounts,
        Some(vec![mount(&vol, "/mnt/shared", false)])
    );
    // Paused and resumed: the volume is still there.
    t.client.pause(&writer.id).await.unwrap();
    t.client.connect(&writer.id, None).await.unwrap();
    assert_eq!(run_ok(&t, &writer, "cat /mnt/shared/f").await, "hello\n");
    let writer_uid = host_uid(&t, &writer.id);
    t.client.kill(&writer.id).await.unwrap();
    t.client.kill(&first.id).await.unwrap();

    let reader = t
        .sandbox_with(with_volumes(
            "minimal",
            vec![mount(&vol, "/data/shared", false)],
        ))
        .await;
    let reader_uid = host_uid(&t, &reader.id);
    assert_ne!(reader_uid, writer_uid, "the sandboxes share a slice");
    let out = run_ok(
        &t,
        &reader,
        "cat /data/shared/f; stat -c '%u %g' /data/shared/f /data/shared/d /data/shared; \
         echo more >> /data/shared/f; ls -A /data/shared",
    )
    .await;
    assert_eq!(out, "hello\n0 0\n0 0\n0 0\nd\nf\n");
    // On the host: the reader's ids.
    use std::os::unix::fs::MetadataExt;
    let f = t.dir.path().join("embedded/volumes/shared/data/f");
    assert_eq!(std::fs::metadata(&f).unwrap().uid(), reader_uid);
    // The state directory (masked) shows nothing, volumes included.
    let state = t.dir.path().join("embedded/volumes/shared/volume.json");
    run_err(&t, &reader, &format!("cat {}", state.display())).await;
    t.client.kill(&reader.id).await.unwrap();
    t.client.delete_volume(&vol).await.unwrap();
}

#[tokio::test]
async fn read_only_mounts_refuse_writes_and_one_sandbox_at_a_time_writes() {
    let t = TestBackend::start().await;
    let _m = VolumeMounts::of(&t);
    let vol = volume(&t, "one-writer", None).await;
    let writer = t
        .sandbox_with(with_volumes("host", vec![mount(&vol, "/mnt/v", false)]))
        .await;
    run_ok(&t, &writer, "echo w > /mnt/v/f").await;
    let reader = t
        .sandbox_with(with_volumes("host", vec![mount(&vol, "/mnt/v", true)]))
        .await;
    assert_eq!(run_ok(&t, &reader, "cat /mnt/v/f").await, "w\n");
    let err = run_err(&t, &reader, "echo r > /mnt/v/g").await;
    assert!(err.contains("Read-only file system"), "{err}");
    let err = run_err(&t, &reader, "mount -o remount,rw /mnt/v").await;
    assert!(!err.is_empty());
    // A second writer while the first runs: 409, and no sandbox made.
    let e = t
        .client
        .create(&with_volumes("host", vec![mount(&vol, "/mnt/v", false)]))
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Conflict, "{e}");
    assert!(e.message.contains("read-write"), "{e}");
    assert_eq!(t.backend.manager.count(), 2);
    // Deleting a mounted volume: 409 (stricter than CubeSandbox).
    let e = t.client.delete_volume(&vol).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::Conflict, "{e}");
    t.client.kill(&writer.id).await.unwrap();
    let e = t.client.delete_volume(&vol).await.unwrap_err();
    assert_eq!(
        e.kind,
        ErrorKind::Conflict,
        "the reader still mounts it: {e}"
    );
    t.client.kill(&reader.id).await.unwrap();
    t.client.delete_volume(&vol).await.unwrap();
}

#[tokio::test]
async fn bad_volume_mounts_are_refused_and_leave_no_sandbox() {
    let t = TestBackend::start().await;
    let _m = VolumeMounts::of(&t);
    let vol = volume(&t, "v", None).await;
    let other = volume(&t, "w", None).await;
    for (mounts, want) in [
        (
            vec![mount("missing", "/mnt/x", false)],
            "volume missing not found",
        ),
        (
            vec![mount(&vol, "/mnt/a", false), mount(&vol, "/mnt/b", true)],
            "more than once",
        ),
        (vec![mount(&vol, "mnt/a", false)], "not absolute"),
        (vec![mount(&vol, "/proc/a", false)], "/proc"),
        (
            vec![
                mount(&vol, "/mnt/a", false),
                mount(&other, "/mnt/a/b", false),
            ],
            "one inside the other",
        ),
        // Inside a read-only directory of the template: the launch fails.
        (
            vec![mount(&vol, "/usr/share/vol", false)],
            "cannot mount volume v",
        ),
    ] {
        let e = t
            .client
            .create(&with_volumes("host", mounts.clone()))
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{mounts:?}: {e}");
        assert!(e.message.contains(want), "{mounts:?}: {e}");
        no_sandboxes_left(&t);
    }
    // And the volumes are free again.
    t.client.delete_volume(&vol).await.unwrap();
    t.client.delete_volume(&other).await.unwrap();
}

/// A snapshot never holds a volume's files; a sandbox made from it mounts
/// the volume again, unless its create names volumes of its own.
#[tokio::test]
async fn snapshots_leave_volumes_out_and_restores_mount_them_again() {
    let t = TestBackend::start().await;
    let _m = VolumeMounts::of(&t);
    let vol = volume(&t, "snapvol", None).await;
    let sb = t
        .sandbox_with(with_volumes(
            "host",
            vec![mount(&vol, "/workspace/vol", false)],
        ))
        .await;
    run_ok(
        &t,
        &sb,
        "echo secret > /workspace/vol/in-volume && echo plain > /workspace/in-rootfs",
    )
    .await;
    let snap = t.client.create_snapshot(&sb.id, None).await.unwrap();
    let data = t
        .dir
        .path()
        .join("embedded/snapshots")
        .join(&snap.snapshot_id)
        .join("data/workspace");
    assert!(data.join("in-rootfs").is_file());
    let in_snapshot: Vec<_> = std::fs::read_dir(data.join("vol"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(in_snapshot.is_empty(), "{in_snapshot:?}");
    // A rollback would take the mount point away: refused.
    let e = t
        .client
        .rollback(&sb.id, &snap.snapshot_id)
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Conflict, "{e}");
    t.client.kill(&sb.id).await.unwrap();

    let restored = t
        .client
        .create_from_snapshot(&snap.snapshot_id, CreateSandbox::default())
        .await
        .unwrap();
    let restored = t.client.addr(&restored);
    assert_eq!(
        run_ok(
            &t,
            &restored,
            "cat /workspace/vol/in-volume /workspace/in-rootfs"
        )
        .await,
        "secret\nplain\n"
    );
    t.client.kill(&restored.id).await.unwrap();

    let without = t
        .client
        .create_from_snapshot(
            &snap.snapshot_id,
            CreateSandbox {
                volume_mounts: Some(vec![]),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let without = t.client.addr(&without);
    assert_eq!(
        run_ok(
            &t,
            &without,
            "ls -A /workspace/vol; cat /workspace/in-rootfs"
        )
        .await,
        "plain\n"
    );
    assert_eq!(t.client.get(&without.id).await.unwrap().volume_mounts, None);
    // The volume is free while only the snapshot names it.
    t.client.kill(&without.id).await.unwrap();
    t.client.delete_volume(&vol).await.unwrap();
    let e = t
        .client
        .create_from_snapshot(&snap.snapshot_id, CreateSandbox::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
    assert!(e.message.contains("volume snapvol not found"), "{e}");
    t.client.delete_snapshot(&snap.snapshot_id).await.unwrap();
    no_sandboxes_left(&t);
}

/// As root, a volume with a size is a file system of that size: a write
/// past it is "No space left on device" inside; its loop device is
/// attached only while a sandbox uses it.
#[tokio::test]
async fn a_sized_volume_is_a_file_system_of_its_size() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: volume sizes need root");
        return;
    }
    let t = TestBackend::start().await;
    let _m = VolumeMounts::of(&t);
    let vols = t.dir.path().join("embedded/volumes");
    let vol = volume(&t, "sized", Some(32)).await;
    assert!(vols.join("sized/volume.img").is_file());
    assert!(loops_under(&vols).is_empty(), "attached before any use");
    let sb = t
        .sandbox_with(with_volumes("host", vec![mount(&vol, "/mnt/sized", false)]))
        .await;
    assert_eq!(loops_under(&vols).len(), 1);
    assert_eq!(
        run_ok(&t, &sb, "stat -c %u /mnt/sized; ls -A /mnt/sized").await,
        "0\n"
    );
    let err = run_err(
        &t,
        &sb,
        "head -c 67108864 /dev/zero > /mnt/sized/big && sync /mnt/sized/big",
    )
    .await;
    assert!(err.contains("No space left on device"), "{err}");
    run_ok(&t, &sb, "rm /mnt/sized/big && echo kept > /mnt/sized/f").await;
    t.client.kill(&sb.id).await.unwrap();
    eventually("the volume's loop device detached", || {
        loops_under(&vols).is_empty()
    })
    .await;

    // Mounted again (read-only): the same file system.
    let sb = t
        .sandbox_with(with_volumes("minimal", vec![mount(&vol, "/mnt/s", true)]))
        .await;
    assert_eq!(run_ok(&t, &sb, "cat /mnt/s/f").await, "kept\n");
    t.client.kill(&sb.id).await.unwrap();
    t.client.delete_volume(&vol).await.unwrap();
    eventually("the volume's loop device detached", || {
        loops_under(&vols).is_empty()
    })
    .await;
    assert!(!vols.join("sized").exists());
}
