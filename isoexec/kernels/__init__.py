"""isoexec.kernels"""
