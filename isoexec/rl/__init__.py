"""isoexec.rl"""
