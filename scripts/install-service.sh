#!/usr/bin/env bash
# Install sfcore-ai from this checkout as a systemd service. See --help.
set -euo pipefail
umask 022  # the service user must be able to read the venv and the config

usage() {
    cat <<'EOF'
Usage: scripts/install-service.sh [--socket] [--now] [--dry-run] [--no-venv]

Installs sfcore-ai from the checkout this script lives in as a systemd service
(run as root):

  1. the system user and group sfcore-ai (useradd --system), unless they exist;
  2. /etc/sfcore-ai/server_config.toml, copied from the repository's
     server_config.toml only if absent: an existing config is never overwritten;
  3. a venv in /opt/sfcore-ai/.venv with sfcore-ai and sfcore-client installed
     from this checkout by pip (llama-cpp-python from this machine's own wheel,
     scripts/llama_wheel.py, compiled only if none was built for this CPU before); skipped when the
     installed sources are the same as this checkout's;
  4. sfcore-ai.service and sfcore-ai.socket into /etc/systemd/system, then
     systemctl daemon-reload if either changed;
  5. systemctl enable sfcore-ai.service (with --socket: sfcore-ai.socket).

It says what it does, one line per step. Running it again changes only what
differs; when everything is in place it says there is nothing to do.

Options:
  --socket    enable sfcore-ai.socket (start on the first connection) instead
              of sfcore-ai.service (start at boot)
  --now       also start the enabled unit now; restart the service if it is
              running and its files changed
  --dry-run   say what would be done, change nothing
  --no-venv   leave the venv alone (step 3 is skipped)
  -h, --help  this text

Environment (for packaging and tests):
  SFCORE_PREFIX    instead of /opt/sfcore-ai (the venv is $SFCORE_PREFIX/.venv)
  SFCORE_ETC       instead of /etc/sfcore-ai
  SFCORE_UNIT_DIR  instead of /etc/systemd/system
  PYTHON           the interpreter for the venv (default /usr/bin/python3, >= 3.11;
                   not under /root or /home, which the service cannot read)
  SYSTEMCTL, GETENT, USERADD, RUNUSER
                   the commands used (e.g. SYSTEMCTL=true where systemd does not run)

Afterwards: systemctl status sfcore-ai; journalctl -u sfcore-ai -f
EOF
}

socket=0 now=0 dry_run=0 venv_step=1
while [ $# -gt 0 ]; do
    case "$1" in
        --socket) socket=1 ;;
        --now) now=1 ;;
        --dry-run|-n) dry_run=1 ;;
        --no-venv) venv_step=0 ;;
        -h|--help) usage; exit 0 ;;
        *) printf 'install-service.sh: unknown argument %s (see --help)\n' "$1" >&2; exit 2 ;;
    esac
    shift
done

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="${SFCORE_PREFIX:-/opt/sfcore-ai}"
etc="${SFCORE_ETC:-/etc/sfcore-ai}"
unit_dir="${SFCORE_UNIT_DIR:-/etc/systemd/system}"
systemctl="${SYSTEMCTL:-systemctl}"
getent="${GETENT:-getent}"
useradd="${USERADD:-useradd}"
runuser="${RUNUSER:-runuser}"
user=sfcore-ai  # the units name it (User=, SocketUser=)
venv="$prefix/.venv"
config="$etc/server_config.toml"
service=sfcore-ai.service
target=$service
[ "$socket" = 1 ] && target=sfcore-ai.socket

say() { printf '%-8s %s\n' "$1" "$2"; }
die() { printf 'install-service.sh: %s\n' "$1" >&2; exit 1; }

changed=0        # something was (or, in a dry run, would be) changed
units_changed=0  # a unit file: daemon-reload, and a running service is out of date
code_changed=0   # the venv: a running service is out of date

# step TAG DONE WOULD COMMAND...: run COMMAND (not in a dry run) and report it.
step() {
    local tag=$1 done_text=$2 would_text=$3
    shift 3
    changed=1
    if [ "$dry_run" = 1 ]; then
        say "$tag" "would $would_text"
    else
        "$@"
        say "$tag" "$done_text"
    fi
}

# --- before changing anything -------------------------------------------------------

for file in server_config.toml pyproject.toml systemd/sfcore-ai.service systemd/sfcore-ai.socket; do
    [ -f "$repo/$file" ] || die "$repo/$file is missing: run this script from an sfcore-ai checkout"
