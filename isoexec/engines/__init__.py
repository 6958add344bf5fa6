"""isoexec.engines"""
