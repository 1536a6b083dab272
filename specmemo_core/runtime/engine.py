"""Assembles a ready-to-chat engine: weights → our forward, draft heads, tree, sessions."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any, Callable

import torch

from specmemo_core.runtime.chat import ChatSession, end_of_turn_ids
from specmemo_core.runtime.cpu_linear import pack_linears
from specmemo_core.runtime.decoding import Decoder
from specmemo_core.errors import OffloadError, SpecMemoError, SplitError, TreeError
from specmemo_core.runtime.calibration import load_calibration, tree_from_calibration
from specmemo_core.runtime.heads import DraftHeads, load_heads, random_heads
from specmemo_core.runtime.model import CausalLM, ModelSpec
from specmemo_core.runtime.model_build import build_model
from specmemo_core.runtime.offload import offload_layers
from specmemo_core.runtime.split import LayerSplit, split_model
from specmemo_core.storage.sources import LoadedModel, ModelIdentity, OpenedModel, open_model
from specmemo_core.runtime.tree import Tree, load_tree, split_lookup

ASSETS_DIR = Path(__file__).resolve().parents[2] / "assets"
BACKENDS = ("torch", "native", "llamacpp")  # the base model's forward: ours in torch, ours in C (native/lm.py),
# or llama.cpp's (ggml_step.py)
DEFAULT_CAPACITY = 4096


def _built(opened: "LoadedModel | OpenedModel", *, precision: str | None, dtype: torch.dtype, device: torch.device,
           split: LayerSplit | None, progress: Callable[[str, float], None] | None) -> CausalLM:
    """The model at its precision (``model_build.build_model``); a split one is placed in
    float first, then each layer quantized on its own device, as an unsplit one is."""
    if split is None:
        lm = build_model(opened, precision=precision, dtype=dtype, device=device, progress=progress)
    else:
        lm = build_model(opened, precision=None, dtype=dtype, device=torch.device("cpu"), progress=progress)
        split_model(lm, split)
        if precision in ("int8", "int4"):
            from specmemo_core.runtime.quantize import QuantSpec, quantize_model

            if progress is not None:
                progress(f"quantizing to {precision}", 0.0)
            quantize_model(lm, QuantSpec(precision))
    if not isinstance(opened, LoadedModel):
        opened.finished(progress)
    return lm


def resolve_tree(spec: str | Path, heads_folder: Path | None) -> Tree:
    """A tree by name or file; ``calibrated-N`` builds the best N-node tree from the
    heads' calibration file (``calibrated`` alone: 64 nodes); ``+lookup-N`` adds a lookup
    chain to either."""
    name = str(spec)
    if not isinstance(spec, Path) and (parts := split_lookup(name)) and parts[0]:
        return resolve_tree(parts[0], heads_folder).with_lookup(parts[1])
    if name.startswith("calibrated"):
        record = load_calibration(heads_folder) if heads_folder is not None else None
        if record is None:
            raise TreeError(
                f"tree {name} needs the heads' calibration.json; run `specmemo calibrate --heads DIR` "
                f"or choose a named tree such as medusa-64"
            )
        size = name.split("-", 1)[1] if "-" in name else "64"
        if not size.isdigit() or int(size) < 2:
            raise TreeError(f"tree {name}: write calibrated-N with N a whole number of nodes ≥ 2, e.g. calibrated-16")
        return tree_from_calibration(record, int(size))
    return load_tree(spec)


class HeadsChoice(Enum):
    """Which draft heads to load, when not a file or folder of heads."""

    SHIPPED = "auto"  # heads trained here for this model, else those shipped under assets/heads/, else none
    NONE = "none"
    RANDOM = "random"  # random weights, 5 heads: output unchanged, only slower (checks exactness)


HeadsSource = HeadsChoice | Path


def heads_source(value: "str | Path | HeadsChoice | None") -> HeadsSource:
    """Read the user's heads option (``auto``, ``none``, ``random`` or a path) once, at the edge."""
    if isinstance(value, (HeadsChoice, Path)):
        return value
    if value is None:
        return HeadsChoice.NONE
    try:
        return HeadsChoice(value)
    except ValueError:
        return Path(value).expanduser()


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def shipped_heads_dir(identity: ModelIdentity) -> Path | None:
    """Trained heads shipped under ``assets/heads/<model name>/``, if any."""
    folder = ASSETS_DIR / "heads" / identity.name
    return folder if (folder / "heads.safetensors").exists() else None