done
for path in "$prefix" "$etc" "$unit_dir"; do
    case "$path" in
        /*) ;;
        *) die "$path: the install paths must be absolute" ;;
    esac
    case "$path" in
        *'#'*|*$'\n'*|*' '*) die "$path: the install paths may not contain '#', spaces or newlines" ;;
    esac
done
if [ "$dry_run" = 0 ]; then
    [ "$(id -u)" = 0 ] || die "run as root (or see what it would do with --dry-run)"
    if [ -z "${SYSTEMCTL:-}" ] && [ ! -d /run/systemd/system ]; then
        die "systemd is not running on this machine (no /run/systemd/system), so the units \
could not be loaded; nothing was changed (SYSTEMCTL=true skips systemctl, e.g. in an image build)"
    fi
fi
[ "$dry_run" = 1 ] && say dry-run "nothing is changed; every 'would' is what a real run does"

python=""
if [ "$venv_step" = 1 ]; then
    python="${PYTHON:-}"
    if [ -z "$python" ]; then
        if [ -x /usr/bin/python3 ]; then python=/usr/bin/python3; else python=python3; fi
    fi
    command -v "$python" >/dev/null || die "no Python interpreter $python (set PYTHON=...)"
    py_info="$("$python" -c 'import sys
print("%d.%d.%d" % sys.version_info[:3], int(sys.version_info >= (3, 11)), sys.base_prefix)')" \
        || die "$python does not run"
    read -r py_version py_ok py_base <<<"$py_info"
    [ "$py_ok" = 1 ] || die "$python is Python $py_version; sfcore-ai needs 3.11 or later (set PYTHON=...)"
    case "$py_base/" in
        /root/*|/home/*) die "$python lives in $py_base, which the service cannot reach \
(ProtectHome=yes, and other users cannot read it): use a system Python, e.g. PYTHON=/usr/bin/python3" ;;
    esac
    "$python" -c 'import ensurepip, venv' 2>/dev/null \
        || die "$python cannot create venvs (on Debian/Ubuntu: apt-get install python3-venv)"
fi

# --- 1. the system user ---------------------------------------------------------------

if "$getent" passwd "$user" >/dev/null; then
    say user "$user exists"
else
    if "$getent" group "$user" >/dev/null; then
        group_args=(--gid "$user")
    else
        group_args=(--user-group)
    fi
    nologin="$(command -v nologin || echo /usr/sbin/nologin)"
    step user "created system user $user (group $user, no login shell, no home)" \
        "create system user $user (group $user, no login shell, no home)" \
        "$useradd" --system "${group_args[@]}" --no-create-home --home-dir /nonexistent \
        --shell "$nologin" --comment "sfcore-ai inference daemon" "$user"
fi

# --- 2. the configuration ---------------------------------------------------------------

install_config() {
    install -d -m 0755 "$etc"
    install -m 0644 "$repo/server_config.toml" "$config"
}
if [ -e "$config" ]; then
    if cmp -s "$config" "$repo/server_config.toml"; then
        say config "$config kept (the same as the repository's)"
    else
        say config "$config kept: yours, never overwritten (the repository's: $repo/server_config.toml)"
    fi
else
    step config "installed $config (the repository's server_config.toml)" \
        "install $config (the repository's server_config.toml)" install_config
fi

# --- 3. the venv ------------------------------------------------------------------------

# What the venv was installed from: the Python version and every file pip reads.
source_fingerprint() {
    (
        cd "$repo"
        printf 'python %s\n' "$py_version"
        # The llama-cpp-python build this machine needs (its CPU, the patches).
        printf 'llama %s\n' "$("$venv/bin/python" scripts/llama_wheel.py --python "$venv/bin/python" --key 2>/dev/null)"
        find pyproject.toml README.md sfcore_daemon clients/python scripts/llama_wheel.py \
            scripts/llama-patches -type f \
            \( -name '*.py' -o -name '*.toml' -o -name '*.md' -o -name py.typed \
               -o -name '*.patch' \) \
            -not -path '*/__pycache__/*' -not -path '*.egg-info/*' -not -path '*/build/*' \
            -not -path '*/dist/*' -print0 \
            | LC_ALL=C sort -z | xargs -0 sha256sum
    ) | sha256sum | cut -d' ' -f1
}

install_package() {
    local stage
    stage="$(mktemp -d)"
    # Built from a copy, so that the checkout gets no build/ or egg-info from it.
    mkdir -p "$stage/daemon" "$stage/client"
    tar -C "$repo" --exclude=__pycache__ --exclude='*.egg-info' -cf - \
        pyproject.toml README.md sfcore_daemon | tar -C "$stage/daemon" -xf -
    tar -C "$repo/clients/python" --exclude=__pycache__ --exclude='*.egg-info' \
        --exclude=./build --exclude=./dist -cf - . \
        | tar -C "$stage/client" -xf -
    # llama-cpp-python: this machine's wheel (patched, keyed by its CPU; built once,
    # scripts/llama_wheel.py), so that pip below finds the pinned version installed.
    local folder wheel
    folder="$("$venv/bin/python" "$repo/scripts/llama_wheel.py" --python "$venv/bin/python" --key)" \
        || die "cannot tell which llama-cpp-python build this machine needs (see above)"
    wheel="$("$venv/bin/python" "$repo/scripts/llama_wheel.py" --python "$venv/bin/python")" \
        || die "could not build llama-cpp-python (see above)"
    if ! grep -qsF "$folder/" "$venv"/lib/python3*/site-packages/llama_cpp_python-*.dist-info/direct_url.json; then
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
            --force-reinstall --no-deps "$wheel" || die "pip could not install $wheel"
    fi
    if ! env -u PIP_NO_CACHE_DIR \
            CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
            "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
            "$stage/daemon" "$stage/client"; then
        rm -rf "$stage"
        die "pip could not install sfcore-ai into $venv (see above)"
    fi
    rm -rf "$stage"
    # -I and cd /: import the installed package, never a checkout in the current directory.
    if ! (cd / && "$runuser" -u "$user" -- "$venv/bin/python" -I -c 'import sfcore_daemon.cli') 2>/dev/null; then
        die "the user $user cannot run $venv/bin/python (are $prefix and $python readable by all?)"
    fi
    printf '%s\n' "$fingerprint" > "$venv/.sfcore-source"
}

