"""Runtime: device selection, errors, memory paths, recorded command buffers."""
import struct

import numpy as np
import pytest
import vulkan as vk

from vkdsl.compiler import compile_glsl
from vkdsl.runtime import Buffer, Recording, get_kernel, list_devices, select
from vkdsl.runtime.errors import DeviceNotFound, VulkanError, vkcall

SCALE = """#version 450
layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(std430, binding = 0) buffer B { float x[]; };
layout(push_constant) uniform P { float k; uint n; };
void main() { uint i = gl_GlobalInvocationID.x; if (i < n) x[i] *= k; }
"""


def test_devices_listed_with_limits():
    devs = list_devices()
    assert devs, "at least one Vulkan device (lavapipe in CI)"
    for d in devs:
        assert d.kind in ("discrete", "integrated", "virtual", "cpu", "other")
        assert d.limits.max_storage_buffer_range >= 2**27 or d.kind != "cpu"
        assert d.limits.max_workgroup_invocations >= 128     # Vulkan's required minimum
        assert d.limits.subgroup_size >= 1
        assert d.heaps and all(b > 0 for b, _ in d.heaps)


def test_missing_device_lists_what_is_there(monkeypatch):
    monkeypatch.delenv("VKDSL_DEVICE", raising=False)
    with pytest.raises(DeviceNotFound) as e:
        select("no-such-gpu-xyz")
    assert list_devices()[0].name in str(e.value)
    with pytest.raises(DeviceNotFound, match="index 99 does not exist"):
        select(99)


def test_env_selects_device(monkeypatch):
    d0 = list_devices()[0]
    monkeypatch.setenv("VKDSL_DEVICE", "0")
    assert select().index == d0.index


def test_vulkan_error_names_result_and_call():
    def fail(*a):
        raise vk.exception_codes[-2]()
    fail.__name__ = "vkAllocateMemory"
    with pytest.raises(VulkanError, match="vkAllocateMemory failed with VK_ERROR_OUT_OF_DEVICE_MEMORY"):
        vkcall(fail)


@pytest.mark.parametrize("host", [True, False], ids=["host-mapped", "staged"])
def test_buffer_roundtrip_both_memory_paths(dev, host, rng):
    a = rng.standard_normal(1023).astype(np.float32)
    b = Buffer(dev, a.nbytes, host=host)
    b.write(a)
    np.testing.assert_array_equal(b.read(np.float32), a)


def test_staged_buffer_used_by_kernel(dev):
    """Device-local + staging path (what a discrete GPU uses) through a real dispatch."""
    k = get_kernel(dev, "scale", compile_glsl("scale", SCALE), 1, 8)
    b = Buffer(dev, 4 * 100, host=False)
    b.write(np.arange(100, dtype=np.float32))
    rec = Recording(dev, 2)
    rec.dispatch(k, [b], (2,), struct.pack("fI", 3.0, 100))
    rec.dispatch(k, [b], (2,), struct.pack("fI", 0.5, 100))
    rec.submit_wait()
    assert rec.n_barriers == 1          # the second dispatch reads what the first wrote
    np.testing.assert_array_equal(b.read(np.float32), np.arange(100) * 1.5)
    rec.submit_wait()                   # replay applies the same commands again
    np.testing.assert_array_equal(b.read(np.float32), np.arange(100) * 2.25)
    rec.release()


def test_barriers_follow_every_hazard(dev):
    """A barrier between two commands exactly when the second reads what the first wrote, or
    writes what an earlier command since the last barrier read or wrote (the hazards, counted
    here from their definition)."""
    k = get_kernel(dev, "scale", compile_glsl("scale", SCALE), 1, 8)
    a, b, c = (Buffer(dev, 400) for _ in range(3))
    rec = Recording(dev, 4)
    rec.copy(a, b, 400)                 # reads a, writes b
    rec.copy(c, a, 400)                 # writes a after it was read: write-after-read
    rec.dispatch(k, [c], (2,), struct.pack("fI", 2.0, 100))     # c read above, now written
    rec.copy(b, a, 400)                 # a written (and b written) before the last barrier only
    assert rec.n_barriers == 2
    rec.release()


def test_dispatch_checks_arguments(dev):
    k = get_kernel(dev, "scale", compile_glsl("scale", SCALE), 1, 8)
    rec = Recording(dev, 1)
    b = Buffer(dev, 16)
    with pytest.raises(ValueError, match="push constants are 8 bytes"):
        rec.dispatch(k, [b], (1,), b"1234")
    with pytest.raises(ValueError, match="takes 1 buffers"):
        rec.dispatch(k, [b, b], (1,), struct.pack("fI", 1, 1))
    with pytest.raises(ValueError, match="exceed the device limit"):
        rec.dispatch(k, [b], (10**9,), struct.pack("fI", 1, 1))


def test_workgroup_limits_enforced(dev):
    with pytest.raises(ValueError, match="exceeds the device limits"):
        get_kernel(dev, "scale", compile_glsl("scale", SCALE), 1, 8, local_size=(4096, 1, 1))


def _shared_kernel(shared: str = "", reads: str = "0.0", local: str = "local_size_x_id = 0") -> str:
    """A kernel declaring `shared` and storing `reads` (an expression over them: the optimizer
    keeps only shared variables that are read)."""
    return (f"#version 450\n#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require\n"
            f"layout({local}) in;\nlayout(std430, binding = 0) buffer B {{ float x[]; }};\n{shared}\n"
            f"void main() {{ uint i = gl_LocalInvocationID.x; x[i] = float({reads}); }}\n")


