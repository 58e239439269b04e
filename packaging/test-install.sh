#!/usr/bin/env bash
# Install test of the packages (#7), run by .ci/run as root on this machine:
# builds the .deb and the .rpm, installs the .deb, checks owners and modes,
# verifies the unit (and the embedded drop-in) with systemd-analyze, starts
# the installed binary as the service user with the settings the unit and
# the drop-in give it, runs acquire -> exec -> release against it, reloads
# it, backs it up, upgrades in place (state and audit kept), removes,
# purges (state kept), and inspects the .rpm's files and scriptlets.
#
# Without systemd as PID 1 nothing here is started by systemd: the service
# process is started the way the unit would start it (user, group, no new
# privileges, no capabilities, umask, state directory, command line). The
# seccomp filter, namespace restrictions and mount protections of the unit
# are systemd's to apply; `systemd-analyze verify` checks the unit itself.
#
# It installs a package and a system user on this machine and removes them
# at the end. It refuses to run where a cube-adapter it did not install is
# present. All traffic stays on loopback.
#
# Environment: CUBE_ADAPTER_BIN, the binary to package (default
# target/debug/cube-adapter, built by `cargo test`; release packages are
# built by `cargo deb` / `cargo generate-rpm` after `cargo build --release`
# and hold the same files).
set -euo pipefail
cd "$(dirname "$0")/.."

STATE=/var/lib/cube-adapter
MARKER=$STATE/.cube-adapter-test-install
DROPIN_DIR=/etc/systemd/system/cube-adapter.service.d
PKG=$PWD/target/pkgtest
LOG=$PKG/serve.log
passed=0
SERVE_PID=
# start_service's optional wrapper (run as root before the service user is
# taken) and configuration file.
SERVE_WRAP=()
SERVE_CONFIG=/etc/cube-adapter/config.toml

log() { printf '\n-- %s\n' "$*"; }
fail() {
    echo "test-install: FAIL: $*" >&2
    [[ -f $LOG ]] && { echo "--- serve log:" >&2; tail -n 40 "$LOG" >&2; }
    exit 1
}
ok() { passed=$((passed + 1)); }
check() { # description, command...
    local what=$1
    shift
    "$@" || fail "$what"
    ok
}
want() { # path mode user group
    local got
    got=$(stat -c '%a %U %G' "$1" 2>/dev/null) || fail "$1 is missing"
    [[ $got == "$2 $3 $4" ]] || fail "$1: $got, want $2 $3 $4"
    ok
}
lacks() { ! grep -qE -- "$1" <<<"$2"; }
json() { python3 -c "import json,sys; v=json.load(sys.stdin); print($1)"; }

if [[ $(id -u) -ne 0 ]]; then
    echo "test-install: needs root (it installs a package): not run"
    exit 0
fi
for t in dpkg python3 curl setpriv newuidmap; do
    command -v "$t" >/dev/null || fail "$t is missing"
done

# --- never touch a real installation -------------------------------------
if [[ -e $STATE || -e /etc/cube-adapter ]] || dpkg-query -W cube-adapter >/dev/null 2>&1; then
    if [[ ! -e $MARKER ]]; then
        fail "a cube-adapter this test did not install is present ($STATE, /etc/cube-adapter or the package): not touching it"
    fi
    log "removing what an earlier run of this test left"
    dpkg -P cube-adapter >/dev/null 2>&1 || true
    rm -rf "$STATE" /etc/cube-adapter "$DROPIN_DIR"
    userdel cube-adapter >/dev/null 2>&1 || true
fi

