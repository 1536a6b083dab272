#!/usr/bin/env bash
# Build the Linux bundle and .deb of SpecMemo Chat from a clone, install it, and check it:
#
#   SPECMEMO_DATA_DIR=/tmp/specmemo-test-data bash packaging/build_linux.sh
#
# 1. build venv (torch first: CPU build by default), `pip install .`, PyInstaller
# 2. one-folder bundle  -> build/installer/dist/specmemo-chat/
# 3. .deb (dpkg-deb)    -> build/installer/specmemo-chat_<version>_amd64.deb
#    /opt/specmemo-chat, /usr/bin/specmemo-chat, desktop entry, hicolor icons
# 4. dpkg -i; the installed `specmemo-chat --self-test`; a screenshot of the installed
#    app's window under Xvfb -> docs/installer/installed_app.png
# 5. dpkg -r leaves the user data folder; checked, then the .deb is installed again
# 6. sizes -> docs/installer/sizes.json
#
# Environment:
#   TORCH_SPEC (torch==2.13.0)  TORCH_INDEX_URL (unset: the default index; a CUDA/ROCm wheel index
#   for the GPU variant, see packaging/README.md)   BUILD_DIR (build/installer)
#   SPECMEMO_DATA_DIR: data folder for the installed self-test and screenshot; unset, the
#   installed app downloads the default model (~93 MB from PyPI) into a fresh folder.
#   SKIP_INSTALL=1: stop after building the .deb (no root needed).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD="${BUILD_DIR:-$ROOT/build/installer}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
NICE=(nice -n 10)
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml" | head -1)"
ARCH="$(dpkg --print-architecture 2>/dev/null || echo amd64)"
DEB="$BUILD/specmemo-chat_${VERSION}_${ARCH}.deb"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
step() { printf '\n== %s (%s)\n' "$*" "$(date +%T)"; }

mkdir -p "$BUILD"
cd "$ROOT"

step "build venv"
if [ ! -x "$BUILD/venv/bin/python" ]; then
    python3 -m venv "$BUILD/venv"
fi
PY="$BUILD/venv/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "$TORCH_SPEC" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"$PY" -m pip install -q . "pyinstaller>=6.10,<7" certifi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'hip', torch.version.hip)"

step "PyInstaller bundle"
"${NICE[@]}" "$PY" -m PyInstaller --noconfirm --log-level WARN \
    --distpath "$BUILD/dist" --workpath "$BUILD/pyi" packaging/specmemo-chat.spec
BUNDLE="$BUILD/dist/specmemo-chat"
"$BUNDLE/specmemo-chat" --help >/dev/null
# entry.py answers -c like Python: import what a chat needs, before packaging
"$BUNDLE/specmemo-chat" -c "import numpy, torch, transformers, tokenizers, gguf, safetensors, PySide6.QtWidgets
from transformers import AutoTokenizer, LlamaConfig
import specmemo_core.runtime.engine, app.main_window
print('bundle imports ok: torch', torch.__version__)"
echo "bundle: $BUNDLE"

step ".deb"
PKG="$BUILD/deb/specmemo-chat"
rm -rf "$PKG"
mkdir -p "$PKG/DEBIAN" "$PKG/opt" "$PKG/usr/bin" "$PKG/usr/share/applications" \
    "$PKG/usr/share/icons/hicolor/256x256/apps" "$PKG/usr/share/icons/hicolor/scalable/apps"
cp -a "$BUNDLE" "$PKG/opt/specmemo-chat"
ln -s /opt/specmemo-chat/specmemo-chat "$PKG/usr/bin/specmemo-chat"
install -m 644 packaging/linux/specmemo-chat.desktop "$PKG/usr/share/applications/"
install -m 644 assets/icons/specmemo-chat.png "$PKG/usr/share/icons/hicolor/256x256/apps/"
install -m 644 assets/icons/specmemo-chat.svg "$PKG/usr/share/icons/hicolor/scalable/apps/"
cat > "$PKG/DEBIAN/control" <<EOF
Package: specmemo-chat
Version: $VERSION
Architecture: $ARCH
Maintainer: SpecMemo Chat <specmemo@localhost>
Section: utils
Priority: optional
Installed-Size: $(du -sk --apparent-size "$PKG" | cut -f1)
Depends: libc6 (>= 2.28), libgl1, libegl1, libfontconfig1, libxkbcommon0, libxkbcommon-x11-0, libxcb-cursor0, libdbus-1-3
Description: Offline desktop chat with a local LLM
 SpecMemo Chat runs a small language model on this computer, sped up by draft
 heads and tree verification, planned to fit the device's memory. The default
 model is downloaded from PyPI on first start. User data (chats, models,
 settings) lives in ~/.local/share/specmemo and is kept when the package is removed.
