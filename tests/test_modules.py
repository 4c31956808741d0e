"""Kernels of one's own (mpsd.modules): which module files a daemon loads (only from its --module-path), what a bad
file gives (CUDA_ERROR_INVALID_IMAGE with the reason, and the daemon serves on), unknown functions and wrong
argument counts, the example's tiled matmul computing its numpy reference, its timing under an MPS SM cap as the
model alone gives it, and occupancy by its declared resources. In-process daemons (tests/inproc.py) with trio
clients; the driver flavour's blocking calls run in a thread beside the daemon's loop."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import trio

from inproc import in_process_daemon
from mpsd.daemon.config import ConfigError, load_config
from mpsd.modules import PARAM_KINDS as DECLARED_KINDS
from mpsd.modules import read_module
from mpsd.sim import H200, Kernel, Simulator, function_cost, sm_cap
from mpsd.stress.runner import run_virtual
from mpsd.stress.workload import WorkloadError, parse_workload
from mpsd.tools.simulate import run_workload
from mpsd_client import (Function, InvalidDeviceFunctionError, InvalidKernelImageError, InvalidValueError,
                         LaunchOutOfResourcesError, NotFoundError, _contexts, driver)
from mpsd_protocol import PARAM_KINDS, CudaError

ONE_MS, OVERHEAD_MS = round(1e-3 * H200.clock_hz), H200.kernel_overhead * 1e3
EXAMPLE = Path(__file__).parent.parent / "examples" / "modules" / "matmul.py"
IMPORT = "from mpsd.modules import Cost, Kernel\n"
BAD = {
    "syntax.py": "KERNELS = [\n",
    "raises.py": "raise RuntimeError('no GPU for you')\n",
    "exits.py": "import sys\nsys.exit(3)\n",
    "empty.py": "x = 1\n",
    "kinds.py": f"{IMPORT}KERNELS = [Kernel('k', ('ptr', 'u8'), lambda a, b, t: Cost())]\n",
    "nobounds.py": f"{IMPORT}KERNELS = [Kernel('k', ('ptr',), lambda a, b, t: Cost())]\n",
}
HEAVY = ("from mpsd.modules import Cost, Kernel\n"
         "KERNELS = [Kernel('fat', ('i64',), lambda a, b, t: Cost(cycles=a[0]), lambda a: [], registers=255)]\n")


@pytest.fixture
def modules(tmp_path: Path) -> Path:
    """A --module-path directory: the example's matmul, the bad files, a heavy kernel, and a link that leads out."""
    folder = tmp_path / "modules"
    folder.mkdir()
    shutil.copy(EXAMPLE, folder)
    for name, text in {**BAD, "heavy.py": HEAVY}.items():
        (folder / name).write_text(text)
    outside = tmp_path / "outside.py"
    outside.write_text(EXAMPLE.read_text())
    (folder / "escape.py").symlink_to(outside)
    return folder


def test_the_declarations_share_the_protocols_parameter_kinds():
    """A module's parameter kinds are the ones launches are checked by at both ends (two copies, held equal)."""
    assert set(DECLARED_KINDS) == set(PARAM_KINDS)


