"""Benchmarks, each a ratio of two implementations measured side by side in one run: the CPU model
throughput (:mod:`isoexec.bench.cpu`) and the GPU kernel, CPR and model tables (entry :mod:`isoexec.bench.gpu`;
the tables in :mod:`isoexec.bench.kernels_gpu`, :mod:`isoexec.bench.cpr_gpu`, :mod:`isoexec.bench.model_gpu`
and :mod:`isoexec.bench.variants_gpu`, their timing in :mod:`isoexec.bench.timing_gpu`)."""
