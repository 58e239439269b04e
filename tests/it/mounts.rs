//! Hosts with mounts below the trees a sandbox shows (#35): a separate
//! `/usr/local`, CIS-style partitions below `/var`, a bind-mounted `/etc`
//! file, the packaged state directory under `/var/lib` with the sandboxes'
//! loop-mounted disks. Every template starts there, and nothing below a
//! read-only tree is writable from inside.

use std::path::Path;

use cube_adapter::cube::wire::CreateSandbox;

use crate::kit::{BIN, MB, TestBackend, sh};

/// A launcher that runs the real one in a mount namespace of its own with
/// the host shapes added: a tmpfs on `/usr/local` holding a file anyone may
/// write and a read-only tmpfs below it, a tmpfs and a bound directory
/// below `/var` (`shapes`), a file bound on `/etc/hosts`. `env` goes to the
/// real launcher.
fn launcher(dir: &Path, shapes: &Path, env: &str) -> std::path::PathBuf {
    let s = shapes.display();
    std::fs::create_dir_all(shapes.join("sub")).unwrap();
    std::fs::create_dir_all(shapes.join("bound")).unwrap();
    std::fs::create_dir_all(shapes.join("bound-src")).unwrap();
    std::fs::write(shapes.join("bound-src/file"), "bound\n").unwrap();
    std::fs::write(shapes.join("hosts"), "127.0.0.1 localhost mounts-test\n").unwrap();
    let inner = dir.join("inner.sh");
    std::fs::write(
        &inner,
        format!(
            "set -e\n\
             mount -t tmpfs -o size=1m,mode=1777 cube-test /usr/local\n\
             echo usr-local > /usr/local/marker; chmod 666 /usr/local/marker\n\
             mkdir /usr/local/ro; mount -t tmpfs -o size=1m,ro cube-test /usr/local/ro\n\
             mount -t tmpfs -o size=1m,mode=1777 cube-test {s}/sub\n\
             echo var-sub > {s}/sub/marker; chmod 666 {s}/sub/marker\n\
             mount --bind {s}/bound-src {s}/bound\n\
             mount --bind {s}/hosts /etc/hosts\n\
             exec env {env} {BIN} \"$@\"\n"
        ),
    )
    .unwrap();
    let outer = dir.join("launcher");
    std::fs::write(
        &outer,
        format!(
            "#!/bin/sh\nexec unshare --mount --propagation private /bin/sh {} \"$@\"\n",
            inner.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&outer, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    outer
}

/// What a sandbox sees of the shapes: each line `what: result`.
fn probe(shapes: &Path, host: bool) -> String {
    let s = shapes.display();
    let mut script = String::from(
        "echo \"marker: $(cat /usr/local/marker)\"; \
         echo x 2>&1 >>/usr/local/marker | sed 's/.*: /write: /'; \
         touch /usr/local/ro/x 2>&1 | sed 's/.*: /write-ro: /'; \
         echo \"options: $(awk '$5 == \"/usr/local\" {print $6}' /proc/self/mountinfo)\"; \
         echo \"hosts: $(cat /etc/hosts)\"; ",
    );
    if host {
        script.push_str(&format!(
            "echo \"var-marker: $(cat {s}/sub/marker)\"; \
             echo x 2>&1 >>{s}/sub/marker | sed 's/.*: /var-write: /'; \
             echo \"bound: $(cat {s}/bound/file)\"; \
             touch {s}/bound/x 2>&1 | sed 's/.*: /bound-write: /'; "
        ));
    }
    script
}

fn line<'a>(out: &'a str, what: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.strip_prefix(what).and_then(|r| r.strip_prefix(": ")))
        .unwrap_or_else(|| panic!("no {what} line in:\n{out}"))
}