def test_module_path_must_name_directories(tmp_path: Path):
    """--module-path is repeatable and searched in order, or the config file's module-path list; a directory that
    is not one is a config error."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    config = load_config(["--pipe-dir", str(tmp_path), "--module-path", str(a), "--module-path", str(b)], environ={})
    assert config.module_path == (a.resolve(), b.resolve())
    (tmp_path / "mpsd.toml").write_text(f'[mpsd]\nmodule-path = ["{b}"]\n')  # the config file's, where no option
    config = load_config(["--pipe-dir", str(tmp_path), "--config", str(tmp_path / "mpsd.toml")], environ={})
    assert config.module_path == (b.resolve(),)
    with pytest.raises(ConfigError, match="no such directory"):
        load_config(["--pipe-dir", str(tmp_path), "--module-path", str(tmp_path / "nope")], environ={})


async def test_matmul_computes_its_reference_and_loading_follows_the_path_rules(modules: Path, tmp_path: Path):
    """The example's matmul, loaded by name, gives A @ B on the device's bytes (by name and by Function); paths
    outside the --module-path (absolute, .., a symlink out) and missing files are the runtime's invalid value,
    bad files invalid images naming the reason, and the daemon serves on."""
    m, k, n = 48, 40, 24
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    async with in_process_daemon("--time-scale", "100", "--module-path", str(modules)) as d:
        async with d.connect() as ctx:
            module = await ctx.module_load("matmul")
            assert sorted(module.functions) == ["matmul_t16", "matmul_t32", "matmul_t8"]
            assert (await ctx.module_load(str(modules / "matmul.py"))).handle == module.handle  # loaded again
            pa, pb, pc1, pc2 = [await ctx.malloc(nbytes) for nbytes in (a.nbytes, b.nbytes, 4 * m * n, 4 * m * n)]
            await ctx.memcpy_htod(pa, a.tobytes())
            await ctx.memcpy_htod(pb, b.tobytes())
            await ctx.launch("matmul.matmul_t16", (-(-n // 16), -(-m // 16)), (16, 16), [pa, pb, pc1, m, n, k])
            f = module.get_function("matmul_t8")
            assert isinstance(f, Function) and f.name == "matmul.matmul_t8"
            await ctx.launch(f, (-(-n // 8), -(-m // 8)), (8, 8), [pa, pb, pc2, m, n, k])
            await ctx.synchronize()
            for pc in (pc1, pc2):
                out = bytearray(4 * m * n)
                await ctx.memcpy_dtoh(out, pc)
                np.testing.assert_allclose(np.frombuffer(out, np.float32).reshape(m, n), a @ b, rtol=1e-5, atol=1e-5)
            # A launch whose extents reach past its allocation is an illegal address, as a built-in's is.
            await ctx.launch("matmul.matmul_t16", (-(-n // 16), -(-m // 16)), (16, 16), [pa, pb, pc1, m, n, 2 * k])
            with pytest.raises(CudaError, match="cudaErrorIllegalAddress"):
                await ctx.synchronize()
        async with d.connect() as ctx:
            for path in (str(tmp_path / "outside.py"), "../outside.py", "escape.py"):
                with pytest.raises(InvalidValueError, match="outside the daemon's --module-path"):
                    await ctx.module_load(path)
            with pytest.raises(InvalidValueError, match="no module 'nothere' in the daemon's --module-path"):
                await ctx.module_load("nothere")
            reasons = {"syntax": "syntax.py, line 1: '\\[' was never closed", "raises": "RuntimeError: no GPU for you",
                       "exits": "SystemExit",
                       "empty": "binds KERNELS", "kinds": "params must be", "nobounds": "needs extents"}
            for name, reason in reasons.items():
                with pytest.raises(InvalidKernelImageError, match=reason):
                    await ctx.module_load(name)
            with pytest.raises(InvalidDeviceFunctionError, match="no module 'matmul' is loaded"):
                await ctx.launch("matmul.matmul_t8", 1, 64, [0, 0, 0, 1, 1, 1])  # loaded in another context only
            p = await ctx.malloc(4096)
            await ctx.launch("fill_f32", 1, 256, [p, 2.0, 1024])  # the daemon serves on
            out = bytearray(8)
            await ctx.memcpy_dtoh(out, p)
            assert np.frombuffer(out, np.float32).tolist() == [2.0, 2.0]


async def test_a_daemon_without_module_path_loads_none(tmp_path: Path):
    """With no --module-path every module is outside it, and the error says why."""
    async with in_process_daemon("--time-scale", "100") as d, d.connect() as ctx:
        with pytest.raises(InvalidValueError, match="no --module-path"):
            await ctx.module_load(str(EXAMPLE))


def _driver_flavour(pipe_dir: Path, modules: Path) -> dict[str, object]:
    """The driver API's answers, in a thread: CUresult names for each rule, and a launch by Function."""
    seen: dict[str, object] = {}

    def code(call, *args) -> str:
        try:
            call(*args)
        except CudaError as exc:
            return exc.name
        return "CUDA_SUCCESS"

    driver.init(0, pipe_dir=pipe_dir)
    ctx = driver.ctx_create(0, driver.device_get(0))
    try:
        seen["outside"] = code(driver.module_load, str(EXAMPLE))
        seen["missing"] = code(driver.module_load, "nothere.py")
        seen["bad"] = code(driver.module_load, "syntax")
        mod = driver.module_load(modules / "matmul.py")
        seen["no function"] = code(driver.module_get_function, mod, "matmul_t64")
        f = driver.module_get_function(mod, "matmul_t16")
        seen["too few"] = code(driver.launch_kernel, f, 1, 1, 1, 16, 16, 1, 0, None, [0, 0, 0, 16])
        seen["unknown name"] = code(driver.launch_kernel, "matmul.nope", 1, 1, 1, 16, 16, 1, 0, None, [])
        seen["regs"] = driver.func_get_attribute(driver.CU_FUNC_ATTRIBUTE_NUM_REGS, f)
        seen["static smem"] = driver.func_get_attribute(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, f)
        seen["blocks"] = driver.occupancy_max_active_blocks_per_multiprocessor(f, 256, 0)
        p = driver.mem_alloc(4 * 16 * 16)
        driver.memcpy_htod(p, np.ones(256, np.float32).tobytes())
        driver.launch_kernel(f, 1, 1, 1, 16, 16, 1, 0, None, [p, p, p + 0, 16, 16, 0])  # k = 0: c = 0
        driver.ctx_synchronize()
        out = bytearray(8)
        driver.memcpy_dtoh(out, p)
        seen["result"] = np.frombuffer(out, np.float32).tolist()
        driver.module_unload(mod)
        seen["after unload"] = code(driver.launch_kernel, f, 1, 1, 1, 16, 16, 1, 0, None, [p, p, p, 16, 16, 0])
    finally:
        driver.ctx_destroy(ctx)
        _contexts._state.forget()
    return seen