cleanup() {
    if [[ -n $SERVE_PID ]] && kill -0 "$SERVE_PID" 2>/dev/null; then
        kill -TERM "$SERVE_PID" 2>/dev/null || true
        wait "$SERVE_PID" 2>/dev/null || true
    fi
    # Sandboxes outlive the service by design (KillMode=process): end ours.
    for f in "$STATE"/embedded/sandboxes/*/init.json; do
        [[ -f $f ]] || continue
        pid=$(json 'v.get("pid","")' <"$f" 2>/dev/null || true)
        [[ -n $pid ]] && kill -KILL "$pid" 2>/dev/null || true
    done
    # The backup and its restored copy hold the test's keys.
    rm -rf "$PKG/restored" "$PKG/backup.tar"
    if [[ -e $MARKER ]]; then
        dpkg -P cube-adapter >/dev/null 2>&1 || true
        rm -rf "$STATE" /etc/cube-adapter "$DROPIN_DIR"
        userdel cube-adapter >/dev/null 2>&1 || true
    fi
}
trap cleanup EXIT

# --- tools (pinned; built once, kept in target/tools) ---------------------
source packaging/tools.sh
if ! command -v rpm >/dev/null; then
    log "apt-get install rpm (to inspect the .rpm)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rpm >/dev/null ||
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rpm >/dev/null; }
fi

# --- build both packages --------------------------------------------------
BIN=${CUBE_ADAPTER_BIN:-target/debug/cube-adapter}
if [[ ! -x $BIN ]]; then
    log "cargo build (no binary at $BIN)"
    cargo build --locked --quiet
    BIN=target/debug/cube-adapter
fi
log "packages from $BIN"
rm -rf "$PKG"
mkdir -p "$PKG/release"
cp "$BIN" "$PKG/release/cube-adapter"
strip "$PKG/release/cube-adapter"
for rev in 1 2; do
    CARGO_TARGET_DIR=$PKG cargo deb --quiet --no-build --no-strip --fast \
        --deb-revision "$rev" --output "$PKG/cube-adapter-$rev.deb" >/dev/null
done
cargo generate-rpm --target-dir "$PKG" --output "$PKG/cube-adapter.rpm" >/dev/null
DEB1=$PKG/cube-adapter-1.deb
DEB2=$PKG/cube-adapter-2.deb
RPM=$PKG/cube-adapter.rpm
check "the packages exist" test -s "$DEB1" -a -s "$DEB2" -a -s "$RPM"
VERSION=$(dpkg-deb -f "$DEB1" Version)

# --- install --------------------------------------------------------------
log "dpkg -i ($VERSION)"
DEBIAN_FRONTEND=noninteractive dpkg -i "$DEB1" >"$PKG/install.out" 2>&1 ||
    { cat "$PKG/install.out"; fail "dpkg -i"; }
touch "$MARKER"
check "postinst prints the next steps" grep -q "cube-adapter init" "$PKG/install.out"
check "the service user exists" getent passwd cube-adapter
check "it has subordinate uids" grep -q '^cube-adapter:[0-9]*:67108864$' /etc/subuid
check "and gids" grep -q '^cube-adapter:[0-9]*:67108864$' /etc/subgid
check "its shell is nologin" test "$(getent passwd cube-adapter | cut -d: -f7)" = /usr/sbin/nologin
check "its home is the state directory" test "$(getent passwd cube-adapter | cut -d: -f6)" = "$STATE"
want /usr/bin/cube-adapter 755 root root
want /usr/lib/systemd/system/cube-adapter.service 644 root root
want /usr/lib/sysusers.d/cube-adapter.conf 644 root root
want /usr/share/cube-adapter/embedded.conf 644 root root
want /usr/share/doc/cube-adapter/operations.md 644 root root
want /usr/share/doc/cube-adapter/prometheus/alerts.yml 644 root root
want /usr/share/doc/cube-adapter/grafana/cube-adapter.json 644 root root
want /etc/cube-adapter 750 root cube-adapter
want /etc/cube-adapter/config.toml 640 root cube-adapter
want "$STATE" 700 cube-adapter cube-adapter
check "the config is a conffile" sh -c "dpkg-query -W -f='\${Conffiles}' cube-adapter | grep -q ' /etc/cube-adapter/config.toml '"
check "the service is not enabled by the package" test ! -e /etc/systemd/system/multi-user.target.wants/cube-adapter.service
check "the binary runs" /usr/bin/cube-adapter --version

# --- the unit and the drop-in ---------------------------------------------
install -D -m 0644 /usr/share/cube-adapter/embedded.conf "$DROPIN_DIR/embedded.conf"
if command -v systemd-analyze >/dev/null; then
    log "systemd-analyze verify"
    out=$(systemd-analyze verify /usr/lib/systemd/system/cube-adapter.service 2>&1) || fail "verify: $out"
    # systemd before 254 does not know DelegateSubgroup= and ignores it (the
    # drop-in says what that costs); nothing else may warn.
    if (($(systemd-analyze --version | awk 'NR==1 {print $2}') < 254)); then
        out=$(grep -v "Unknown key 'DelegateSubgroup'" <<<"$out" || true)
    fi
    [[ -z $out ]] || fail "verify warned: $out"
    ok
    shown=$(systemd-analyze cat-config systemd/system/cube-adapter.service.d/embedded.conf 2>/dev/null || true)
    check "the drop-in is where systemd reads it" grep -q "RestrictNamespaces=user mnt pid ipc uts net cgroup" <<<"$shown"
else
    echo "systemd-analyze is not installed: unit not verified here"
fi

# The embedded backend: the operator deletes the [backend] section.
sed -i '/^\[backend\]$/,/^$/ s/^/# /' /etc/cube-adapter/config.toml
check "config check" /usr/bin/cube-adapter config check >/dev/null
check "config check: no backend, so the embedded one" lacks '^\[backend\]' "$(/usr/bin/cube-adapter config check)"

# --- first run: init as root gives the files to the service user ----------
log "cube-adapter init"
check "init" /usr/bin/cube-adapter init >"$PKG/init.out"
check "init wrote the admin token" test -s "$STATE/admin.token"
check "init gave everything to cube-adapter" test -z "$(find "$STATE" ! -user cube-adapter ! -path "$MARKER")"
want "$STATE/admin.token" 600 cube-adapter cube-adapter
want "$STATE/secret.key" 600 cube-adapter cube-adapter
want "$STATE/state.redb" 600 cube-adapter cube-adapter
check "init again changes nothing" sh -c "/usr/bin/cube-adapter init | grep -q 'none issued'"

# Start it the way the unit with the embedded drop-in does: User=/Group=
# cube-adapter, the drop-in's CapabilityBoundingSet= (what newuidmap and
# newgidmap need) and NoNewPrivileges=no, AmbientCapabilities= (empty),
# UMask=0077, StateDirectory=cube-adapter, the unit's ExecStart (plus a free
# loopback port), a clean environment.
start_service() {
    : >"$LOG"
    # The drop-in's ExecStartPre=+ (as root): the cgroups sandboxes' limits
    # need, given to the service user.
    check "sandboxes prepare gives cube-adapter its cgroups" \
        sh -c '/usr/bin/cube-adapter sandboxes prepare --owner cube-adapter | grep -q "given to uid\|nothing to prepare"'
    (
        umask 0077
        cd /
        exec "${SERVE_WRAP[@]}" setpriv --reuid=cube-adapter --regid=cube-adapter --init-groups \
            --bounding-set=-all,+setuid,+setgid,+dac_override,+sys_admin --inh-caps=-all \
            env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
            /usr/bin/cube-adapter serve --config "$SERVE_CONFIG" \
            --listen 127.0.0.1:0
    ) >>"$LOG" 2>&1 &
    SERVE_PID=$!
    for _ in $(seq 1 300); do
        URL=$(sed -n 's/^cube-adapter listening on //p' "$LOG")
        [[ -n $URL ]] && break
        kill -0 "$SERVE_PID" 2>/dev/null || fail "serve exited"
        sleep 0.2
    done
    [[ -n $URL ]] || fail "serve did not start in 60 s"
    check "the service runs as cube-adapter" test "$(stat -c %U /proc/$SERVE_PID)" = cube-adapter
    # In a user namespace of its own (its capabilities are that namespace's,
    # none on the host): root there is cube-adapter, ids 1 and up are its
    # subordinate range.
    local uid sub
    uid=$(id -u cube-adapter)
    sub=$(sed -n 's/^cube-adapter:\([0-9]*\):\([0-9]*\)$/\1 \2/p' /etc/subuid)
    check "in a user namespace of its own" test "$(awk '{print $1, $2, $3}' /proc/$SERVE_PID/uid_map | tr '\n' ' ')" = "0 $uid 1 1 $sub "
    check "the log says so" grep -q 'sandboxes get subordinate ids of their own' "$LOG"
    check "no warning about loose files" lacks 'others can read it' "$(cat "$LOG")"
}
stop_service() {
    kill -TERM "$SERVE_PID"
    local rc=0
    wait "$SERVE_PID" || rc=$?
    SERVE_PID=
    check "serve stops cleanly on SIGTERM (exit $rc)" test "$rc" -eq 0
}
audit_events() { # the events `audit verify` counts
    "${1:-/usr/bin/cube-adapter}" audit verify "${@:2}" | sed -n 's/.*"events":\([0-9]*\).*/\1/p'
}

