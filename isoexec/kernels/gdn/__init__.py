"""Gated DeltaNet core (region ``gdn.core``): fp64 reference, CPR (isoexec) and native implementations."""
