"""Benchmarks, each a ratio of two implementations measured side by side in one run: the CPU model
throughput (:mod:`isoexec.bench.cpu`) and the GPU kernel, CPR and model tables (:mod:`isoexec.bench.gpu`)."""