log "serve as the service user"
start_service
check "listening on loopback" grep -q '^https://127\.0\.0\.1:' <<<"$URL"
T=$(cat "$STATE/admin.token")
C=(--silent --show-error --fail --max-time 60 --cacert "$STATE/tls/ca.pem"
    -H "authorization: Bearer $T" -H "content-type: application/json")
log "acquire -> exec -> release"
L=$(curl "${C[@]}" "$URL/v1/leases/acquire" -d '{"runtime":"mcp","session_key":"install-test"}' | json 'v["lease_ref"]')
check "acquire gave a lease" test -n "$L"
out=$(curl "${C[@]}" "$URL/v1/leases/$L/exec" -d '{"command":"echo installed-ok; cat /etc/hostname >/dev/null; pwd"}')
check "exec ran in the sandbox: $out" grep -q 'installed-ok' <<<"$out"
# The sandbox's root is a host uid of cube-adapter's subordinate range.
read -r SUB_START SUB_COUNT < <(sed -n 's/^cube-adapter:\([0-9]*\):\([0-9]*\)$/\1 \2/p' /etc/subuid)
INIT=$(pgrep -f -- '__sandbox-launch /var/lib/cube-adapter/' | head -n1)
INIT_UID=$(ps -o uid= -p "$INIT" | tr -d ' ')
check "the sandbox runs as a subordinate uid ($INIT_UID)" \
    test "${INIT_UID:-0}" -ge "$SUB_START" -a "${INIT_UID:-0}" -lt $((SUB_START + SUB_COUNT))
