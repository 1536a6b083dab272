"""Assembles a ready-to-chat engine: weights → our forward, draft heads, tree, sessions."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from specmemo_core.runtime.chat import ChatSession, end_of_turn_ids
from specmemo_core.runtime.cpu_linear import pack_linears
from specmemo_core.runtime.decoding import Decoder
from specmemo_core.errors import SpecMemoError
from specmemo_core.runtime.heads import DraftHeads, HeadsModule, load_heads, random_heads
from specmemo_core.runtime.model import CausalLM
from specmemo_core.storage.sources import ModelIdentity, load_model
from specmemo_core.runtime.tree import Tree, is_lookup_only, load_tree, split_lookup

ASSETS_DIR = Path(__file__).resolve().parents[2] / "assets"
DEFAULT_TREE = "medusa-64"
DEFAULT_CAPACITY = 4096


def resolve_tree(spec: str | Path, heads_folder: Path | None) -> Tree:
    """A tree by name or file; ``calibrated-N`` builds the best N-node tree from the
    heads' calibration file (``calibrated`` alone: 64 nodes); ``+lookup-N`` adds a lookup
    chain to either."""
    name = str(spec)
    if not isinstance(spec, Path) and (parts := split_lookup(name)) and parts[0]:
        return resolve_tree(parts[0], heads_folder).with_lookup(parts[1])
    if name.startswith("calibrated"):
        from specmemo_core.tools.train.calibrate import load_calibration, tree_from_calibration

        record = load_calibration(heads_folder) if heads_folder is not None else None
        if record is None:
            raise SpecMemoError(
                f"tree {name} needs the heads' calibration.json; run `specmemo calibrate --heads DIR` "
                f"or choose a named tree such as medusa-64"
            )
        nodes = int(name.split("-", 1)[1]) if "-" in name else 64
        return tree_from_calibration(record, nodes)
    return load_tree(spec)


def default_tree(device: str | torch.device, heads_folder: Path | None) -> str | None:
    """The tree when no planner runs (``specmemo generate``/``chat``). On GPUs a 64-node
    tree costs about one plain step: 56 calibrated nodes and a lookup chain of 8. On CPUs
    whether a tree pays depends on the machine
    (2 cores, packed weights: a 4-node tree gains ~1.1×; before packing it lost), so
    without the planner's start-up timing CPUs decode plainly (None); the app and
    ``bench --methods plan`` time the device and choose."""
    if torch.device(device).type == "cpu":
        return None
    if heads_folder is not None and (heads_folder / "calibration.json").exists():
        return "calibrated-56+lookup-8"  # 64 nodes: the most tokens per step on MT-Bench (3.30)
    return DEFAULT_TREE


def shipped_heads_dir(identity: ModelIdentity) -> Path | None:
    """Trained heads shipped under ``assets/heads/<model name>/``, if any."""
    folder = ASSETS_DIR / "heads" / identity.name
    return folder if (folder / "heads.safetensors").exists() else None


@dataclass
class Engine:
    model: CausalLM
    tokenizer: Any
    config: Any
    identity: ModelIdentity
    heads: DraftHeads | None
    tree: Tree | None
    heads_folder: Path | None = None  # where the heads (and their calibration.json) came from
    capture_stream: Any = field(default=None, repr=False)  # made by graph_capture_stream()

    @classmethod
    def load(
        cls,
        model: str | Path = "default",
        *,
        heads: str | Path | None = "auto",
        tree: str | Path | None = "auto",
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        progress: Callable[[str, float], None] | None = None,
        precision: str | None = None,
    ) -> "Engine":
        """``heads``: "auto" (shipped heads for this model, else none), "none", "random"
        (random weights, 5 heads: for checking exactness) or a path. ``tree``: None or a
        tree name/file; with no heads the engine decodes plainly. ``precision`` "int8" or
        "int4": weight-only quantization of the decoder layers (``quantize.py``). On CPU
        the fp32 linear layers are then packed for oneDNN (``cpu_linear.py``): the model is
        ready for inference and can no longer be cast, quantized or trained."""
        loaded = load_model(model, dtype=torch.float32, progress=progress)
        lm = CausalLM.from_state_dict(loaded.config, loaded.state_dict, dtype=dtype, device=device)
        if precision in ("int8", "int4"):
            from specmemo_core.runtime.quantize import QuantSpec, quantize_model

            if progress is not None:
                progress(f"quantizing to {precision}", 0.0)
            quantize_model(lm, QuantSpec(precision))
        spec = lm.spec
        draft: HeadsModule | None = None
        folder: Path | None = None
        if heads == "random":
            draft = random_heads(5, spec.hidden_size, spec.vocab_size, base_name=loaded.identity.name,
                                 base_fingerprint=loaded.identity.fingerprint).to(device=device, dtype=dtype)
        elif heads == "auto":
            folder = shipped_heads_dir(loaded.identity)
            if folder is not None:
                draft = load_heads(folder, spec.hidden_size, spec.vocab_size, loaded.identity.fingerprint, dtype, device)
        elif heads not in (None, "none"):
            folder = Path(heads) if Path(heads).is_dir() else Path(heads).parent
            draft = load_heads(heads, spec.hidden_size, spec.vocab_size, loaded.identity.fingerprint, dtype, device)
        if draft is not None and draft.spec.draft_vocab:
            draft.use_draft_vocab(lm.lm_head.weight)  # before packing: it copies the LM head's rows
        if torch.device(device).type == "cpu":
            pack_linears(lm)
            if draft is not None:
                pack_linears(draft)
        else:
            lm.fuse_projections()  # GPUs: launch-bound, one matmul for q/k/v and one for gate/up
        if tree == "auto":
            tree = default_tree(device, folder)
        # without heads only a lookup chain alone (``lookup-N``) can speculate; other trees: plain
        chosen = resolve_tree(tree, folder) if tree is not None and (
            draft is not None or is_lookup_only(str(tree))) else None
        if chosen is not None and draft is not None:
            chosen.check_heads(draft.num_heads)
        return cls(lm, loaded.tokenizer, loaded.config, loaded.identity, draft, chosen,
                   folder if draft is not None else None)

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
            graphs = self.model.device.type == "cuda"
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