if [ "$venv_step" = 1 ]; then
    if [ -x "$venv/bin/python" ]; then
        say venv "$venv exists"
    else
        step venv "created $venv (Python $py_version, $python)" \
            "create $venv (Python $py_version, $python)" "$python" -m venv "$venv"
    fi
    version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml" | head -n 1)"
    fingerprint="$(source_fingerprint)"
    if [ -f "$venv/.sfcore-source" ] && [ "$(cat "$venv/.sfcore-source")" = "$fingerprint" ]; then
        say package "sfcore-ai $version in $venv is the same as this checkout"
    else
        code_changed=1
        step package "installed sfcore-ai $version and sfcore-client from $repo into $venv" \
            "install sfcore-ai $version and sfcore-client from $repo into $venv with pip \
(llama-cpp-python from this machine's wheel in ~/.cache/sfcore-ai/wheels; without one it compiles for minutes)" \
            install_package
    fi
else
    say venv "$venv left alone (--no-venv)"
fi

# --- 4. the unit files --------------------------------------------------------------------

rendered="$(mktemp -d)"
trap 'rm -rf "$rendered"' EXIT
for unit in sfcore-ai.service sfcore-ai.socket; do
    # The units name /opt/sfcore-ai and /etc/sfcore-ai: point them at the real places.
    sed -e "s#/opt/sfcore-ai#$prefix#g" -e "s#/etc/sfcore-ai#$etc#g" \
        "$repo/systemd/$unit" > "$rendered/$unit"
    installed="$unit_dir/$unit"
    if [ -f "$installed" ] && cmp -s "$installed" "$rendered/$unit"; then
        say unit "$installed is up to date"
        continue
    fi
    units_changed=1
    if [ -e "$installed" ]; then
        step unit "updated $installed (keep local changes in drop-ins: systemctl edit $unit)" \
            "update $installed" install -D -m 0644 "$rendered/$unit" "$installed"
    else
        step unit "installed $installed" "install $installed" \
            install -D -m 0644 "$rendered/$unit" "$installed"
    fi
done
if [ "$units_changed" = 1 ]; then
    step systemd "ran systemctl daemon-reload" "run systemctl daemon-reload" \
        "$systemctl" daemon-reload
fi

# --- 5. enable, start -------------------------------------------------------------------

if "$systemctl" is-enabled --quiet "$target" 2>/dev/null; then
    say enable "$target is enabled"
else
    step enable "enabled $target" "enable $target" "$systemctl" enable --quiet "$target"
fi

service_active=0
"$systemctl" is-active --quiet "$service" 2>/dev/null && service_active=1
out_of_date=0
[ "$service_active" = 1 ] && [ $((units_changed + code_changed)) -gt 0 ] && out_of_date=1
if [ "$now" = 1 ]; then
    if [ "$target" != "$service" ] && ! "$systemctl" is-active --quiet "$target" 2>/dev/null; then
        step start "started $target" "start $target" "$systemctl" start "$target"
    elif [ "$target" = "$service" ] && [ "$service_active" = 0 ]; then
        step start "started $service" "start $service" "$systemctl" start "$service"
    elif [ "$target" != "$service" ]; then
        say start "$target is active"
    fi
    if [ "$out_of_date" = 1 ]; then
        step restart "restarted $service (its files changed)" \
            "restart $service (its files changed)" "$systemctl" try-restart "$service"
    elif [ "$service_active" = 1 ]; then
        say start "$service is active"
    fi
elif [ "$out_of_date" = 1 ]; then
    say note "$service is running the previous version: systemctl restart $service"
fi

if [ "$changed" = 0 ]; then
    say "done" "nothing to do: sfcore-ai is installed and up to date"
elif [ "$dry_run" = 1 ]; then
    say "done" "dry run: nothing was changed"
else
    say "done" "check it with: systemctl status sfcore-ai; journalctl -u sfcore-ai -f"
fi
