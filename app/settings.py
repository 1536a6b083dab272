"""The user's chat settings: one frozen dataclass, saved as JSON in the data folder (no Qt)."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from specmemo_core.errors import SpecMemoError
from specmemo_core.planning.entry import PlanChoices

log = logging.getLogger(__name__)

FILE_NAME = "app_settings.json"
PRECISION_CHOICES = (None, "fp32", "bf16", "fp16", "int8", "int4")  # None: the planner chooses
THEME_CHOICES = ("system", "light", "dark")  # View ▸ Theme


@dataclass(frozen=True)
class ChatSettings:
    """What the settings panel edits. ``tree``/``heads``/``precision`` are the advanced overrides:
    ``tree`` None lets the planner choose; ``heads`` is "auto", "none" or a path."""

    prefer: float = 0.5  # 0 = more turns, 1 = more speed
    turns: int = 20
    temperature: float = 0.0
    max_reply_tokens: int = 256
    system_prompt: str = ""
    model: str = "default"  # "default", a .gguf file or a model folder
    speculate: bool = True
    tree: str | None = None
    heads: str = "auto"
    precision: str | None = None
    theme: str = "system"
    serve_on_localhost: bool = False  # the loaded model through the OpenAI API on 127.0.0.1 (app/serving.py)
    serve_port: int = 8000

    def __post_init__(self) -> None:
        if not 0.0 <= self.prefer <= 1.0:
            raise SpecMemoError(f"prefer must be between 0 (turns) and 1 (speed), got {self.prefer}")
        if self.turns < 1 or self.max_reply_tokens < 1:
            raise SpecMemoError("turns and max reply length must be at least 1")
        if self.temperature < 0:
            raise SpecMemoError(f"temperature must be ≥ 0, got {self.temperature}")
        if self.precision not in PRECISION_CHOICES:
            raise SpecMemoError(f"unknown precision {self.precision!r}")
        if not 1 <= self.serve_port <= 65535:
            raise SpecMemoError(f"the server's port must be from 1 to 65535, got {self.serve_port}")
        if self.theme not in THEME_CHOICES:
            raise SpecMemoError(f"unknown theme {self.theme!r}: choose one of {', '.join(THEME_CHOICES)}")

    def plan_choices(self) -> PlanChoices:
        """What these settings ask of the planner (the core's one plan entry)."""
        return PlanChoices(turns=self.turns, prefer=self.prefer, reply_tokens=self.max_reply_tokens,
                           temperature=self.temperature, precision=self.precision, speculate=self.speculate,
                           tree=self.tree)

    def needs_reload(self, other: "ChatSettings") -> bool:
        """True when going from ``self`` to ``other`` needs the model loaded again."""
        return (self.model, self.heads, self.precision) != (other.model, other.heads, other.precision)

    def with_(self, **changes: object) -> "ChatSettings":
        return replace(self, **changes)


def load_settings(folder: Path) -> ChatSettings:
    """Saved settings, or the defaults when the file is missing or unreadable (never fatal)."""
    path = folder / FILE_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        known = {f.name for f in fields(ChatSettings)}
        return ChatSettings(**{k: v for k, v in data.items() if k in known})
    except FileNotFoundError:
        return ChatSettings()
    except (OSError, ValueError, TypeError, SpecMemoError) as exc:
        log.warning("ignoring unreadable settings %s (%s)", path, exc)
        return ChatSettings()


def save_settings(folder: Path, settings: ChatSettings) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (FILE_NAME + ".tmp")
    tmp.write_text(json.dumps(asdict(settings), indent=1), encoding="utf-8")
    tmp.replace(folder / FILE_NAME)


def model_path_problem(path: str) -> str | None:
    """Why ``path`` cannot be a model (None if it may be one), checked before anything loads."""
    if path == "default":
        return None
    p = Path(path).expanduser()
    if not p.exists():
        return f"{p} does not exist."
    if p.is_dir():
        if not (p / "config.json").is_file():
            return (f"{p} is not a model folder (it has no config.json). Choose a Hugging Face model folder "
                    "or a .gguf file.")
        return None
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        return f"{p} cannot be read ({exc})."
    if magic != b"GGUF":
        return f"{p.name} is not a model: expected a .gguf file or a Hugging Face model folder."
    return None


def heads_path_problem(path: str) -> str | None:
    """Why ``path`` cannot be draft heads (None if it may be); whose model they fit is checked on load."""
    if path in ("auto", "none"):
        return None
    p = Path(path).expanduser()
    if p.is_dir():
        if (p / "heads.safetensors").is_file() or (p / "config.json").is_file():
            return None
        return f"{p} holds no heads.safetensors: choose a folder made by `specmemo train-heads`."
    if p.is_file() and p.suffix == ".safetensors":
        return None
    return f"{p} is not a heads file: choose a heads folder or a .safetensors file."
