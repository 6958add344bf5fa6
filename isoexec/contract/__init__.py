"""isoexec.contract"""
