"""Tools built on the runtime: benchmarks, acceptance evaluation and head training."""