EOF
for script in postinst postrm; do
    cat > "$PKG/DEBIAN/$script" <<'EOF'
#!/bin/sh
set -e
# User data in ~/.local/share/specmemo is never touched here.
command -v update-desktop-database >/dev/null 2>&1 && update-desktop-database -q /usr/share/applications || true
command -v gtk-update-icon-cache >/dev/null 2>&1 && gtk-update-icon-cache -q -t /usr/share/icons/hicolor || true
exit 0
EOF
    chmod 755 "$PKG/DEBIAN/$script"
done
"${NICE[@]}" dpkg-deb --root-owner-group -Zzstd -z9 --build "$PKG" "$DEB"
dpkg-deb --info "$DEB" | sed -n '1,12p'

BUNDLE_BYTES="$(du -sb "$BUNDLE" | cut -f1)"
DEB_BYTES="$(stat -c %s "$DEB")"
mib() { awk -v b="$1" 'BEGIN { printf "%.0f MiB", b / 1048576 }'; }
echo "bundle $(mib "$BUNDLE_BYTES"), .deb $(mib "$DEB_BYTES")"
if [ "${SKIP_INSTALL:-0}" = 1 ]; then
    exit 0
fi

step "dpkg -i"
$SUDO dpkg -i "$DEB"
INSTALLED=/usr/bin/specmemo-chat
[ "$(readlink -f "$INSTALLED")" = /opt/specmemo-chat/specmemo-chat ]
DATA="${SPECMEMO_DATA_DIR:-$BUILD/first-start-data}"
export SPECMEMO_DATA_DIR="$DATA"
echo "data folder: $SPECMEMO_DATA_DIR"

step "installed self-test"
# Run from / with a clean environment: no repo, no venv, no system Python on the path.
SELF_TEST="$(cd / && env -i HOME="$HOME" PATH=/usr/bin:/bin SPECMEMO_DATA_DIR="$DATA" \
    "$INSTALLED" --self-test --threads 2)"
echo "$SELF_TEST"

step "installed app window under Xvfb"
SHOT="$ROOT/docs/installer/installed_app.png"
mkdir -p "$(dirname "$SHOT")"
rm -f "$SHOT"
(cd / && env -i HOME="$HOME" PATH=/usr/bin:/bin SPECMEMO_DATA_DIR="$DATA" \
    xvfb-run -a -s "-screen 0 1280x800x24" "$INSTALLED" --screenshot "$SHOT" \
    --history "$BUILD/screenshot-history.sqlite3")
[ -s "$SHOT" ]
echo "screenshot: $SHOT"

step "dpkg -r keeps user data"
$SUDO dpkg -r specmemo-chat
[ ! -e /opt/specmemo-chat ] && [ ! -e "$INSTALLED" ] && echo "removed /opt/specmemo-chat and $INSTALLED"
ls "$DATA/models/"*.gguf >/dev/null
echo "user data kept: $DATA ($(du -sh "$DATA" | cut -f1))"
$SUDO dpkg -i "$DEB" >/dev/null
echo "installed again: $DEB"

step "sizes"
INSTALLED_BYTES="$(du -sb /opt/specmemo-chat | cut -f1)"
SELF_TEST="$SELF_TEST" "$PY" - "$ROOT/docs/installer/sizes.json" <<EOF
import json, os, sys, torch
sizes = {"version": "$VERSION", "torch": torch.__version__, "bundle_bytes": $BUNDLE_BYTES, "deb_bytes": $DEB_BYTES,
         "installed_bytes": $INSTALLED_BYTES, "deb_compression": "zstd -9", "self_test": os.environ["SELF_TEST"]}
open(sys.argv[1], "w").write(json.dumps(sizes, indent=2) + "\n")
EOF
cat "$ROOT/docs/installer/sizes.json"
echo "bundle $(mib "$BUNDLE_BYTES"), .deb $(mib "$DEB_BYTES"), installed $(mib "$INSTALLED_BYTES")"
