"""CUDA semantics, whatever the device: contexts, streams, events, sticky errors, device memory and
its accounting, IPC, kernel signatures."""
