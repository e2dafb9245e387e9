#!/bin/sh
# make arm64-env: an arm64 (aarch64) Debian bookworm root under .arm64/root, run by qemu-user through binfmt_misc, with
# a venv (.arm64/root/opt/venv) holding the aarch64 wheels of what running an edgekv artifact needs, at the versions
# of requirements.lock. Idempotent: every stage is skipped when its result is already there. Needs root (apt-get,
# mount, chroot) and a kernel with binfmt_misc. edgekv/profile/arm64.py runs artifacts in this root.
set -eu

HERE=$(cd "$(dirname "$0")/.." && pwd)
ARM=${EDGEKV_ARM64_DIR:-$HERE/.arm64}
ROOT=$ARM/root
VENV=/opt/venv                       # inside ROOT
LOCK=$HERE/requirements.lock
# What the runner (python -m edgekv.profile.arm64_child) imports, in two stages, each with its own stamp, so that ONNX
# Runtime runs even where the second cannot be installed. Every package pip pulls in is pinned by requirements.lock,
# given as constraints.
# Stage 1: ONNX Runtime and the tensor libraries (~50 MB).
ORT_PKGS="numpy onnxruntime tokenizers safetensors"
# Stage 2: ExecuTorch's runtime. PyPI's torch aarch64 wheel is the CUDA build: with it pip pulls ~3 GB of nvidia-* wheels,
# which `import torch` loads though a CPU run never uses them. executorch goes in without its dependency list
# (NODEPS): that list names coremltools (Apple Core ML lowering, not the runtime), which publishes no aarch64 Linux
# wheel; the runtime's own imports (torch, flatbuffers, tabulate, ruamel.yaml, PyYAML, packaging, as `import
# executorch.runtime` and its LLM/quantized kernels need) are listed instead.
ET_PKGS="torch torchao flatbuffers tabulate ruamel.yaml PyYAML packaging"
NODEPS="executorch"

die() { echo "make arm64-env: $*" >&2; exit 2; }

[ "$(id -u)" = 0 ] || die "needs root (apt-get, mount, chroot); run it as root"
[ "$(uname -m)" = x86_64 ] || [ "$(uname -m)" = aarch64 ] || die "host $(uname -m) is not x86_64 or aarch64"
command -v apt-get >/dev/null || die "needs a Debian-family host (apt-get) for qemu-user-static and debootstrap"

# 1. host packages
missing=""
for p in qemu-user-static binfmt-support debootstrap; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $p"
done
if [ -n "$missing" ]; then
    echo "arm64-env: apt-get install$missing"
    apt-get -o DPkg::Lock::Timeout=900 update -q >/dev/null || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 install -y -q --no-install-recommends $missing >/dev/null \
        || die "apt-get install$missing failed"
fi

# 2. binfmt_misc with qemu-aarch64 (not needed on an aarch64 host)
if [ "$(uname -m)" = x86_64 ]; then
    if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
        grep -qw binfmt_misc /proc/filesystems || modprobe binfmt_misc 2>/dev/null || true
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null \
            || die "cannot mount binfmt_misc (kernel without it, or a container without the privilege)"
    fi
    if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
        update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || update-binfmts --import qemu-aarch64 >/dev/null 2>&1 || true
    fi
    [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || die "binfmt_misc has no qemu-aarch64 entry (update-binfmts failed)"
    grep -q '^flags:.*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 \
        || die "qemu-aarch64 is registered without the F (fix-binary) flag; a chroot cannot find the interpreter"
fi

# 3. the Debian root, from the mirror this host's apt uses
mirror() {
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] && awk '$1=="deb" && $0 ~ / bookworm / {for(i=2;i<=NF;i++) if ($i ~ /^(https?|file):/) {print $i; exit}}' "$f"
    done
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] && awk 'BEGIN{RS=""} /Suites:[^\n]*bookworm([ \n]|$)/ && !/Suites:[^\n]*bookworm-security/ {
            if (match($0, /URIs: *[^ \n]+/)) {s=substr($0, RSTART, RLENGTH); sub(/URIs: */, "", s); print s; exit}}' "$f"
    done
}
if [ ! -x "$ROOT/usr/bin/python3" ]; then
    MIRROR=$(mirror | head -n 1)
    [ -n "$MIRROR" ] || MIRROR=http://deb.debian.org/debian
    echo "arm64-env: debootstrap arm64 bookworm from $MIRROR into $ROOT (a few minutes)"
    rm -rf "$ROOT"
    mkdir -p "$ARM"
    debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$ROOT.partial" "$MIRROR" >"$ARM/debootstrap.log" 2>&1 \
        || { rm -rf "$ROOT.partial"; die "debootstrap failed (log: $ARM/debootstrap.log)"; }
    mv "$ROOT.partial" "$ROOT"
fi

# 4. pip's trust and configuration from the host (a host behind its own CA or index needs them inside too)
for f in /etc/ssl/certs/ca-certificates.crt /etc/pip.conf /etc/xdg/pip/pip.conf /etc/xdg/pip/constraints.txt \
         /etc/resolv.conf /etc/hosts; do
    [ -f "$f" ] && { mkdir -p "$ROOT$(dirname "$f")"; cp -L "$f" "$ROOT$f"; }
done
for v in ${PIP_CERT:-} ${REQUESTS_CA_BUNDLE:-} ${SSL_CERT_FILE:-}; do
    [ -f "$v" ] && { mkdir -p "$ROOT$(dirname "$v")"; cp -L "$v" "$ROOT$v"; }
done
cp "$LOCK" "$ROOT/opt/requirements.lock"

