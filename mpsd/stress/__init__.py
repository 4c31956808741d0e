# mpsd-stress: many tenants share one GPU under a policy; what happens to each of them. The workload file
# says who the tenants are and what they run; the runner plays it with real processes against the daemon
# (or in the simulator alone, in virtual time); everything measured becomes a Timeline, and the metrics and
# the report are computed from that alone, so both ways of running are judged by the same code.
"""Multi-tenant stress testing for mpsd."""
