"""The command-line tools around the daemon: mpsd-smi, mpsd-control, `mpsd simulate`."""
