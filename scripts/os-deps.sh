#!/usr/bin/env bash
# Install the OS packages the client test suite needs (Go toolchain, Debian's Rust
# crates for the Rust client's offline build), only those that are missing.
# Called by scripts/test.sh; safe to run again (it does nothing when all are present).
set -euo pipefail
packages=(
    golang-go
    # Rust client: serde/serde_json from Debian, built offline through source replacement.
    librust-serde-dev librust-serde-derive-dev librust-serde-json-dev
)
missing=()
for package in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" \
        || missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "os-deps: need root to install: ${missing[*]}" >&2; exit 1; }
    sudo="sudo"
fi
echo "os-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq >&2
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
