"""isoexec.trainer"""
