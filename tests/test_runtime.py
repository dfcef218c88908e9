import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

import liger_lab
from liger_lab import runtime

needs_cpu_only_machine = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU start-up path")
H200 = runtime.Hardware(interpreter=False, sm_count=132, shared_memory_bytes=227 * 1024)


def _python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@needs_cpu_only_machine
def test_import_on_a_machine_without_cuda_switches_to_the_interpreter():
    done = _python(
        "import os, torch, liger_lab\n"
        "y = liger_lab.rms_norm(torch.randn(8, 64), torch.ones(64))\n"
        "print(os.environ['TRITON_INTERPRET'], tuple(y.shape), bool(torch.isfinite(y).all()))\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "(8,", "64)", "True"]


@needs_cpu_only_machine
def test_triton_imported_first_is_an_error_that_says_how_to_fix_it():
    done = _python("import triton\nimport liger_lab\n")
    assert done.returncode != 0
    assert "RuntimeError" in done.stderr and "import liger_lab` before" in done.stderr


def test_pick_and_describe():
    assert runtime.pick(cpu="small", gpu="big") == ("small" if runtime.INTERPRET else "big")
    assert "Triton" in runtime.describe()


def test_rows_longer_than_a_tile_are_a_value_error():
    with pytest.raises(ValueError, match="at most"):
        runtime.row_launch(4, runtime.MAX_ROW_SIZE + 1)
    with pytest.raises(ValueError, match="at most"):
        runtime.persistent_row_launch(4, runtime.MAX_ROW_SIZE + 1)


@pytest.mark.parametrize("n_rows,n_cols", [(1, 1), (3, 37), (1000, 4096), (70000, 128)])
def test_launch_settings_fit_the_matrix(n_rows, n_cols):
    tiled = runtime.row_launch(n_rows, n_cols)
    assert tiled.block_n >= n_cols and tiled.grid * tiled.rows >= n_rows > (tiled.grid - 1) * tiled.rows
    persistent = runtime.persistent_row_launch(n_rows, n_cols)
    # A persistent grid loops over row tiles: never more programs than tiles.
    assert persistent.block_n >= n_cols and 1 <= persistent.grid * persistent.rows <= n_rows + persistent.rows - 1


@pytest.mark.parametrize(
    "n_cols,stream_bytes,shared_kib,expected",
    [
        (4096, 4, 227, (2, 8, 3)),  # bf16 x and dy on an H200: 2 rows under 8 warps, three tiles in flight
        (4096, 6, 227, (2, 8, 3)),  # the fused add's ds too: 144 KiB of stages still fit
        (4096, 8, 227, (4, 16, 1)),  # fp32: three stages would take 192 KiB, so one tile of 4 rows
        (4096, 4, 99, (4, 16, 1)),  # a GPU with 99 KiB of shared memory
        (2048, 4, 227, (4, 8, 3)),  # narrower rows: more of them per tile
        (16384, 4, 227, (1, 16, 1)),
    ],
)
def test_the_persistent_tile_pipelines_only_where_three_stages_fit(n_cols, stream_bytes, shared_kib, expected):
    """persistent_row_launch's GPU choice, worked out without a GPU: the measured H200 tile where its three stages
    fit in three quarters of the shared memory, else the unpipelined one."""
    gpu = runtime.Hardware(interpreter=False, sm_count=132, shared_memory_bytes=shared_kib * 1024)
    launch = runtime.persistent_row_launch(16384, n_cols, stream_bytes=stream_bytes, hardware=gpu)
    assert (launch.rows, launch.num_warps, launch.num_stages) == expected
    assert launch.grid == 132


@pytest.mark.parametrize("n", [1, 2, 3, 5, 1000, 1024, 1025, 2**20 + 1])
def test_integer_helpers_match_tritons(n):
    assert runtime.next_power_of_2(n) == triton.next_power_of_2(n)
    assert runtime.cdiv(n, 7) == triton.cdiv(n, 7) and runtime.cdiv(0, 7) == 0


def test_launch_settings_are_computed_once_per_shape_and_device():
    """An eager call asks for its settings every time: the second ask of a shape is the first answer, kept."""
    for settings in (
        lambda: runtime.row_launch(37, 96),
        lambda: runtime.persistent_row_launch(37, 96, stream_bytes=8),
        lambda: runtime.streaming_row_launch(37, 1000),
        lambda: runtime.column_sum_launch(4, 96),
        lambda: runtime.elementwise_launch(4096),
    ):
        assert settings() is settings()
    assert runtime.row_launch(37, 96, hardware=H200) is not runtime.row_launch(37, 96)
    assert runtime.hardware() is runtime.hardware(runtime.DEVICE)


def test_skip_launches_leaves_the_outputs_unwritten_and_runs_the_rest():
    """The host-time benchmark's switch: inside, no kernel runs (the output keeps what it held), a bad argument is
    still a ValueError; outside, the kernel runs again."""
    x, weight = torch.randn(5, 16, device=runtime.DEVICE), torch.ones(16, device=runtime.DEVICE)
    with runtime.skip_launches():
        y = liger_lab.layer_norm(x, weight, weight)
        with pytest.raises(ValueError, match="weight has shape"):
            liger_lab.layer_norm(x, weight[:3], weight)
    assert y.shape == x.shape
    expected = torch.nn.functional.layer_norm(x, (16,), weight, weight)
    torch.testing.assert_close(liger_lab.layer_norm(x, weight, weight), expected, rtol=1e-5, atol=1e-5)


def test_every_public_name_of_the_old_module_is_still_there():
    """The package split into device, launch and timing keeps the names code reads from ``liger_lab.runtime``."""
    names = ("BACKEND DEVICE HOST_READS_WAIT INTERPRET MAX_ROW_SIZE ElementwiseLaunch RowLaunch check_device describe "
             "device_context elementwise_launch kernel_times_ms launch_kernel measure_graph_ms measure_kernel_sum_ms "
             "measure_ms peak_memory_bytes persistent_row_launch pick read_later row_launch shared_memory_bytes "
             "sm_count streaming_row_launch synchronize timer_label column_sum_launch triton").split()  # fmt: skip
    assert [name for name in names if not hasattr(runtime, name)] == []


def test_read_later_returns_the_values():
    values = torch.arange(4, device=runtime.DEVICE) * 3
    read = runtime.read_later(values)
    assert read() == [0, 3, 6, 9]


def test_kernel_sum_clock():
    """The profiler's kernel sum: nothing to profile in the interpreter; on a GPU, the sum of the named kernels."""
    x = torch.randn(1 << 20, device=runtime.DEVICE)
    if runtime.INTERPRET:
        assert runtime.kernel_times_ms(lambda: x * 2) == {} and runtime.measure_kernel_sum_ms(lambda: x * 2) is None
        return
    times = runtime.kernel_times_ms(lambda: x * 2, calls=3)
    assert times and all(ms > 0 for ms in times.values())
    assert 0 < runtime.measure_kernel_sum_ms(lambda: x * 2, calls=3) < 10 * sum(times.values())


@pytest.mark.parametrize("n_rows,n_cols", [(1, 1), (132, 8192), (300, 100)])
def test_column_sum_strips_cover_every_column_and_row(n_rows, n_cols):
    launch = runtime.column_sum_launch(n_rows, n_cols, hardware=H200)
    assert launch.grid * launch.block_n >= n_cols > (launch.grid - 1) * launch.block_n
    assert launch.rows >= min(n_rows, 256)  # an SM count's partial rows in one step


@pytest.mark.parametrize("outputs", [1, 2])
@pytest.mark.parametrize("n_programs,n_cols", [(1, 7), (37, 5000), (4, 4096)])
def test_sum_partials_adds_each_column_in_one_launch(outputs, n_programs, n_cols):
    from liger_lab.ops.common import sum_partials

    # 37 programs of 10000 columns take several steps of rows in the interpreter: the loop and its masks run.
    partials = torch.randn(n_programs, outputs * n_cols, dtype=torch.float64).float().to(runtime.DEVICE)
    sums = sum_partials(partials, torch.bfloat16, outputs=outputs)
    expected = partials.double().sum(0).view(outputs, n_cols)
    assert len(sums) == outputs
    for got, want in zip(sums, expected, strict=True):
        assert got.dtype == torch.bfloat16 and got.shape == (n_cols,)
        # One bf16 rounding of an fp32 sum (to nearest: half a unit in the last place), plus the fp32 sum's own error.
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-5)


