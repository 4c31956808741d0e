"""The daemon: its options, the MPS-server lifecycle and control plane, listeners, sessions and their
channels, admission of clients, status, logs."""
