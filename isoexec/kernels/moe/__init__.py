"""Mixture of experts (``moe.router``, ``moe.experts``, ``moe.combine``, ``mlp.shared_expert``): the
routing every isoexec implementation shares, CPU, Triton and native."""