async fn check_shapes(no_mount_setattr: bool) {
    let dir = tempfile::tempdir().unwrap();
    // Below /var, as on the hosts users have; the state directory too
    // (as the package's /var/lib/cube-adapter), masked as the appliance's.
    let var = tempfile::Builder::new()
        .prefix("cube-mounts-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let shapes = var.path().join("shapes");
    let state = var.path().join("state");
    let env = if no_mount_setattr {
        format!("{}=1", cube_adapter::embedded::launch::NO_MOUNT_SETATTR_ENV)
    } else {
        "CUBE_MOUNTS_TEST=1".to_string()
    };
    let launcher = launcher(dir.path(), &shapes, &env);
    // A template made with `template add`, in the state directory.
    let tar = crate::escape::tiny_rootfs_tar(dir.path());
    cube_adapter::embedded::templates::import(&state.join("embedded"), "tiny", &tar, "now")
        .unwrap();
    let root = nix::unistd::geteuid().is_root();
    let t = TestBackend::start_with(|s| {
        s.state_dir = state.join("embedded");
        s.mask.push(state.clone());
        s.launcher = launcher.clone();
        // As root every sandbox has a disk, loop-mounted below /var.
        if root {
            s.disk_mb = 32;
        }
    })
    .await;
    let mut sandboxes = Vec::new();
    for template in ["minimal", "host", "tiny"] {
        let sb = t
            .client
            .create(&CreateSandbox {
                template_id: template.into(),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("{template} (no mount_setattr: {no_mount_setattr}): {e}"));
        sandboxes.push((template, t.client.addr(&sb)));
    }
    if root {
        // Their disks are loop-mounted below /var, in the host's view too.
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let disks = info
            .lines()
            .filter(|l| l.contains(&format!("{}/", state.display())))
            .count();
        assert_eq!(disks, 3, "{info}");
    }
    for (template, sb) in &sandboxes {
        let script = if *template == "tiny" {
            "echo \"template: $(< /etc/template-name)\"".to_string()
        } else {
            probe(&shapes, *template == "host")
        };
        let out = t.client.run(sb, &sh(&script), MB).await.unwrap();
        let out = String::from_utf8_lossy(&out.stdout).to_string();
        let what = format!("{template} (no mount_setattr: {no_mount_setattr}):\n{out}");
        if *template == "tiny" {
            assert_eq!(line(&out, "template"), "tiny", "{what}");
            continue;
        }
        assert_eq!(line(&out, "marker"), "usr-local", "{what}");
        assert_eq!(line(&out, "write"), "Read-only file system", "{what}");
        assert_eq!(line(&out, "write-ro"), "Read-only file system", "{what}");
        let opts = line(&out, "options");
        assert!(
            opts.starts_with("ro,") && opts.contains("nosuid") && opts.contains("nodev"),
            "{what}"
        );
        assert_eq!(
            line(&out, "hosts"),
            "127.0.0.1 localhost mounts-test",
            "{what}"
        );
        if *template == "host" {
            assert_eq!(line(&out, "var-marker"), "var-sub", "{what}");
            assert_eq!(line(&out, "var-write"), "Read-only file system", "{what}");
            assert_eq!(line(&out, "bound"), "bound", "{what}");
            assert_eq!(line(&out, "bound-write"), "Read-only file system", "{what}");
            // The appliance's own state (and the other sandboxes' disks
            // in it) stays masked.
            let out = t
                .client
                .run(sb, &sh(&format!("ls -A {}", state.display())), MB)
                .await
                .unwrap();
            assert_eq!(out.stdout, b"", "{what}");
        }
    }
    for (_, sb) in &sandboxes {
        t.client.kill(&sb.id).await.unwrap();
    }
}

/// Every template starts on a host with mounts below the trees it shows,
/// and they are read-only inside, with `mount_setattr` (Linux 5.12+).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_template_starts_with_mounts_below_what_it_shows() {
    check_shapes(false).await;
}

/// The same on the path kernels without `mount_setattr` take (one remount
/// per mount).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_template_starts_with_mounts_below_what_it_shows_on_older_kernels() {
    check_shapes(true).await;
}
