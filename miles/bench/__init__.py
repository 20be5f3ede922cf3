"""`miles bench rollout|reward|attention|layers|moe|train`: the benchmarks, one module each, with what they
share in `common` (device timing, rooflines)."""