def test_sum_partials_rejects_a_shape_it_cannot_split():
    from liger_lab.ops.common import sum_partials

    with pytest.raises(ValueError, match="outputs"):
        sum_partials(torch.zeros(3, 5, device=runtime.DEVICE), torch.float32, outputs=2)
    with pytest.raises(ValueError, match="outputs"):
        sum_partials(torch.zeros(3, 8, device=runtime.DEVICE)[:, ::2], torch.float32)


def test_bf16_stores_round_to_nearest_even_like_torch():
    """fp32 -> bf16 casts in a kernel give torch's bf16 bit for bit, in the interpreter too (which truncates unless
    ``runtime`` makes it round): ties, overflow to infinity, subnormals, signed zeros and NaN."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask).to(out_ptr.dtype.element_ty), mask=mask)

    special = [float("nan"), float("-inf"), float("inf"), 3.4e38, -0.0, 1e-40, 1.00390625, 1.01171875, -1.01171875]
    x = torch.cat([torch.tensor(special), torch.randn(1000) * 10.0 ** torch.randint(-30, 30, (1000,))])
    x = x.to(runtime.DEVICE)
    out = torch.empty_like(x, dtype=torch.bfloat16)
    cast_kernel[(1,)](x, out, x.numel(), BLOCK=1024)
    expected = x.to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16)[1:], expected.view(torch.int16)[1:])
    assert out[0].isnan()


@triton.jit
def _ones_kernel(out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        tl.store(out_ptr + start + offsets, tl.full([BLOCK], 1, tl.int64), mask=start + offsets < n)


@pytest.mark.skipif(not runtime.INTERPRET, reason="the interpreter's scalars")
def test_runtime_scalar_bounds_a_loop_where_the_interpreter_converts_it_with_int(monkeypatch):
    """Triton 3.6's interpreter turns a scalar into an int with int(one-element array), which NumPy 2.4 refuses."""
    from triton.runtime import interpreter

    def patch_as_triton_3_6(tensor, scope):
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(1, 1)))  # never 0-d

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_as_triton_3_6)
    runtime.device._index_scalars_in_interpreter()
    out = torch.zeros(10, dtype=torch.int64)
    runtime.launch_kernel(_ones_kernel, (1,), out, out.numel(), BLOCK=4)
    assert out.tolist() == [1] * 10