def default_heads_dir(identity: ModelIdentity) -> Path | None:
    """The heads ``HeadsChoice.SHIPPED`` loads: those trained on this computer for this very
    model (``storage/trained_heads.py``), else those shipped with the app, else none."""
    from specmemo_core.storage.data_folder import data_dir
    from specmemo_core.storage.trained_heads import finished, trained_heads_dir

    trained = trained_heads_dir(data_dir(), identity.name, identity.fingerprint)
    return trained if finished(trained) else shipped_heads_dir(identity)


def _set_for_device(lm: CausalLM, draft: "DraftHeads | None", device: torch.device, precision: str | None) -> None:
    """The weights in the form they run in: on a CPU packed for oneDNN (``cpu_linear.py``); on a
    GPU, launch-bound, one matmul for q/k/v and one for gate/up, the heads' context layer's too."""
    if device.type == "cpu":
        pack_linears(lm, int8_head=precision == "int4")
        if draft is not None:
            pack_linears(draft)
        return
    lm.fuse_projections()
    if draft is not None and draft.context is not None:
        draft.context.fuse()


def load_draft_heads(source: HeadsSource, spec: ModelSpec, identity: ModelIdentity, dtype: torch.dtype,
                     device: str | torch.device) -> tuple[DraftHeads | None, Path | None]:
    """The draft heads ``source`` names for the model of ``spec``, and the folder they came from."""
    if source is HeadsChoice.NONE:
        return None, None
    if source is HeadsChoice.RANDOM:
        heads = random_heads(5, spec.hidden_size, spec.vocab_size, base_name=identity.name,
                             base_fingerprint=identity.fingerprint)
        return heads.to(device=device, dtype=dtype), None
    folder = default_heads_dir(identity) if source is HeadsChoice.SHIPPED else (
        source if source.is_dir() else source.parent)
    if folder is None:
        return None, None
    path = folder if source is HeadsChoice.SHIPPED else source
    return load_heads(path, spec.hidden_size, spec.vocab_size, identity.fingerprint, dtype, device), folder


