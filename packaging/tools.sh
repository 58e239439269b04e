#!/usr/bin/env bash
# The packaging tools, pinned: cargo-deb and cargo-generate-rpm. Built once
# into target/tools (kept between runs, as the npm cache is), both in one
# build directory so the dependencies they share are built once, and
# lightly optimised: they package one binary and need no speed (#35 item 9).
# Sourced by packaging/test-install.sh, which then finds them on PATH.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CARGO_DEB_VERSION=3.8.0
CARGO_GENERATE_RPM_VERSION=0.21.1
TOOLS=$PWD/target/tools
export PATH="$TOOLS/bin:${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
tools=()
cargo deb --version 2>/dev/null | grep -q "$CARGO_DEB_VERSION" || tools+=("cargo-deb@$CARGO_DEB_VERSION")
cargo generate-rpm --version 2>/dev/null | grep -q "$CARGO_GENERATE_RPM_VERSION" ||
    tools+=("cargo-generate-rpm@$CARGO_GENERATE_RPM_VERSION")
if ((${#tools[@]})); then
    printf '\n-- cargo install %s (into target/tools)\n' "${tools[*]}"
    CARGO_TARGET_DIR=$TOOLS/build cargo install --locked --quiet --root "$TOOLS" \
        --config 'profile.release.opt-level=1' --config 'profile.release.lto=false' \
        --config 'profile.release.codegen-units=256' --config 'profile.release.debug=0' \
        --config 'profile.release.incremental=false' "${tools[@]}"
fi
