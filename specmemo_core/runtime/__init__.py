"""The decoding runtime: model forward, KV caches, trees, draft heads, lookup drafting, the decoding step, chat sessions and the engine that assembles them."""