# Its limits are cgroup limits, in groups the unprivileged service made
# (cgroup v1 here; on v2 systemd's delegation does it, which needs systemd).
MEMCG=
if [[ ! -e /sys/fs/cgroup/cgroup.controllers ]]; then
    check "the backend found its cgroups" grep -q 'cgroups=cgroup v1 (pids, memory, cpu, freezer)' "$LOG"
    SBX=$(tr '\0' ' ' <"/proc/$INIT/cmdline" | awk '{print $3}' | xargs basename)
    check "the sandbox is in its own memory cgroup" grep -q ":memory:/cube-adapter/$SBX\$" "/proc/$INIT/cgroup"
    MEMCG=/sys/fs/cgroup/memory/cube-adapter/$SBX
    check "made by the service user" test "$(stat -c %U "$MEMCG")" = cube-adapter
    check "with the default memory limit" test "$(cat "$MEMCG/memory.limit_in_bytes")" = $((2048 * 1024 * 1024))
    check "and the default process limit" test "$(cat "/sys/fs/cgroup/pids/cube-adapter/$SBX/pids.max")" = 512
else
    log "cgroup v2 host: delegation needs systemd, not checked here"
fi
curl "${C[@]}" "$URL/v1/leases/$L/release" -d '{"action":"kill"}' >/dev/null
ok
if [[ -n $MEMCG ]]; then
    for _ in $(seq 1 50); do [[ -e $MEMCG ]] || break; sleep 0.1; done
    check "the killed sandbox's cgroups are removed" test ! -e "$MEMCG"
fi
check "status: running and ready" /usr/bin/cube-adapter status >"$PKG/status.out"
check "status shows the embedded backend" grep -q 'backend:      embedded' "$PKG/status.out"

log "reload (SIGHUP) and backup while running"
kill -HUP "$SERVE_PID"
for _ in $(seq 1 100); do
    r=$(/usr/bin/cube-adapter status --json | json 'v["last_reload"] and v["last_reload"]["ok"]')
    [[ $r == True ]] && break
    sleep 0.1
done
check "the reload applied" test "$r" = True
check "backup while running" /usr/bin/cube-adapter backup "$PKG/backup.tar"
check "the backup holds the store and its keys" sh -c "tar -tf '$PKG/backup.tar' | grep -qx state.redb && tar -tf '$PKG/backup.tar' | grep -qx secret.key"
stop_service
EVENTS=$(audit_events)
check "the journal has the cycle's events ($EVENTS)" test "${EVENTS:-0}" -ge 6
check "the backup restores (checked against its manifest)" \
    /usr/bin/cube-adapter restore "$PKG/backup.tar" --state-dir "$PKG/restored" --config /dev/null
