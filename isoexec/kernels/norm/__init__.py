"""Norms (``norm.rms``, ``gdn.norm``, ``gdn.l2norm``): CPU, Triton and native."""