async def test_the_driver_flavour_reports_the_drivers_codes(modules: Path):
    """cuModuleLoad outside the path and of a missing file is CUDA_ERROR_FILE_NOT_FOUND, of a bad file
    CUDA_ERROR_INVALID_IMAGE; an unknown function CUDA_ERROR_NOT_FOUND; wrong argument counts
    CUDA_ERROR_INVALID_VALUE; a Function launches as its name does, and not once its module is unloaded."""
    async with in_process_daemon("--time-scale", "100", "--module-path", str(modules)) as d:
        seen = await trio.to_thread.run_sync(_driver_flavour, d.pipe_dir, modules)
    assert seen == {
        "outside": "CUDA_ERROR_FILE_NOT_FOUND", "missing": "CUDA_ERROR_FILE_NOT_FOUND",
        "bad": "CUDA_ERROR_INVALID_IMAGE", "no function": "CUDA_ERROR_NOT_FOUND",
        "too few": "CUDA_ERROR_INVALID_VALUE", "unknown name": "CUDA_ERROR_INVALID_HANDLE",
        "regs": 32, "static smem": 2 * 16 * 16 * 4, "blocks": 8, "result": [0.0, 0.0],
        "after unload": "CUDA_ERROR_INVALID_HANDLE",
    }


async def test_occupancy_and_attributes_follow_the_declared_resources(modules: Path, autojump_clock):
    """cudaOccupancyMaxActiveBlocksPerMultiprocessor by the kernel's registers and shared memory, as the H200
    model's SM holds them: 32 x 8x8 blocks (the block limit), 8 x 16x16 (threads), one 32x32 block at 40
    registers (the register file), two 16x16 with 100 KiB of dynamic shared memory each; a kernel of 255
    registers fits 256 threads a block, and a launch of more is out of resources."""
    async with in_process_daemon("--time-scale", "100", "--module-path", str(modules)) as d, d.connect() as ctx:
        await ctx.module_load("matmul")
        heavy = await ctx.module_load("heavy")
        blocks = [await ctx.occupancy_max_active_blocks(f"matmul.matmul_t{t}", (t, t)) for t in (8, 16, 32)]
        assert blocks == [32, 8, 1]
        assert await ctx.occupancy_max_active_blocks("matmul.matmul_t16", 256, 100 << 10) == 2
        assert await ctx.occupancy_max_active_blocks("fill_f32", 256) == 8  # a built-in's, at 32 registers
        attributes = await ctx.func_get_attributes(heavy.get_function("fat"))
        assert (attributes["num_regs"], attributes["max_threads_per_block"]) == (255, 256)
        assert await ctx.occupancy_max_active_blocks("heavy.fat", 512) == 0
        # (The daemon judges the fit, so the error surfaces at the next synchronising call, as a built-in's does.)
        await ctx.launch("heavy.fat", 1, 512, [10])
        with pytest.raises(LaunchOutOfResourcesError, match="255 registers"):
            await ctx.synchronize()
        await ctx.launch("matmul.matmul_t8", 1, (16, 16), [0, 0, 0, 1, 1, 1])
        with pytest.raises(LaunchOutOfResourcesError, match="launch bounds"):
            await ctx.synchronize()
        with pytest.raises(InvalidValueError, match="takes 6 arguments"):
            await ctx.launch("matmul.matmul_t8", 1, (8, 8), [0, 0, 0])
        with pytest.raises(NotFoundError):
            heavy.get_function("thin")
        # Its registers hold one 256-thread block on an SM where spin's 32 fit eight: 264 blocks of 1 ms take two
        # waves, not one.
        ms = {}
        for name in ("spin", "heavy.fat"):
            start, end = await ctx.create_event(), await ctx.create_event()
            await start.record()
            await ctx.launch(name, 264, 256, [ONE_MS])
            await end.record()
            await end.synchronize()
            ms[name] = await start.elapsed_ms(end)
        assert ms == pytest.approx({"spin": 1 + OVERHEAD_MS, "heavy.fat": 2 + OVERHEAD_MS}, abs=1e-9)


