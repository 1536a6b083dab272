"""``specmemo bench``'s ``llamacpp`` method: llama.cpp (what LM Studio, Ollama and GPT4All run)
on the same GGUF and the same workload as our methods, in the same process and window.

Through ``llama-cpp-python`` (an optional extra, ``pip install -e '.[llamacpp]'``: it builds
llama.cpp from source, ~30 min on 2 cores). Where it is not installed the method is left out
of the run with a line that says so (``missing_reason``).

Each turn hands llama.cpp the conversation so far as token ids from our own chat template and
tokenizer (``encode_conversation``, the model's earlier replies as the ids it produced), so
both engines see the same prompt ids; llama.cpp keeps the KV of the prefix it has already
evaluated, as our sessions keep theirs. Greedy: ``temp=0`` (llama.cpp's argmax), no repeat
penalty, no top-k/top-p/min-p cut. llama.cpp computes in its own quantized kernels (here the
file's Q4_1 blocks), so its replies need not equal ours token for token; the report counts
how many do.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from specmemo_core.errors import SpecMemoError
from specmemo_core.tools.bench import BENCH_CONTEXT, Method, Pass, Turn, run_turns

LLAMACPP = "llamacpp"
INSTALL_HINT = ("install it with: pip install -e '.[llamacpp]' (llama-cpp-python builds llama.cpp from source: "
                "about 30 min on 2 cores)")


def missing_reason() -> str | None:
    """Why the method cannot run here (None: it can)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return f"llamacpp skipped: llama-cpp-python is not installed; {INSTALL_HINT}"
    return None


PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=int(sys.argv[2]), n_gpu_layers=0, verbose=False)
tokens = llm.tokenize(b"Hello, how are you today?")
next(iter(llm.generate(tokens, temp=0.0, top_k=1)))
"""


def crash_reason(path: Path, threads: int) -> str | None:
    """Why llama.cpp cannot decode ``path`` here, from a short run in a child process (a
    build whose kernels this CPU cannot run dies of a signal; it would take the bench with
    it). None: it decodes."""
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-c", PROBE, str(path), str(threads)], capture_output=True,
                              text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "llamacpp skipped: llama.cpp did not answer a 7-token prompt within 5 minutes"
    if done.returncode == 0:
        return None
    why = f"signal {-done.returncode}" if done.returncode < 0 else (done.stderr.strip().splitlines() or ["?"])[-1]
    return (f"llamacpp skipped: llama.cpp failed on a 7-token prompt ({why}); its build may use CPU "
            "instructions this machine does not allow (AMX in a virtual machine: rebuild llama-cpp-python with "
            "CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF')")


def gguf_path(model: str) -> Path:
    """The GGUF file llama.cpp reads for ``model`` ("default" or a .gguf path)."""
    if str(model) == "default":
        from specmemo_core.storage.sources import ensure_default_model

        return ensure_default_model()
    path = Path(model).expanduser()
    if path.suffix.lower() != ".gguf":
        raise SpecMemoError(f"the llamacpp method reads GGUF files; {model} is not one: bench it on a .gguf model")
    return path


def open_llama(path: Path, threads: int) -> Any:
    """llama.cpp's model on ``path``, CPU threads as given, context as our bench's."""
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=BENCH_CONTEXT, n_threads=threads, n_threads_batch=threads,
                 n_gpu_layers=0, verbose=False, seed=0)


def llamacpp_runner(llm: Any, tokenizer: Any, stop_ids: frozenset[int], conversations: Sequence[Sequence[str]],
                    max_new_tokens: int) -> Callable[[], Pass]:
    """llama.cpp's greedy decoding over the conversations, one token per forward."""

    def turn(prompt: list[int]) -> Turn:
        start = time.perf_counter()
        first, reply = 0.0, []
        for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                  reset=True):  # reset: keeps the prefix it already evaluated
            if not reply:
                first = time.perf_counter() - start
            if token in stop_ids:
                break
            reply.append(int(token))
            if len(reply) >= max_new_tokens:
                break
        steps = max(len(reply) - 1, 0)
        return Turn(reply, first, steps, steps)

    def run() -> Pass:
        llm.reset()  # each pass from an empty cache, as each of ours starts with a new decoder
        return run_turns(tokenizer, conversations, turn)

    return run


def llamacpp_method(model: str, engine: Any, conversations: Sequence[Sequence[str]], *, max_new_tokens: int,
                    threads: int) -> Method:
    """The ``llamacpp`` bench method on ``model``'s GGUF (the engine gives the tokenizer and stops)."""
    from importlib.metadata import version

    from specmemo_core.runtime.chat import end_of_turn_ids

    path = gguf_path(model)
    llm = open_llama(path, threads)
    stops = frozenset(end_of_turn_ids(engine.tokenizer, engine.config))
    run = llamacpp_runner(llm, engine.tokenizer, stops, conversations, max_new_tokens)
    return Method(LLAMACPP, run, note=f"llama.cpp via llama-cpp-python {version('llama-cpp-python')}, "
                                      f"{path.name}, {threads} threads, greedy")
