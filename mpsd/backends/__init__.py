"""What runs the work: the simulated H200 (its engine driver, timeline recorder, host memory budget)."""
