"""What runs the work, behind one protocol (base.py) in one vocabulary (ops.py): the simulated H200 (sim.py, with
its engine driver, memfd memory, numpy kernels, host memory budget and recorder) and a real GPU through the CUDA
driver API (cuda.py)."""
