# What a run records, below everything that records it: the timeline (tenants, requests, kernels and the block
# groups as one table of columns) and its Chrome/Perfetto trace format. The backends' recorder writes it, the
# stress runner and its metrics and report read it; it imports nothing of mpsd when it runs, so neither side
# reaches into the other for it.
"""A run's timeline and its trace file."""