@dataclass
class Engine:
    model: CausalLM
    tokenizer: Any
    config: Any
    identity: ModelIdentity
    heads: DraftHeads | None
    tree: Tree | None
    heads_folder: Path | None = None  # where the heads (and their calibration.json) came from
    precision: str = "fp32"  # what the weights run in: fp32, bf16, fp16, int8 or int4
    capture_stream: Any = field(default=None, repr=False)  # made by graph_capture_stream()
    backend: str = "torch"  # what runs the base model's forward: ours ("torch") or llama.cpp's (``BACKENDS``)

    @classmethod
    def load(
        cls,
        model: str | Path | LoadedModel = "default",
        *,
        heads: "HeadsSource | str | None" = HeadsChoice.SHIPPED,
        tree: str | Path | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        progress: Callable[[str, float], None] | None = None,
        precision: str | None = None,
        resident_layers: int | None = None,
        split: "LayerSplit | None" = None,
        backend: str = "torch",
    ) -> "Engine":
        """``model``: a source or a model file opened (``storage.sources.open_model``), streamed
        a tensor at a time into the model at its precision, or weights already read from one
        (``load_model``).
        ``heads``: a ``HeadsChoice`` or a path (strings are read by ``heads_source``).
        ``tree``: None (plain decoding) or a tree name/file, applied with ``with_tree``; the
        planner's choice comes from ``planning.entry``. ``precision`` "int8" or "int4":
        weight-only quantization of the decoder layers (``quantize.py``). On CPU the fp32
        linear layers are then packed for oneDNN (``cpu_linear.py``): the model is ready for
        inference and can no longer be cast, quantized or trained. ``resident_layers``: keep
        only that many decoder layers on ``device`` and stream the others from host memory
        (``offload.py``; the plan's ``resident_layers``); None: every layer on ``device``.
        ``split``: the decoder layers over several devices (``split.py``; the plan's split);
        ``device`` is then ignored: the heads go to the split's home device. ``backend``
        "native" or "llamacpp": the base model's forward is our C one (``native/lm.py``) or
        llama.cpp's (``ggml_step.py``) over the GGUF's own blocks (CPU, whole, int4), our heads
        and trees around it."""
        opened = model if isinstance(model, (LoadedModel, OpenedModel)) else open_model(model, progress=progress)
        if backend in ("native", "llamacpp"):
            return cls._on_host_forward(opened, backend, heads=heads, tree=tree, device=device, progress=progress,
                                        precision=precision, resident_layers=resident_layers, split=split)
        if backend != "torch":
            raise SpecMemoError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
        streaming = resident_layers is not None
        if split is not None:
            if streaming:
                raise SplitError("a model split over devices cannot also stream layers from host memory yet; "
                                 "plan it on one device, or on devices that hold every layer")
            device = split.home
        if streaming and precision == "int4" and torch.device(device).type != "cpu":
            raise OffloadError("streamed int4 layers would keep torchao's CPU packing; plan bf16 or int8 to offload")
        lm = _built(opened, precision=precision, dtype=dtype, device=torch.device("cpu" if streaming else device),
                    split=split, progress=progress)
        if streaming:
            offload_layers(lm, resident_layers=resident_layers, device=device)
        draft, folder = load_draft_heads(heads_source(heads), lm.spec, opened.identity, dtype, device)
        if draft is not None and draft.spec.draft_vocab:
            draft.use_draft_vocab(lm.lm_head.weight)  # before packing: it copies the LM head's rows
        _set_for_device(lm, draft, torch.device(device), precision)
        name = precision if precision in ("int8", "int4") else _DTYPE_NAMES.get(dtype, str(dtype))
        engine = cls(lm, opened.tokenizer, opened.config, opened.identity, draft, None, folder, name)
        return engine.with_tree(tree)

    @classmethod
    def _on_host_forward(cls, opened: "LoadedModel | OpenedModel", backend: str, *,
                         heads: "HeadsSource | str | None", tree: str | Path | None, device: str | torch.device,
                         progress: Callable[[str, float], None] | None, precision: str | None,
                         resident_layers: int | None, split: "LayerSplit | None") -> "Engine":
        """The engine over a forward outside torch (``host_forward.py``): ours in C
        (``native/lm.py``) or llama.cpp's (``ggml_step.py``), on a GGUF on the CPU, whole, as
        its file stores it (the planner counts it as int4); heads in fp32, packed."""
        from specmemo_core.runtime.ggml_step import load_llamacpp
        from specmemo_core.runtime.native.lm import load_native

        what = {"native": "the native", "llamacpp": "the llama.cpp"}[backend]
        if precision not in (None, "int4"):
            raise SpecMemoError(f"{what} backend runs the file's own 4-bit blocks, not {precision}: "
                                "choose int4 (or auto), or the torch backend for another precision")
        if torch.device(device).type != "cpu" or resident_layers is not None or split is not None:
            raise SpecMemoError(f"{what} backend runs the whole model on the CPU; use the torch backend "
                                "to stream, split or run on a GPU")
        if not isinstance(opened, OpenedModel):
            opened = open_model(opened.source, progress=progress)
        if opened.stored_bits != 4:
            raise SpecMemoError(f"{what} backend runs 4-bit GGUFs (Q4_0, Q4_1, Q4_K, …), whose memory the "
                                f"planner counts as int4; {opened.source.name} is not one: use the torch backend")
        load = load_native if backend == "native" else load_llamacpp
        lm = load(opened, threads=torch.get_num_threads(), progress=progress)
        opened.finished(progress)
        draft, folder = load_draft_heads(heads_source(heads), lm.spec, opened.identity, torch.float32, "cpu")
        if draft is not None and draft.spec.draft_vocab:
            draft.use_draft_vocab(lm.head_weight)
        if draft is not None:
            pack_linears(draft)
        engine = cls(lm, opened.tokenizer, opened.config, opened.identity, draft, None, folder, "int4",
                     backend=backend)
        return engine.with_tree(tree)

    def on_torch(self, progress: Callable[[str, float], None] | None = None) -> "Engine":
        """This engine on our own forward (itself if it runs there): the same file, precision,
        heads and tree, loaded again for what a forward outside torch does not do (batched
        decoding: the server)."""
        if self.backend == "torch":
            return self
        heads: HeadsSource = self.heads_folder or (HeadsChoice.NONE if self.heads is None else HeadsChoice.RANDOM)
        return Engine.load(self.model.path, heads=heads, tree=self.tree.name if self.tree is not None else None,
                           precision=self.precision, progress=progress)

    def with_tree(self, tree: str | Path | None) -> "Engine":
        """The same weights and heads decoding on ``tree`` (None: plainly). Raises
        ``TreeError`` when the loaded heads cannot draft it (``Tree.check_heads``)."""
        if tree is None:
            return replace(self, tree=None) if self.tree is not None else self
        if self.tree is not None and not isinstance(tree, Path) and self.tree.name == tree:
            return self
        chosen = resolve_tree(tree, self.heads_folder)
        chosen.check_heads(self.heads)
        return replace(self, tree=chosen)

    @property
    def speculative(self) -> bool:
        return self.tree is not None and self.tree.speculates(self.heads)

    def graph_capture_stream(self) -> torch.cuda.Stream | None:
        """The side stream every CUDA graph of this engine's sessions is captured on (made
        once; None off CUDA). cuBLAS keeps a workspace for each stream it has run on, for
        the life of the process (32 MiB on an H200): a stream per session would add one
        for every new chat."""
        if self.capture_stream is None and self.model.device.type == "cuda":
            self.capture_stream = torch.cuda.Stream(self.model.device)
        return self.capture_stream

    def new_session(
        self, capacity: int = DEFAULT_CAPACITY, system_prompt: str | None = None, speculate: bool = True,
        graphs: bool | None = None,
    ) -> ChatSession:
        """A conversation with its own KV cache of ``capacity`` committed tokens (plus room
        for the tree's scratch slots). ``graphs``: the static-shape decoder, whose greedy
        steps replay as CUDA graphs on a GPU (static_decoding.py); None: on CUDA only
        (an eager GPU step costs ~10× a replayed one; on CPU static shapes only cost)."""
        if graphs is None:
            # NOTE: a streamed model (offload.py) steps eagerly: its copies wait on events
            # recorded by the previous step, which a captured graph cannot hold, and its
            # step waits on the link, not on kernel launches; so does a model split over
            # two devices (split.py): one graph holds one device's kernels
            graphs = self.model.device.type == "cuda" and self.model.capturable
        use_tree = speculate and self.speculative
        scratch = self.tree.num_nodes if use_tree else 1
        heads, tree = (self.heads, self.tree) if use_tree else (None, None)
        if graphs:
            from specmemo_core.runtime.static_decoding import StaticDecoder, new_static_cache

            decoder: Decoder = StaticDecoder(self.model, new_static_cache(self.model, capacity + scratch), heads, tree,
                                             graphs=True, capture_stream=self.graph_capture_stream())
        else:
            decoder = Decoder(self.model, self.model.new_cache(capacity + scratch), heads, tree)
        return ChatSession(decoder, self.tokenizer, end_of_turn_ids(self.tokenizer, self.config), system_prompt)

    def new_batch_decoder(self, capacity: int, *, slots: int, speculate: bool = True, graphs: bool | None = None):
        """``slots`` conversations decoded together (``runtime.batch.BatchDecoder``), each with
        its own KV cache of ``capacity`` committed tokens plus the tree's scratch slots, on the
        engine's tree. ``graphs``: capture its greedy steps as CUDA graphs (None: on CUDA, for
        a model whose layers are all resident, as ``new_session``); never off CUDA."""
        from specmemo_core.runtime.batch import BatchDecoder

        if self.backend != "torch":
            raise SpecMemoError("batched decoding runs on our own forward: load the model with the torch backend "
                                "(--backend torch), or serve it through Engine.on_torch()")
        on_cuda = self.model.device.type == "cuda"
        graphs = on_cuda and (self.model.capturable if graphs is None else graphs)
        use_tree = speculate and self.speculative
        tree = self.tree if use_tree else None
        scratch = tree.num_nodes if tree is not None else 1
        return BatchDecoder(self.model, slots=slots, capacity=capacity + scratch,
                            heads=self.heads if use_tree else None, tree=tree, graphs=graphs)