def _keyed_kernel(x_ptr, n, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr = 4, r_ptr=None):
    pass


def test_a_launch_key_tells_apart_every_specialization_triton_compiles():
    """The GPU's direct launches reuse a compiled kernel for every launch with the same key: a key coarser than
    Triton's own would run a kernel compiled for other constexprs or alignments (silently wrong results)."""
    kernel = triton.runtime.JITFunction(_keyed_kernel)
    x = torch.empty(64)

    def key(*args, **kwargs):
        return runtime.device.launch_key(kernel, 0, args, {"ROWS": 4, "num_warps": 4, **kwargs})

    base = key(x, 1000, 1e-5)
    assert base == key(torch.empty(64), 1000 + 16 * 7, 3e-5)  # another tensor, n of the same kind, another eps
    different = [
        key(x, 1000, 1e-5, ROWS=8),  # a constexpr's value
        key(x, 1000, 1e-5, BLOCK=4),  # a constexpr given, even at its default (Triton keys it the same; finer is safe)
        key(x, 1000, 1e-5, num_warps=8),  # a launch option
        key(x[1:], 1000, 1e-5),  # a pointer off 16-byte alignment
        key(x.double(), 1000, 1e-5),  # a dtype
        key(x, 1, 1e-5),  # an integer equal to 1 (Triton makes it a constant)
        key(x, 1024, 1e-5),  # an integer divisible by 16
        key(x, 2**31, 1e-5),  # a 64-bit integer
        key(x, 1000, 1),  # an integer where a float was
        key(x, 1000, 1e-5, r_ptr=x),  # a tensor where None was
        key(x, 1000, 1e-5, r_ptr=torch.empty(4, dtype=torch.int32)),
    ]
    assert len({base, *different}) == len(different) + 1
    assert id(x) not in base and x.data_ptr() not in base  # tensors by kind, never by address: no key per tensor
