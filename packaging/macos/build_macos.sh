#!/usr/bin/env bash
# macOS: SpecMemo Chat.app and a drag-to-Applications .dmg (not run on the Linux build machine;
# .github/workflows/installers.yml runs it on a macOS runner).
#
#   bash packaging/macos/build_macos.sh
#
# torch from PyPI on macOS arm64 has MPS (Apple GPU) support built in; no separate GPU variant.
# Unsigned: Gatekeeper asks on first open (right-click → Open). To sign and notarize, set
# CODESIGN_IDENTITY (and run `xcrun notarytool submit ... --wait` on the .dmg).
# User data lives in ~/Library/Application Support/specmemo; dragging the app to the
# Trash leaves it.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BUILD="${BUILD_DIR:-$ROOT/build/installer}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml" | head -1)"
cd "$ROOT"

python3 -m venv "$BUILD/venv"
PY="$BUILD/venv/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "$TORCH_SPEC"
"$PY" -m pip install -q . "pyinstaller>=6.10,<7" certifi

"$PY" -m PyInstaller --noconfirm --log-level WARN \
    --distpath "$BUILD/dist" --workpath "$BUILD/pyi" packaging/specmemo-chat.spec
APP="$BUILD/dist/SpecMemo Chat.app"
"$APP/Contents/MacOS/specmemo-chat" --help >/dev/null

if [ -n "${CODESIGN_IDENTITY:-}" ]; then
    codesign --deep --force --options runtime --sign "$CODESIGN_IDENTITY" "$APP"
fi

STAGE="$BUILD/dmg"
rm -rf "$STAGE" && mkdir -p "$STAGE"
cp -R "$APP" "$STAGE/"
ln -s /Applications "$STAGE/Applications"
DMG="$BUILD/SpecMemoChat-$VERSION-macos-$(uname -m).dmg"
rm -f "$DMG"
hdiutil create -volname "SpecMemo Chat" -srcfolder "$STAGE" -ov -format UDZO "$DMG"
echo "app $(du -sh "$APP" | cut -f1), dmg $(du -sh "$DMG" | cut -f1): $DMG"

# Smoke test of the bundled app without a window (needs the default model: downloaded on first run).
if [ "${SELF_TEST:-1}" = 1 ]; then
    "$APP/Contents/MacOS/specmemo-chat" --self-test
fi
