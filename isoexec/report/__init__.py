"""isoexec.report"""