check "the restored journal verifies" test "$(audit_events /usr/bin/cube-adapter --state-dir "$PKG/restored" --config /dev/null)" -ge 6

# --- upgrade in place -----------------------------------------------------
log "upgrade to $(dpkg-deb -f "$DEB2" Version)"
DEBIAN_FRONTEND=noninteractive dpkg -i --force-confold "$DEB2" >"$PKG/upgrade.out" 2>&1 ||
    { cat "$PKG/upgrade.out"; fail "dpkg -i (upgrade)"; }
check "upgraded" test "$(dpkg-query -W -f='${Version}' cube-adapter)" = "$(dpkg-deb -f "$DEB2" Version)"
check "the operator's config edit is kept" grep -q '^# \[backend\]$' /etc/cube-adapter/config.toml
want /etc/cube-adapter/config.toml 640 root cube-adapter
want "$STATE" 700 cube-adapter cube-adapter
check "state kept: the journal verifies with the same events" test "$(audit_events)" = "$EVENTS"
check "the subordinate ids are not given twice" test "$(grep -c '^cube-adapter:' /etc/subuid)" = 1
start_service
v=$(/usr/bin/cube-adapter status --json)
check "the upgraded service reads the old state" test "$(json 'v["store"]["audit_last_seq"] >= '"$EVENTS" <<<"$v")" = True
check "and is ready" test "$(json 'v["ready"]' <<<"$v")" = True
stop_service
EVENTS=$(audit_events)

