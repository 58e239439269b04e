# cube-adapter %post ($1: 1 install, 2 upgrade). Never enables or starts
# the service: it needs its backend filled in first.
# The config directory is readable by the service's group only; the state
# directory is the service user's alone (systemd's StateDirectory= would
# create it too; here so that `cube-adapter init` can run first).
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
