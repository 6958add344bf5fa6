"""isoexec.model"""