# --- a host with mounts below what sandboxes show (#35) ------------------
# A tmpfs on /usr/local (a file anyone may write in it) and below /var, a
# bound directory below /var, a file bound on /etc/hosts, and the state
# directory under /var/lib: sandboxes of both built-in templates start for
# the unprivileged service and see those mounts, read-only.
log "serve on a host with mounts below /usr and /var"
SHAPES=/var/tmp/cube-adapter-test-shapes
mkdir -p "$SHAPES/sub" "$SHAPES/bound" "$SHAPES/bound-src"
echo bound >"$SHAPES/bound-src/file"
echo "127.0.0.1 localhost shapes-test" >"$SHAPES/hosts"
chmod -R a+rX "$SHAPES"
SERVE_WRAP=(unshare --mount --propagation private sh -c '
    set -e
    mount -t tmpfs -o size=1m,mode=1777 shapes /usr/local
    echo usr-local >/usr/local/marker; chmod 666 /usr/local/marker
    mount -t tmpfs -o size=1m,mode=1777 shapes "$0/sub"
    echo var-sub >"$0/sub/marker"; chmod 666 "$0/sub/marker"
    mount --bind "$0/bound-src" "$0/bound"
    mount --bind "$0/hosts" /etc/hosts
    exec "$@"' "$SHAPES")
SERVE_CONFIG=/etc/cube-adapter/shapes-test.toml
{
    cat /etc/cube-adapter/config.toml
    printf '\n[profiles.offline-code]\ntemplate = "minimal"\n[profiles.host-view]\ntemplate = "host"\n'
} >"$SERVE_CONFIG"
chown root:cube-adapter "$SERVE_CONFIG"
chmod 0640 "$SERVE_CONFIG"
start_service
for profile in offline-code host-view; do
    L=$(curl "${C[@]}" "$URL/v1/leases/acquire" \
        -d "{\"runtime\":\"mcp\",\"session_key\":\"shapes-$profile\",\"profile\":\"$profile\"}" | json 'v["lease_ref"]')
    check "$profile: a sandbox starts" test -n "$L"
    cmd='cat /usr/local/marker; echo x 2>&1 >>/usr/local/marker; cat /etc/hosts'
    [[ $profile == host-view ]] && cmd+="; cat $SHAPES/sub/marker $SHAPES/bound/file; echo x 2>&1 >>$SHAPES/sub/marker; touch $SHAPES/bound/x 2>&1; ls -A $STATE"
    out=$(curl "${C[@]}" "$URL/v1/leases/$L/exec" -d "$(python3 -c 'import json,sys; print(json.dumps({"command": sys.argv[1]}))' "$cmd")" | json 'v["stdout"]')
    check "$profile: /usr/local's tmpfs shows: $out" grep -qx usr-local <<<"$out"
    check "$profile: read-only" grep -q '/usr/local/marker: Read-only file system' <<<"$out"
    check "$profile: the bound /etc/hosts shows" grep -qx '127.0.0.1 localhost shapes-test' <<<"$out"
    if [[ $profile == host-view ]]; then
        check "host: /var's tmpfs shows" grep -qx var-sub <<<"$out"
        check "host: the directory bound below /var shows" grep -qx bound <<<"$out"
        check "host: read-only" test "$(grep -c 'Read-only file system' <<<"$out")" = 3
        check "host: the state directory is masked" lacks 'state.redb' "$out"
    fi
    curl "${C[@]}" "$URL/v1/leases/$L/release" -d '{"action":"kill"}' >/dev/null
done
stop_service
SERVE_WRAP=()
SERVE_CONFIG=/etc/cube-adapter/config.toml
rm -f /etc/cube-adapter/shapes-test.toml
rm -rf "$SHAPES"
EVENTS=$(audit_events)

# --- remove, purge --------------------------------------------------------
log "dpkg -r"
dpkg -r cube-adapter >/dev/null
check "remove: the binary is gone" test ! -e /usr/bin/cube-adapter
check "remove: the config stays" test -f /etc/cube-adapter/config.toml
check "remove: the state stays" test -f "$STATE/state.redb"
log "dpkg -P"
dpkg -P cube-adapter >"$PKG/purge.out" 2>&1
check "purge: the config is gone" test ! -e /etc/cube-adapter/config.toml
check "purge: the state stays" test -f "$STATE/state.redb" -a -f "$STATE/secret.key"
check "purge says so" grep -q 'stay in /var/lib/cube-adapter' "$PKG/purge.out"
check "purge: the journal is intact ($EVENTS events)" test "$(audit_events "$PKG/release/cube-adapter" --config /dev/null --state-dir "$STATE")" = "$EVENTS"
check "purge: the user stays (its files do)" getent passwd cube-adapter

# --- the .rpm -------------------------------------------------------------
log "rpm -qp"
files=$(rpm -qp --qf '[%{FILEMODES:perms} %{FILEUSERNAME} %{FILEGROUPNAME} %{FILENAMES}\n]' "$RPM" 2>/dev/null)
for f in "-rwxr-xr-x root root /usr/bin/cube-adapter" \
    "-rw-r--r-- root root /usr/lib/systemd/system/cube-adapter.service" \
    "-rw-r--r-- root root /usr/lib/sysusers.d/cube-adapter.conf" \
    "-rw-r--r-- root root /usr/share/cube-adapter/embedded.conf" \
    "-rw-r----- root cube-adapter /etc/cube-adapter/config.toml"; do
    check "rpm holds: $f" grep -qxF -- "$f" <<<"$files"
done
check "rpm: nothing under /etc/systemd" lacks ' /etc/systemd' "$files"
check "rpm: the config is noreplace" sh -c "rpm -qp --qf '[%{FILEFLAGS:fflags} %{FILENAMES}\n]' '$RPM' 2>/dev/null | grep -qx 'cn /etc/cube-adapter/config.toml'"
scripts=$(rpm -qp --scripts "$RPM" 2>/dev/null)
for s in "preinstall scriptlet" "postinstall scriptlet" "preuninstall scriptlet" "postuninstall scriptlet" \
    "systemd-sysusers --replace=/usr/lib/sysusers.d/cube-adapter.conf" "useradd --system" \
    "systemctl try-restart cube-adapter.service" "chmod 0750 /etc/cube-adapter" \
    "chmod 0700 /var/lib/cube-adapter"; do
    check "rpm scripts: $s" grep -qF -- "$s" <<<"$scripts"
done
check "rpm never enables or starts the service" lacks '^[[:space:]]*systemctl (enable|start|restart)' "$scripts"
check "neither does the deb" lacks '^[[:space:]]*systemctl (enable|start|restart)' "$(cat packaging/debian/*)"
check "rpm requires shadow-utils" sh -c "rpm -qpR '$RPM' 2>/dev/null | grep -q '^shadow-utils'"

echo
echo "test-install: $passed passed, 0 failed"
