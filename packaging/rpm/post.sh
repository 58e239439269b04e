# cube-adapter %post ($1: 1 install, 2 upgrade). Never enables or starts
# the service: it needs its backend filled in first.
# The config directory is readable by the service's group only; the state
# directory is the service user's alone (systemd's StateDirectory= would
# create it too; here so that `cube-adapter init` can run first).
# Subordinate ids for the embedded backend's sandboxes (docs/security.md,
# "Ids"): 65536 per sandbox, room for 1023, in the first free range at or
# above 2^30. Given once, kept on upgrade and removal.
subids() { # FILE: the first free 65536-aligned id at or above 2^30
    awk -F: -v s=1073741824 'NF >= 3 { e = $2 + $3; if (e > s) s = e }
        END { printf "%.0f\n", int((s + 65535) / 65536) * 65536 }' "$1" 2>/dev/null ||
        echo 1073741824
}
for kind in uid gid; do
    [ -f /etc/sub$kind ] || : >/etc/sub$kind
    if ! grep -q '^cube-adapter:' /etc/sub$kind; then
        s=$(subids /etc/sub$kind)
        if [ $((s + 67108863)) -le 4294967295 ]; then
            usermod --add-sub${kind}s "$s-$((s + 67108863))" cube-adapter
        else
            echo "cube-adapter: no free subordinate ${kind} range; sandboxes will share one ${kind}" >&2
        fi
    fi
done
chown root:cube-adapter /etc/cube-adapter
chmod 0750 /etc/cube-adapter
if [ ! -d /var/lib/cube-adapter ]; then
    mkdir -p /var/lib/cube-adapter
    chown cube-adapter:cube-adapter /var/lib/cube-adapter
fi
chmod 0700 /var/lib/cube-adapter
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload || :
fi
if [ "$1" -eq 1 ]; then
    cat <<'MSG'

cube-adapter is installed (not enabled, not started). Next steps:
  1. Point it at your CubeSandbox cluster: edit /etc/cube-adapter/config.toml
     ([backend]); or, for the embedded backend on this host, delete the
     [backend] section and install the drop-in:
       install -D -m 0644 /usr/share/cube-adapter/embedded.conf \
         /etc/systemd/system/cube-adapter.service.d/embedded.conf
  2. cube-adapter config check
  3. cube-adapter init        (keys, CA, first admin token in /var/lib/cube-adapter/admin.token)
  4. systemctl enable --now cube-adapter && cube-adapter status
Guide: /usr/share/doc/cube-adapter/operations.md

MSG
fi
exit 0
