"""Parallel-invariant (pik) GEMMs and combines over ``torch.distributed`` and the gloo test harness."""
