# cube-adapter %pre: the service user, before the files that belong to it
# are unpacked. The line is systemd/cube-adapter.sysusers (a test keeps
# them equal).
SYSUSERS='u cube-adapter - "cube-adapter appliance" /var/lib/cube-adapter /usr/sbin/nologin'
if ! getent passwd cube-adapter >/dev/null 2>&1 && command -v systemd-sysusers >/dev/null 2>&1; then
    echo "$SYSUSERS" | systemd-sysusers --replace=/usr/lib/sysusers.d/cube-adapter.conf - || :
fi
if ! getent passwd cube-adapter >/dev/null 2>&1; then
    useradd --system --user-group --home-dir /var/lib/cube-adapter \
        --no-create-home --shell /usr/sbin/nologin \
        --comment "cube-adapter appliance" cube-adapter
fi
exit 0
