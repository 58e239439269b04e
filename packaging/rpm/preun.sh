# cube-adapter %preun ($1: 0 erase, 1 upgrade): stop and disable on erase.
if [ "$1" -eq 0 ] && [ -d /run/systemd/system ]; then
    systemctl stop cube-adapter.service || :
    systemctl disable cube-adapter.service >/dev/null 2>&1 || :
fi
exit 0
