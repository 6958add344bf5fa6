"""Depthwise causal conv1d + SiLU (``gdn.conv1d``): CPU, Triton and native."""
