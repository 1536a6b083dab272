"""Render assets/icons/specmemo-chat.svg to the PNG (Linux), ICO (Windows) and ICNS (macOS) icons.

    QT_QPA_PLATFORM=offscreen python packaging/make_icons.py
"""

import struct
from pathlib import Path

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, Qt
from PySide6.QtGui import QGuiApplication, QImage, QPainter
from PySide6.QtSvg import QSvgRenderer

ICONS = Path(__file__).resolve().parents[1] / "assets" / "icons"
ICO_SIZES = (16, 32, 48, 256)


def render(size: int) -> QImage:
    image = QImage(size, size, QImage.Format.Format_ARGB32)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    QSvgRenderer(str(ICONS / "specmemo-chat.svg")).render(painter)
    painter.end()
    return image


def png_bytes(image: QImage) -> bytes:
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buffer, "PNG")
    return bytes(data)


def write_ico(path: Path) -> None:
    """ICO with PNG-compressed entries (Windows Vista and later read them)."""
    pngs = [png_bytes(render(s)) for s in ICO_SIZES]
    header = struct.pack("<HHH", 0, 1, len(pngs))
    offset, entries = 6 + 16 * len(pngs), b""
    for size, data in zip(ICO_SIZES, pngs):
        entries += struct.pack("<BBBBHHII", size % 256, size % 256, 0, 0, 1, 32, len(data), offset)
        offset += len(data)
    path.write_bytes(header + entries + b"".join(pngs))


def main() -> None:
    app = QGuiApplication([])  # noqa: F841 - QPainter needs it
    render(256).save(str(ICONS / "specmemo-chat.png"))
    write_ico(ICONS / "specmemo-chat.ico")
    render(512).save(str(ICONS / "specmemo-chat.icns"))
    print("wrote", *(p.name for p in sorted(ICONS.glob("specmemo-chat.*"))))


if __name__ == "__main__":
    main()
