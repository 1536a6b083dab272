"""Issue 23 on a CPU: can llama.cpp run our tree-verification step? Two measurements through
llama-cpp-python's low-level API (the optional ``llamacpp`` extra), on a GGUF file:

1. **Cost of a step of N tokens** (a chain at positions past a 300-token prompt, logits for
   every token, as a tree verification needs): the median of 20 ``llama_decode`` calls for
   each N. Speculation pays only where N tokens cost little more than one.
2. **Exactness of tree verification with commits.** A tree is decoded in one batch, each
   node in the sequences of the leaves below it (llama.cpp masks a token to the cells of
   its first sequence at positions up to its own: exactly its ancestors), and the accepted
   path is kept by sequence operations (``llama_memory_seq_rm``/``seq_cp``): no second
   forward. Greedy tokens over trees with wrong siblings are compared with plain greedy
   decoding, and so are the logits of every accepted node (max abs difference).

    python scripts/llamacpp_tree_steps.py [--gguf FILE] [--threads 2] [--tokens 128]
        > docs/results/llamacpp_cpu/tree_steps.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np

PROMPT = ("<|im_start|>user\nWrite a short story about a robot who learns to paint, in three paragraphs."
          "<|im_end|>\n<|im_start|>assistant\n")
SEQS = 8


class Llama:
    """One llama.cpp context over a loaded model: decode a batch, read logits."""

    def __init__(self, L, model, threads: int, flash: bool, n_ctx: int = 2048) -> None:
        self.L = L
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, 512, 512, SEQS
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified, cp.no_perf = True, True
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = L.llama_init_from_model(model, cp)
        self.mem = L.llama_get_memory(self.ctx)
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        self.batch = L.llama_batch_init(512, 0, SEQS)

    def decode(self, tokens, positions, seqs) -> np.ndarray:
        b = self.batch
        b.n_tokens = len(tokens)
        for i, (t, p, s) in enumerate(zip(tokens, positions, seqs)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, len(s), True
            for j, x in enumerate(s):
                b.seq_id[i][j] = x
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        return np.ctypeslib.as_array(self.L.llama_get_logits(self.ctx), shape=(len(tokens), self.vocab)).copy()

    def keep_path(self, start: int, seq: int, count: int) -> None:
        """Keep the ``count`` cells of sequence ``seq`` from ``start`` on, in every sequence; drop the rest."""
        for t in range(SEQS):
            if t != seq:
                self.L.llama_memory_seq_rm(self.mem, t, start, -1)
                self.L.llama_memory_seq_cp(self.mem, seq, t, start, start + count)
        self.L.llama_memory_seq_rm(self.mem, seq, start + count, -1)


def step_costs(L, model, prompt, threads: int, sizes) -> dict[str, float]:
    llm = Llama(L, model, threads, flash=True)
    everyone = list(range(SEQS))
    llm.decode(prompt, range(len(prompt)), [everyone] * len(prompt))
    n, out = len(prompt), {}
    for size in sizes:
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            llm.decode([prompt[-1]] * size, range(n, n + size), [everyone] * size)
            times.append(time.perf_counter() - t0)
            L.llama_memory_seq_rm(llm.mem, -1, n, -1)
        out[str(size)] = round(statistics.median(times) * 1e3, 2)
    return out


def tree_exactness(L, model, prompt, threads: int, tokens: int, flash: bool) -> dict[str, object]:
    everyone = list(range(SEQS))
    plain = Llama(L, model, threads, flash)
    logits = plain.decode(prompt, range(len(prompt)), [everyone] * len(prompt))
    ref, ref_logits = [int(logits[-1].argmax())], []
    for i in range(tokens):
        row = plain.decode([ref[-1]], [len(prompt) + i], [everyone])[0]
        ref_logits.append(row)
        ref.append(int(row.argmax()))
    tree = Llama(L, model, threads, flash)
    logits = tree.decode(prompt, range(len(prompt)), [everyone] * len(prompt))
    out, n, rng = [int(logits[-1].argmax())], len(prompt), random.Random(0)
    worst, steps = 0.0, 0
    while len(out) < tokens:
        k = len(out)
        truth = ref[k:k + 3] + [0] * 3
        guess = [t if rng.random() < 0.7 else rng.randrange(tree.vocab) for t in truth[:3]]
        # root; a wrong sibling b with a child; the guessed chain a → a2 → a3
        toks = [out[-1], rng.randrange(tree.vocab), guess[0], rng.randrange(tree.vocab), guess[1], guess[2]]
        parent = [-1, 0, 0, 1, 2, 4]
        children = [[j for j in range(6) if parent[j] == i] for i in range(6)]
        leaves = [i for i in range(6) if not children[i]]

        def ancestors(i: int) -> list[int]:
            chain = []
            while parent[i] >= 0:
                i = parent[i]
                chain.append(i)
            return chain

        seqs = [[s for s, leaf in enumerate(leaves) if leaf == i or i in ancestors(leaf)] for i in range(6)]
        logits = tree.decode(toks, [n + len(ancestors(i)) for i in range(6)], seqs)
        picks = logits.argmax(-1)
        path = [0]
        while nxt := [c for c in children[path[-1]] if toks[c] == picks[path[-1]]]:
            path.append(nxt[0])
        in_sync = out == ref[:k]  # every token so far as plain decoding gave it
        for j, node in enumerate(path):
            if in_sync and k - 1 + j < len(ref_logits):
                worst = max(worst, float(np.abs(logits[node] - ref_logits[k - 1 + j]).max()))
        tree.keep_path(n, seqs[path[-1]][0], len(path))
        n += len(path)
        out += [toks[i] for i in path[1:]] + [int(picks[path[-1]])]
        steps += 1
    same = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref), tokens))
    return {"flash_attention": flash, "steps": steps, "tokens_equal_to_plain_before_first_difference": same,
            "of_tokens": tokens, "max_abs_logit_difference_while_equal": round(worst, 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default="default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--sizes", default="1,2,4,8,16,32")
    args = ap.parse_args()
    import llama_cpp as L

    from specmemo_core.tools.bench_llamacpp import gguf_path

    path = gguf_path(args.gguf)
    L.llama_backend_init()
    quiet = L.llama_log_callback(lambda *a: None)  # kept alive while llama.cpp may call it
    L.llama_log_set(quiet, None)
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    vocab = L.llama_model_get_vocab(model)
    text = PROMPT.encode()
    buf = (L.llama_token * 512)()
    prompt = list(buf[:L.llama_tokenize(vocab, text, len(text), buf, 512, False, True)])
    out = {"gguf": path.name, "threads": args.threads, "llama_cpp_python": L.__version__,
           "system": L.llama_print_system_info().decode().strip(),
           "ms_per_decode_of_n_tokens": step_costs(L, model, prompt, args.threads, [int(s) for s in args.sizes.split(",")]),
           "tree_exactness": [tree_exactness(L, model, prompt, args.threads, args.tokens, flash)
                              for flash in (True, False)]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