def _model_ms(kernel, blocks: int, threads: int, args: list[int], percentage: float) -> float:
    """The kernel alone on the H200 model under `percentage` active threads: its time from launch to end."""
    sim = Simulator()
    op = Kernel(client=1, stream=0, blocks=blocks, threads=threads, cost=function_cost(H200, kernel, blocks, threads,
                args), smem=kernel.shared, regs_per_thread=kernel.registers, sm_cap=sm_cap(H200, percentage))
    sim.submit(op)
    sim.run()
    return (op.ended - op.submitted) * 1e3


@pytest.mark.parametrize("tile", [8, 32])
async def test_matmul_timing_under_an_sm_cap_is_the_models(modules: Path, autojump_clock, tile: int):
    """A 1024^3 matmul's simulated time through the daemon is the model's for its tile, at 100% and at 25%
    active threads (32 SMs: the capped run takes longer); the tile size changes it (8 is DRAM-bound)."""
    size = 1024
    kernel = read_module(modules / "matmul.py").kernels[f"matmul_t{tile}"]
    grid = (size // tile, size // tile)
    seen = {}
    async with in_process_daemon("--time-scale", "100", "--module-path", str(modules)) as d:
        for percentage in ("100", "25"):
            async with d.connect(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=percentage) as ctx:
                await ctx.module_load("matmul")
                pa, pb, pc = [await ctx.malloc(4 * size * size) for _ in range(3)]
                start, end = await ctx.create_event(), await ctx.create_event()
                await start.record()
                await ctx.launch(f"matmul.matmul_t{tile}", grid, (tile, tile), [pa, pb, pc, size, size, size])
                await end.record()
                await end.synchronize()
                seen[percentage] = await start.elapsed_ms(end)
    args = [0, 0, 0, size, size, size]
    for percentage, ms in seen.items():
        assert ms == pytest.approx(_model_ms(kernel, grid[0] * grid[1], tile * tile, args, float(percentage)),
                                   rel=1e-6)
    assert seen["25"] > 1.5 * seen["100"]
    cost = function_cost(H200, kernel, grid[0] * grid[1], tile * tile, args)
    assert (cost.dram, cost.shared) == ((True, False) if tile == 8 else (False, True))


def _matmul_workload(modules: Path, **kernel: object) -> object:
    return parse_workload({"run": {"duration": 0.001, "module_path": [modules.name]}, "tenant": [
        {"name": "mm", "active_thread_percentage": 25, "kernel": [{
            "name": "matmul.matmul_t16", "grid": [4, 4], "block": [16, 16],  # small: its reference runs each time
            "args": ["16K", "16K", "16K", 64, 64, 64], **kernel}]}]}, base=modules.parent)


def test_a_workload_names_a_module_kernel_as_a_built_in(modules: Path):
    """mpsd-stress runs a module's kernel from [run] module_path (the daemon's --module-path) with a buffer of the
    size given for each pointer, and its requests are the model's alone (mpsd simulate) to the nanosecond; its
    args are checked against the declaration."""
    w = _matmul_workload(modules)
    timeline = run_virtual(w, "mps", {})
    model = run_workload(w)["tenants"][0]
    assert len(timeline.requests) == model["kernels"] > 50
    latencies = sorted(r.latency for r in timeline.requests)
    assert latencies[len(latencies) // 2] * 1e3 == pytest.approx(model["latency_p50_ms"], abs=1e-9)
    with pytest.raises(WorkloadError, match=r"args must list its 6 arguments \(ptr, ptr, ptr, i64, i64, i64\)"):
        _matmul_workload(modules, args=[1, 2])
    with pytest.raises(WorkloadError, match="argument 3 must be i64"):
        _matmul_workload(modules, args=["1K", "1K", "1K", 1.5, 1, 1])
    with pytest.raises(WorkloadError, match="no module 'nomod'"):
        _matmul_workload(modules, name="nomod.k")