def test_a_shaders_own_sizes_are_read_and_refused_beyond_the_device(dev):
    from vkdsl.runtime.spirv_limits import needs
    # bytes counted from the declarations: 100 floats, 10 vec4s, a 4 x 8 array of 16-bit halves
    src = _shared_kernel("shared float a[100]; shared vec4 b[10]; shared float16_t c[4][8];",
                         "a[i] + b[i].y + float(c[i][i])")
    assert needs(compile_glsl("count", src)) == (None, 100 * 4 + 10 * 16 + 4 * 8 * 2)
    assert needs(compile_glsl("fixed", _shared_kernel(local="local_size_x = 32, local_size_y = 2"))) \
        == ((32, 2, 1), 0)
    too_much = dev.limits.max_shared_memory // 4 + 1               # one float beyond the limit
    with pytest.raises(ValueError, match="beyond the device's maxComputeSharedMemorySize"):
        get_kernel(dev, "big_shared", compile_glsl("big_shared", _shared_kernel(
            f"shared float s[{too_much}];", "s[i]")), 1)
    wide = dev.limits.max_workgroup_invocations // 32 * 2               # twice the invocations
    with pytest.raises(ValueError, match=r"its shader fixes workgroup \(32, %d, 1\)" % wide):
        get_kernel(dev, "wide", compile_glsl("wide", _shared_kernel(
            local=f"local_size_x = 32, local_size_y = {wide}")), 1)


_SCALE_RUN = """
import numpy as np
from vkdsl.compiler import compile_glsl
from vkdsl.runtime import Buffer, Recording, default_device, get_kernel
import test_runtime as T
dev = default_device()
k = get_kernel(dev, "scale", compile_glsl("scale", T.SCALE), 1, 8)
b = Buffer(dev, 16); b.write(np.ones(4, np.float32))
rec = Recording(dev, 1); rec.dispatch(k, [b], (1, 1, 1), T.struct.pack("<fI", 3.0, 4)); rec.submit_wait()
assert (b.read(np.float32, 4) == 3.0).all()
"""


@pytest.mark.parametrize("plant, said", [
    (lambda head: b"\x07" * 11, True),                                   # shorter than the header
    (lambda head: head[:8] + struct.pack("<I", 0xBEEF) + head[12:], True),  # another vendor
    (lambda head: head[:16] + bytes(16), True),                          # another driver build's UUID
    (lambda head: head, False),                                           # this driver's own header
])
def test_pipeline_cache_from_another_driver_is_rebuilt_in_one_line(tmp_path, monkeypatch, plant, said):
    import os
    import subprocess
    import sys
    from vkdsl.runtime import default_device
    from vkdsl.runtime.pipeline_cache import HEADER, _identity, cache_path
    monkeypatch.setenv("VKDSL_CACHE_DIR", str(tmp_path))
    pd = default_device().info.handle
    vendor, device, _, uuid = _identity(pd)
    path = cache_path(pd)
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(plant(HEADER.pack(HEADER.size, 1, vendor, device, uuid)))
    p = subprocess.run([sys.executable, "-c", _SCALE_RUN], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=os.path.dirname(__file__)))
    assert p.returncode == 0, p.stderr
    lines = [l for l in p.stderr.splitlines() if "pipeline cache" in l]
    assert lines == ([f"vkdsl: pipeline cache {path} is damaged or from another driver; rebuilding it"]
                     if said else [])


_MATMULS = """
import sys
import numpy as np
import vkdsl
for m, k, n in {shapes}:
    a, b = np.ones((m, k), np.float32), np.ones((k, n), np.float32)
    assert float(vkdsl.trace(lambda x, y: x @ y)(a, b)[0, 0]) == k
print(vkdsl.runtime.default_device().info.driver)
"""


def _shaders_compiled(tmp_path, name, shapes):
    """Files in llvmpipe's shader cache (one per compiled shader variant) after a process ran the
    fp32 matmul at these shapes with an empty cache."""
    import os
    import subprocess
    import sys
    home = tmp_path / name
    # one file per compiled variant (Mesa 23.1+ defaults to a single database file instead)
    env = dict(os.environ, XDG_CACHE_HOME=str(home), VKDSL_SPIRV_SHIPPED="1",
               MESA_DISK_CACHE_MULTI_FILE="1")
    for v in ("MESA_SHADER_CACHE_DIR", "MESA_DISK_CACHE_SINGLE_FILE", "MESA_SHADER_CACHE_DISABLE"):
        env.pop(v, None)
    p = subprocess.run([sys.executable, "-c", _MATMULS.format(shapes=shapes)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    files = [f for d, _, fs in os.walk(home / "mesa_shader_cache") for f in fs if f != "index"]
    return len(files), p.stdout


def test_a_kernel_compiles_once_whatever_its_buffers_sizes(tmp_path):
    """llvmpipe keys a compiled shader by two bits of each texel buffer's size; before buffers were
    sized to hold them fixed, every new matmul shape compiled the same kernel again (1.5 s each)."""
    one, driver = _shaders_compiled(tmp_path, "one", [(256, 256, 256)])
    if "llvmpipe" not in driver:
        pytest.skip(f"llvmpipe's shader variants; this device runs {driver.strip()}")
    three, _ = _shaders_compiled(tmp_path, "three", [(256, 256, 256), (250, 256, 256),
                                                     (240, 256, 200)])
    assert one > 0 and three == one, (one, three)
