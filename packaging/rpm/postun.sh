# cube-adapter %postun ($1: 0 erase, 1 upgrade). rpm keeps a changed
# config as .rpmsave and never removes /var/lib/cube-adapter's contents
# (the state and audit journal are no package's files).
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload || :
    if [ "$1" -ge 1 ]; then
        systemctl try-restart cube-adapter.service || :
    fi
fi
if [ "$1" -eq 0 ] && [ -d /var/lib/cube-adapter ]; then
    echo "cube-adapter: removed; the state and audit journal stay in /var/lib/cube-adapter"
fi
exit 0