# 5. the CPU list that cpuinfo (ONNX Runtime, XNNPACK) reads: /sys/devices/system/cpu/{possible,present,online}
# and one cpuN folder per core, written into the root's own /sys (the host's /sys is never bound: its x86 entries
# crash ONNX Runtime's cpuinfo at import). Without it cpuinfo fails, ONNX Runtime falls back to its baseline
# kernels and XNNPACK refuses to start (status 5, unsupported hardware), so no .pte runs. The CPU features
# themselves come from the HWCAP bits of the core qemu emulates.
CPUS=$ROOT/sys/devices/system/cpu
mkdir -p "$CPUS"
N=$(nproc)
echo "0-$((N - 1))" > "$CPUS/possible"
cp "$CPUS/possible" "$CPUS/present"
cp "$CPUS/possible" "$CPUS/online"
for i in $(seq 0 $((N - 1))); do mkdir -p "$CPUS/cpu$i"; done

# 6. the venv with the pinned aarch64 wheels; /proc and /dev bound in a private mount namespace (they vanish with it);
# the host's /sys is NOT bound: ONNX Runtime's cpuinfo reads the x86 host's /sys/devices/system/cpu and crashes.
in_root() {
    env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
        $(env | grep -E '^(PIP_[A-Z_]+|https?_proxy|HTTPS?_PROXY|no_proxy|NO_PROXY|SSL_CERT_FILE|REQUESTS_CA_BUNDLE)=' \
          | grep -v '^PIP_FIND_LINKS=') \
        unshare --mount --propagation private sh -c \
        'mount --bind /proc "$0/proc" && mount --rbind /dev "$0/dev" && exec chroot "$0" "$@"' "$ROOT" "$@"
}
pin() { for p in "$@"; do grep -i -E "^$p==" "$LOCK" || { echo "requirements.lock has no pin for $p" >&2; echo "$p==?"; }; done; }
pip_in_root() { in_root "$VENV/bin/python" -m pip install -q --only-binary=:all: -c /opt/requirements.lock "$@"; }
[ -x "$ROOT$VENV/bin/python" ] || in_root python3 -m venv "$VENV"
STAMP=$ROOT$VENV/.installed
if [ ! -f "$STAMP" ] || ! cmp -s "$LOCK" "$ROOT$VENV/.lock"; then
    rm -f "$STAMP" "$ROOT$VENV/.installed-executorch"
    echo "arm64-env: venv, stage 1: $ORT_PKGS (aarch64 wheels pinned by requirements.lock)"
    # shellcheck disable=SC2046
    pip_in_root $(pin $ORT_PKGS) || die "pip install in the arm64 root failed (see above)"
    in_root "$VENV/bin/python" -c 'import onnxruntime; print("arm64-env: onnxruntime", onnxruntime.__version__)' \
        || die "onnxruntime does not import in the arm64 root"
    cp "$LOCK" "$ROOT$VENV/.lock"
    touch "$STAMP"
fi
if [ ! -f "$ROOT$VENV/.installed-executorch" ]; then
    # fetched and unpacked by the host's own pip for the root's platform (--platform/--target): under emulation pip's
    # TLS and unzip ran at ~1 MB/s on a busy 2-core host, 45+ min for these 3 GB
    HOSTPY=""
    for py in /usr/bin/python3 python3; do
        command -v "$py" >/dev/null && "$py" -m pip --version >/dev/null 2>&1 && { HOSTPY=$py; break; }
    done
    if [ -z "$HOSTPY" ]; then
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 install -y -q --no-install-recommends \
            python3-pip >/dev/null || die "apt-get install python3-pip failed"
        HOSTPY=/usr/bin/python3
    fi
    SITE=$(ls -d "$ROOT$VENV"/lib/python3.*/site-packages | head -n 1)
    PYV=$(basename "$(dirname "$SITE")" | sed 's/^python//')
    ABI=cp$(echo "$PYV" | tr -d .)
    echo "arm64-env: venv, stage 2: $ET_PKGS $NODEPS (PyPI's aarch64 torch is the CUDA build: ~3 GB to fetch)"
    GLIBC=$(ls "$ROOT"/usr/lib/aarch64-linux-gnu/libc.so.6 >/dev/null && in_root ldd --version | head -n 1 | sed 's/.* 2\.//')
    PLATFORMS="--platform manylinux2014_aarch64 --platform linux_aarch64"
    for v in $(seq 17 "${GLIBC:-36}"); do PLATFORMS="$PLATFORMS --platform manylinux_2_${v}_aarch64"; done
    host_pip() {
        "$HOSTPY" -m pip install -q --upgrade --only-binary=:all: --implementation cp --python-version "$PYV" \
            --abi "$ABI" --abi abi3 --abi none $PLATFORMS --target "$SITE" -c "$LOCK" "$@"
    }
    # shellcheck disable=SC2046
    host_pip $(pin $ET_PKGS) || die "pip install of ExecuTorch's runtime into the arm64 root failed (see above)"
    # shellcheck disable=SC2046
    host_pip --no-deps $(pin $NODEPS) || die "pip install --no-deps $NODEPS into the arm64 root failed (see above)"
    rm -rf "$SITE/bin"  # console scripts written for the host's python: nothing here runs them
    in_root "$VENV/bin/python" -c 'from executorch.extension.pybindings import portable_lib; print("arm64-env: executorch runtime ok")' \
        || die "the ExecuTorch runtime does not import in the arm64 root"
    touch "$ROOT$VENV/.installed-executorch"
fi
echo "arm64-env: ready: $ROOT (python $(in_root "$VENV/bin/python" -c 'import platform; print(platform.machine(), platform.python_version())'))"
